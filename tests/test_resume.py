"""Interrupted runs resume the same trajectory: kill -9 and SIGTERM under 2 real gloo processes with
accumulation, 2 dataloader workers per rank, shuffling and dropout; fp16 scaler state; mismatches."""

import signal
import subprocess

import pytest
import torch

import recipe_runner as rr
from lmpretrain.analysis.wandb_offline import find_offline_runs, read_offline_run
from lmpretrain.checkpoint.checkpointer import Checkpointer

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

# 2 ranks x micro-batch 4 x accumulation 2, 2 workers per rank, dropout on (so RNG state matters).
DDP_RUN = [
    *rr.QUICK,
    "--train.max_steps=24",
    "--checkpoint.every=8",
    "--eval.every=8",
    "--data.num_workers=2",
    "--model.overrides.attention_dropout=0.1",
]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return rr.run(tmp_path_factory.mktemp("straight") / "run", *DDP_RUN, launch="cpu-ddp")


def interrupted_then_resumed(out, sig) -> tuple[int, rr.Run]:
    log = open(out.parent / f"{out.name}.log", "w")
    proc = rr.start_forked(out, *DDP_RUN, launch="cpu-ddp", log=log)
    rr.wait_for_step(proc, out, 10)
    rr.kill_tree(proc, sig)
    proc.wait(timeout=120)
    stopped_at = rr.read_metrics(out)[-1]["step"]
    assert stopped_at < 24, "the run finished before it could be interrupted"
    return stopped_at, rr.run(out, *DDP_RUN, launch="cpu-ddp")


def assert_same_trajectory(straight, resumed):
    assert rr.file_sha256(straight.out / "final" / "model.safetensors") == rr.file_sha256(
        resumed.out / "final" / "model.safetensors"
    )
    a, b = straight.metrics(), resumed.metrics()
    assert [r["step"] for r in b] == list(range(0, 25))  # baseline eval + every step, none twice
    for x, y in zip(a, b, strict=True):
        assert (x.get("train/loss"), x.get("train/grad_norm"), x.get("eval/loss")) == (
            y.get("train/loss"),
            y.get("train/grad_norm"),
            y.get("eval/loss"),
        ), x["step"]


def test_straight_run_has_identical_replicas(straight):
    line = next(t for t in straight.output.splitlines() if "parameter sha256 per rank" in t)
    digests = line.split(":")[-1].split()
    assert len(digests) == 2 and digests[0] == digests[1]
    assert "world_size=2 distributed_type=MULTI_CPU backend=gloo" in straight.output


