"""Failures as users meet them, through the README's launch command (`python -m lmpretrain.launch`,
accelerate launch's arguments): a diverging run skips its non-finite updates, never checkpoints
non-finite weights and stops with exit 2; every user error ends on its one message, with no traceback.
"""

import re

import pytest
import torch
from safetensors.torch import load_file

import recipe_runner as rr

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses


def via_launcher(out_dir, *overrides, launch="cpu", launch_args=()) -> rr.Run:
    """The recipe through `python -m lmpretrain.launch --config_file configs/accelerate/<launch>.yaml`."""
    return rr.run(
        out_dir, *overrides, launch=launch, launch_args=launch_args, launcher=rr.LAUNCHER, check=False
    )


def assert_ends_on(run: rr.Run, message: str) -> list[str]:
    """Exit 2, no traceback, and the output's last lines are the one error message, said once."""
    assert run.returncode == 2, run.output[-3000:]
    assert "Traceback" not in run.output, run.output[-3000:]
    tail = run.output.rstrip("\n")
    start = tail.rfind("error: ")
    assert start >= 0 and tail.count("error: ") == 1, run.output[-3000:]
    assert start == 0 or tail[start - 1] == "\n"  # on its own line: no progress bar left open before it
    assert tail[start:].startswith(f"error: {message}"), tail[start:]
    return tail[:start].splitlines()


def test_divergence_is_skipped_never_saved_and_stops_with_one_message(tmp_path):
    """The issue's reproduction (lr 1e4, no clipping, a checkpoint every step) on two DDP processes."""
    run = via_launcher(
        tmp_path / "diverged",
        "--optim.lr=1e4",
        "--train.max_grad_norm=0",
        "--checkpoint.every=1",
        *rr.QUICK,
        "--eval.every=0",
        "--logging.wandb_mode=disabled",
        launch="cpu-ddp",
    )
    before = assert_ends_on(run, "training diverged: the updates of steps ")
    assert "(10 in a row, train.max_skipped_steps=10) were all skipped" in run.output
    assert any(line.startswith("pretrain:") for line in before)  # the progress bar closed before it
    assert run.output.count("gradient norm is not finite; 10 in a row stop the run") == 1  # warned once
    rows = [r for r in run.metrics() if "train/loss" in r]
    bad = [r for r in rows if r["train/loss"] != r["train/loss"]]  # NaN
    assert len(bad) == 9 and rows[-1]["train/skipped_steps"] == 9  # the 10th raised before it was logged
    assert [r["train/skipped_steps"] for r in bad] == list(range(1, 10))
    assert len({r["train/lr"] for r in bad}) == 1  # the schedule waits while updates are skipped
    # No periodic save during the streak, so the last two (keep_last) are the two steps before it.
    checkpoints = sorted((run.out / "checkpoints").glob("step-*"))
    assert [int(p.name[5:]) for p in checkpoints] == [bad[0]["step"] - 2, bad[0]["step"] - 1]
    weights = [load_file(path / "model.safetensors") for path in checkpoints]
    for path, w in zip(checkpoints, weights, strict=True):
        moments = torch.load(path / "optimizer.pt", weights_only=True)["state"]
        assert all(torch.isfinite(t).all() for t in w.values()), path
        assert all(torch.isfinite(t).all() for s in moments.values() for t in s.values()), path
        assert torch.load(path / "states.pt", weights_only=True)["guard"]["consecutive"] == 0


def test_config_error_through_the_launcher_ends_on_the_message(tmp_path):
    run = via_launcher(
        tmp_path / "bad", "--train.max_step=5", launch_args=["--quiet"]
    )  # accelerate's flag too
    assert_ends_on(run, "1 problem(s) in ")
    assert run.output.rstrip().endswith("unknown key 'train.max_step'; did you mean 'max_steps'?")
    assert not (tmp_path / "bad").exists()
    assert "num_cpu_threads_per_process" not in run.output  # cpu.yaml states the threads: no warning


def test_missing_tokenizer_folder_ends_on_the_message(tmp_path):
    run = via_launcher(tmp_path / "run", "--data.tokenizer=tokenizers/mine")
    assert_ends_on(run, "data.tokenizer: 'tokenizers/mine' is neither a local folder (there is no directory ")
    assert "use builtin:python-stdlib" in run.output.splitlines()[-1]


def test_a_run_that_ends_while_skipping_updates_is_diverged_and_exports_nothing(tmp_path):
    """The issue's reproduction: steps 6-12 skip their updates, fewer than train.max_skipped_steps=10 in a
    row, and the run reaches max_steps. It used to print "done" and exit 0 with a NaN model in final/."""
    run = via_launcher(
        tmp_path / "stalled",
        "--optim.lr=1e4",
        "--train.max_grad_norm=0",
        "--train.max_steps=12",
        "--checkpoint.every=5",
        *rr.QUICK,
        "--logging.wandb_mode=disabled",
    )
    assert_ends_on(
        run,
        "training diverged: the run reached its last step 12 while skipping updates: those of steps 6-12 "
        "(7 in a row, fewer than train.max_skipped_steps=10) were all skipped",
    )
    assert "Nothing was exported" in run.output and "done:" not in run.output
    assert not (run.out / "final").exists()
    rows = {r["step"]: r for r in run.metrics()}
    assert rows[12]["train/skipped_steps"] == 7 and rows[12]["eval/loss"] != rows[12]["eval/loss"]  # NaN
    # Neither the periodic save (step 10) nor the final one ran during the streak: step 5's is the last.
    assert [p.name for p in (run.out / "checkpoints").glob("step-*")] == ["step-00000005"]


def test_a_run_whose_final_evaluation_is_not_finite_is_diverged_and_exports_nothing(tmp_path):
    """Step 5's update is applied (its loss and gradient norm are finite) and leaves weights whose
    held-out loss is NaN: the guard saw nothing to skip, the final evaluation does."""
    run = via_launcher(
        tmp_path / "nan-eval",
        "--optim.lr=1e4",
        "--train.max_grad_norm=0",
        "--train.max_steps=5",
        *rr.QUICK,
        "--logging.wandb_mode=disabled",
    )
    assert_ends_on(
        run, "training diverged: the final evaluation at step 5 has loss nan, so the model does not"
    )
    assert not (run.out / "final").exists()
    last = run.metrics()[-1]
    assert last["step"] == 5 and last["train/skipped_steps"] == 0 and last["train/loss"] == last["train/loss"]


def test_a_missing_data_file_fails_on_two_processes_before_the_model_is_built(tmp_path):
    """Data is opened before the model: a mistyped path costs seconds, not a model load."""
    missing = tmp_path / "no-such-dir" / "train.jsonl"
    run = via_launcher(tmp_path / "run", f"--data.train=[{{files: [{missing}]}}]", launch="cpu-ddp")
    before = assert_ends_on(run, f"data file or glob {str(missing)!r} matches nothing")
    assert not any("parameters; optimizer groups" in line for line in before)  # no model was built
    assert not any("failed (exitcode" in line for line in before)  # torch elastic's line is held back
    # and so is its "Sending process N closing signal SIGTERM" for the rank still running: no torch elastic
    # log line (`W1207 12:56:46.368000 ...` / `E1204 ...`) at all above the message
    assert not any(re.match(r"[EW]\d{4} \d\d:\d\d:\d\d", line) for line in before), before
    assert not (tmp_path / "run" / "checkpoints").exists()
