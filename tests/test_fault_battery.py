"""The fault battery of docs/cluster.md, each ending as documented with nothing saved lost: SIGTERM while
an async save is in flight, the disk full during a save (a real file size limit: writes fail with EFBIG),
a token shard truncated while the run reads it, the coordinator's port taken. (A rank killed with -9 or
stopped with SIGSTOP: tests/test_restarts.py.)"""

import resource
import shutil
import signal
import socket
import subprocess

import pytest
import torch
from conftest import write_jsonl_shards

import recipe_runner as rr
from lmpretrain.checkpoint.checkpointer import MARKER_FILE

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

STEPS = [
    "--train.max_steps=12",
    "--checkpoint.every=4",
    "--checkpoint.async_save=true",
    "--eval.every=0",
    "--logging.wandb_mode=disabled",
    *rr.QUICK,
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, stdlib_cache):
    """One process, 12 steps, an async save every 4, never interrupted."""
    return rr.run(tmp_path_factory.mktemp("straight") / "run", *STEPS, launch=None)


def checkpoints(out) -> dict[str, bool]:
    """Every entry of checkpoints/ -> whether it is complete (has its marker)."""
    return {p.name: (p / MARKER_FILE).is_file() for p in sorted((out / "checkpoints").iterdir())}


def sole_error(output: str) -> str:
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


def interrupted(out, log_path, args, at_step: int, act, timeout: float) -> tuple[int, str]:
    """Start a one-process run, call `act(proc)` once step `at_step` is logged, wait for the run to end:
    its exit code and output."""
    with open(log_path, "w+") as log:
        proc = rr.start(out, *args, launch=None, log=log)
        try:
            rr.wait_for_step(proc, out, at_step)
            act(proc)
            proc.wait(timeout=timeout)
        finally:
            proc.kill()
        log.seek(0)
        return proc.returncode, log.read()


def test_sigterm_as_an_async_save_starts_saves_stops_and_resumes_bit_identically(tmp_path, straight):
    out = tmp_path / "run"
    # step 4 is logged just before its background save starts
    code, output = interrupted(
        out, tmp_path / "log.txt", STEPS, 4, lambda p: p.send_signal(signal.SIGTERM), 120
    )
    assert code == 0, output[-3000:]
    stopped_at = int(output.split("stopped by signal after step ")[1].split(";")[0])
    assert 4 <= stopped_at < 12
    # the save in flight was committed (not lost), then the stop's own; nothing half-written remains
    assert checkpoints(out) == {"step-00000004": True, f"step-{stopped_at:08d}": True}
    resumed = rr.run(out, *STEPS, launch=None)
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped_at:08d}'}" in resumed.output
    a, b = resumed.weights(), straight.weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_disk_full_save_fails_with_one_message_and_the_previous_checkpoint_intact(tmp_path, straight):
    out, step8 = tmp_path / "run", straight.out / "checkpoints" / "step-00000008"
    shutil.copytree(step8, out / "checkpoints" / step8.name)  # resumes at 8; step 12's save hits the limit
    sizes = sorted(p.stat().st_size for p in step8.iterdir())
    limit = sizes[-2] + 1  # every file but the largest of a checkpoint fits

    def file_size_limit():  # the child's writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = rr.command(out, *STEPS, launch=None)
    proc = subprocess.run(
        cmd, cwd=rr.ROOT, env=rr.env_for_runs(), capture_output=True, text=True, timeout=600,
        preexec_fn=file_size_limit,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    error = sole_error(output)
    assert error.startswith(f"error: failed to write step-00000012 in {out / 'checkpoints'}: "), error
    # torch.save's own error would be "unexpected pos 748288 vs 748180": the write's OSError is kept
    assert "OSError: [Errno 27] File too large: " in error, error
    assert error.endswith(
        "the previous checkpoints are intact (free space or raise the quota / file size "
        "limit, then resume with the same command)"
    ), error
    assert checkpoints(out) == {"step-00000008": True}  # no step 12, no .tmp-* left
    for p in step8.iterdir():
        assert rr.file_sha256(p) == rr.file_sha256(out / "checkpoints" / step8.name / p.name), p.name
    assert not (out / "final").exists()


def test_a_token_shard_truncated_mid_run_ends_naming_it_with_the_checkpoints_complete(tmp_path, stdlib_cache):
    from lmpretrain.data import SourceSpec
    from lmpretrain.data.prepare import write_token_files
    from lmpretrain.data.tokenizer import load_tokenizer

    paths = write_jsonl_shards(tmp_path / "text", [300, 300, 300], max_words=80)
    val = write_jsonl_shards(tmp_path / "val", [100], prefix="val", seed=1, max_words=80)
    write_token_files(SourceSpec(files=paths), load_tokenizer("builtin:python-stdlib"), tmp_path / "tok")
    shard = sorted((tmp_path / "tok").glob("*.bin"))[0]
    out = tmp_path / "run"
    data = [f"--data.train=[{{files: [{tmp_path / 'tok'}]}}]", f"--data.eval=[{{files: [{val[0]}]}}]"]
    args = [*STEPS, "--train.max_steps=200", *data]
    # after step 4's checkpoint the shard is truncated while the run reads it (a failed copy, a full disk)
    code, output = interrupted(out, tmp_path / "log.txt", args, 5, lambda _: shard.write_bytes(b""), 300)
    assert code == 2, output[-3000:]
    error = sole_error(output)
    assert error.startswith(f"error: token file {shard} ended early (read 0 of "), error
    saved = checkpoints(out)
    assert saved["step-00000004"] and all(saved.values()), saved  # whatever was saved is complete
    assert rr.read_metrics(out)[-1]["step"] < 200


def test_the_coordinators_port_taken_ends_on_one_message(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # machine 0 of 2 hosts the rendezvous (one machine alone would move to a free port, with a warning)
        where = ["--num_machines=2", "--machine_rank=0", "--main_process_ip=127.0.0.1"]
        run = rr.run(
            tmp_path / "run", *STEPS, launch="cpu-ddp", launcher=rr.LAUNCHER, check=False,
            launch_args=[*where, "--main_process_port", str(port)],
        )  # fmt: skip
    assert run.returncode == 2, run.output[-3000:]
    assert sole_error(run.output).startswith(
        f"error: Tried to launch distributed communication on port `{port}`, but another process is utilizing it"
    )
    assert not (tmp_path / "run").exists()  # refused before any rank started
