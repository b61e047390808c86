"""Runs that survive a rank: under `accelerate launch --max_restarts` a rank killed with -9, or stopped
(SIGSTOP) until the others' collective times out, makes torch elastic restart the group; the recipe
resumes the last complete checkpoint and ends with the weights of a run that was never interrupted."""

import signal

import psutil
import pytest
import torch

from recipe_runner import QUICK, Run, read_metrics, run, start, wait_for_step

pytestmark = pytest.mark.slow  # real 2-rank gloo launches

STEPS = ["--train.max_steps=12", "--checkpoint.every=4", "--logging.wandb_mode=disabled", *QUICK]
RESTARTABLE = ["--max_restarts=1", "--monitor_interval=1"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run every interrupted one must match: 2 ranks, 12 steps, never stopped."""
    return run(tmp_path_factory.mktemp("straight") / "run", *STEPS, launch="cpu-ddp")


def signal_rank(proc, rank: int, sig) -> None:
    """Send ``sig`` to the recipe process of ``rank`` under the launcher ``proc``."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        if child.environ().get("RANK") == str(rank) and "pretrain.py" in " ".join(child.cmdline()):
            child.send_signal(sig)
            return
    raise AssertionError(f"no rank {rank} under the launcher")


def interrupted_run(out, at_step: int, sig, *overrides) -> Run:
    log = (out.parent / "log.txt").open("w+")
    proc = start(out, *STEPS, *overrides, launch="cpu-ddp", launch_args=RESTARTABLE, log=log)
    try:
        wait_for_step(proc, out, at_step)
        signal_rank(proc, 1, sig)
        proc.wait(timeout=300)
    finally:
        proc.kill()
    log.seek(0)
    return Run(out, proc.returncode, log.read())


def assert_same_weights(a: Run, b: Run) -> None:
    wa, wb = a.weights(), b.weights()
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ from the straight run's"


@pytest.mark.parametrize("async_save", [False, True])
def test_a_rank_killed_is_restarted_and_ends_as_the_straight_run(tmp_path, straight, async_save):
    # async: the kill comes as step 8's background save starts; the restart resumes a complete checkpoint
    at = 8 if async_save else 6
    killed = interrupted_run(
        tmp_path / "run", at, signal.SIGKILL, f"--checkpoint.async_save={str(async_save).lower()}"
    )
    assert killed.returncode == 0, killed.output[-4000:]
    assert killed.output.count("[lmpretrain] restart 1 of at most 1: resuming") == 1
    assert "[lmpretrain] resumed from" in killed.output
    rows = read_metrics(killed.out)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 13))  # a resume rewrites the rest
    assert rows[-1]["run/restarts"] == 1 and rows[0].get("run/restarts", 0) == 0
    assert_same_weights(killed, straight)
    assert "straggler" not in straight.output  # ranks that load alike: no watchdog warning


def test_a_stopped_rank_ends_the_collective_named_and_the_job_restarts(tmp_path, straight):
    # the watch names it first, at 8 s, on its own (all NCCL would show); the collective's timeout at 20 s
    overrides = ("--run.collective_timeout_s=20", "--run.stall_report_s=8")
    stopped = interrupted_run(tmp_path / "run", 6, signal.SIGSTOP, *overrides)
    assert stopped.returncode == 0, stopped.output[-4000:]
    lines = stopped.output.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(errors) == 1, stopped.output[-4000:]
    named = [
        i
        for i, line in enumerate(lines)
        if "rank(s) 1 (stopped during step" in line and "no longer beat" in line
    ]
    assert len(named) == 1 and named[0] < errors[0], stopped.output[-4000:]
    errors = [lines[errors[0]]]
    assert errors[0].startswith(
        "error: rank 0 waited run.collective_timeout_s=20 s in a collective during step"
    )
    assert "for rank(s) 1 (stopped during step" in errors[0]
    assert "restart 1 of at most 1" in stopped.output
    assert_same_weights(stopped, straight)