def test_kill_9_mid_run_then_resume_is_bit_identical(straight, tmp_path):
    out = tmp_path / "killed"
    killed_at, resumed = interrupted_then_resumed(out, signal.SIGKILL)
    resumed_from = 8 * (killed_at // 8)
    assert (
        f"resumed from {out / 'checkpoints' / f'step-{resumed_from:08d}'} at step {resumed_from}"
        in resumed.output
    )
    assert_same_trajectory(straight, resumed)
    assert_resumed_same_wandb_run(out, killed_at)


def test_sigterm_saves_exits_and_resumes_bit_identical(straight, tmp_path):
    out = tmp_path / "terminated"
    stopped_at, resumed = interrupted_then_resumed(out, signal.SIGTERM)
    log = (out.parent / "terminated.log").read_text()
    assert "received SIGTERM: will save after this step and exit" in log
    assert f"stopped by signal after step {stopped_at}" in log
    assert (
        f"resumed from {out / 'checkpoints' / f'step-{stopped_at:08d}'} at step {stopped_at}"
        in resumed.output
    )
    assert_same_trajectory(straight, resumed)
    assert_resumed_same_wandb_run(out, stopped_at)


def assert_resumed_same_wandb_run(out, stopped_at):
    """The resumed process logs into the run id saved in the checkpoint, only the steps after the stop.

    The signal also reaches W&B's own service process, so the first process may not have flushed
    its last records; metrics.jsonl is the durable log (and is checked for every step above).
    """
    saved = torch.load(out / "checkpoints" / "step-00000024" / "states.pt", weights_only=True)["train"]
    first, last = (read_offline_run(d) for d in find_offline_runs(out))
    assert last["id"] == saved["wandb_run_id"] and first["id"] in (None, saved["wandb_run_id"])
    assert [h["_step"] for h in last["history"] if "train/loss" in h] == list(range(stopped_at + 1, 25))
    first_steps = [h["_step"] for h in first["history"] if "train/loss" in h]
    assert first_steps == list(range(1, len(first_steps) + 1)) and len(first_steps) <= stopped_at


def test_sigterm_single_process_exits_0(tmp_path):
    out = tmp_path / "single"
    proc = rr.start(
        out,
        *rr.QUICK,
        "--train.max_steps=400",
        "--checkpoint.every=0",
        "--eval.every=0",
        "--logging.wandb_mode=disabled",
        launch=None,
        log=subprocess.PIPE,
    )
    rr.wait_for_step(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, output
    step = rr.read_metrics(out)[-1]["step"]
    assert Checkpointer(out).latest().name == f"step-{step:08d}" and step < 400


def resume_copy(run: rr.Run, dst, from_step: int):
    """A copy of a finished run as it was right after checkpoint `from_step` (later state removed)."""
    import shutil

    shutil.copytree(run.out, dst)
    for ckpt in (dst / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > from_step:
            shutil.rmtree(ckpt)
    shutil.rmtree(dst / "final")
    return dst


def test_fp16_loss_scale_survives_resume(tmp_path):
    args = [
        *rr.QUICK,
        "--train.precision=fp16",
        "--train.loss_scale_init=1073741824",
        "--train.max_steps=12",
        "--checkpoint.every=6",
        "--eval.every=0",
        "--logging.wandb_mode=disabled",
    ]
    straight = rr.run(tmp_path / "a", *args, launch=None)
    scales = [r["train/loss_scale"] for r in straight.metrics()]
    assert scales[5] < 2.0**30 / 4  # the scale moved before the checkpoint
    resumed = rr.run(resume_copy(straight, tmp_path / "b", 6), *args, launch=None)
    assert "at step 6" in resumed.output
    assert [r["train/loss_scale"] for r in resumed.metrics()] == scales
    assert [r["train/skipped_steps"] for r in resumed.metrics()] == [
        r["train/skipped_steps"] for r in straight.metrics()
    ]
    assert rr.file_sha256(straight.out / "final/model.safetensors") == rr.file_sha256(
        resumed.out / "final/model.safetensors"
    )


def test_mismatched_resume_is_refused_with_the_differences(straight, tmp_path):
    out = resume_copy(straight, tmp_path / "copy", 16)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    refused = rr.run(
        out, *DDP_RUN, "--data.seq_len=32", "--train.micro_batch_size=8", launch=None, check=False
    )
    assert refused.returncode == 2, refused.output
    assert "seq_len: 64 -> 32" in refused.output and "world_size: 2 -> 1" not in refused.output
    assert "'--run.allow_mismatch=[seq_len]'" in refused.output  # the layout needs no flag
    assert "world size changes 2 -> 1 but the global batch stays 16" in refused.output
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == {p: b for p, b in before.items() if p.name != ".lock"}  # a refused resume writes nothing

    # Same global batch on 1 process instead of 2: no flag needed, and the data continues exactly.
    moved = rr.run(out, *DDP_RUN, "--train.micro_batch_size=8", launch=None)
    assert "at step 16" in moved.output and "fingerprint difference" not in moved.output
    assert "resuming with another layout (world_size 2 -> 1, micro_batch_size 4 -> 8)" in moved.output
    # Close, not equal: rank 1's dropout masks now come from rank 0's RNG, and sums reassociate.
    # (That the data position carries over exactly across world sizes is tested in test_data.py.)
    tail = moved.losses()
    ref = straight.losses()
    assert [tail[s] for s in range(17, 25)] == pytest.approx([ref[s] for s in range(17, 25)], rel=5e-3)


def test_resume_never_refuses_to_overwrite(straight, tmp_path):
    out = resume_copy(straight, tmp_path / "copy", 16)
    refused = rr.run(out, *DDP_RUN, "--run.resume=never", launch=None, check=False)
    assert refused.returncode == 2 and "--run.overwrite=true" in refused.output, refused.output
    assert Checkpointer(out).latest().name == "step-00000016"
