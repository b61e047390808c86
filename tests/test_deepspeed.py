"""DeepSpeed ZeRO-2 through accelerate, for real: DeepSpeed's CPU accelerator runs it over gloo here.

The engine owns accumulation boundaries, clipping and the optimizer step, and its optimizer state is
partitioned across ranks. These runs prove it trains like DDP, holds half the optimizer state per
rank, resumes bit-identically from a kill -9, and that launches it cannot honour are refused.
"""

import math
import shutil
import signal

import plan_check
import pytest
import torch

import recipe_runner as rr

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

DS = "deepspeed-zero2"
TWO = ["--num_processes", "2"]
# The DDP run of the two_ranks_accum2 fixture, under ZeRO-2 (float64 weights, float32 master copies).
EXACT = [*rr.EXACT, "--train.micro_batch_size=2", "--train.grad_accum_steps=2"]
# Dropout on and 2 workers per rank, so RNG and data state must both come back on resume.
RESUMABLE = [
    *rr.QUICK,
    "--train.max_steps=16",
    "--checkpoint.every=6",
    "--eval.every=6",
    "--data.num_workers=2",
    "--model.overrides.attention_dropout=0.1",
    "--logging.wandb_mode=disabled",
]


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    return rr.run(tmp_path_factory.mktemp("zero2") / "run", *EXACT, launch=DS, launch_args=TWO)


def test_zero2_runs_what_it_says(zero2):
    assert "world_size=2 distributed_type=DEEPSPEED backend=gloo device=cpu" in zero2.output
    assert "sharding=deepspeed-zero2" in zero2.output
    assert "Setting accelerator to CPU" in zero2.output  # DeepSpeed launches import it (and only they)
    assert "checkpoints: format=full: whole weights from rank 0" in zero2.output
    assert "DeepSpeed precision: weights float64, master weights and optimizer state float32" in zero2.output
    line = next(t for t in zero2.output.splitlines() if "parameter sha256 per rank" in t)
    digests = line.split(":")[-1].split()
    assert len(digests) == 2 and digests[0] == digests[1]


def test_zero2_trains_like_ddp(zero2, two_ranks_accum2):
    """Same losses, grad norms (DeepSpeed's own, pre-clip) and weights as DDP, within float32 master copies."""
    for x, y in zip(zero2.metrics(), two_ranks_accum2.metrics(), strict=True):
        assert x.keys() == y.keys(), x["step"]
        for key in ("train/loss", "train/grad_norm", "eval/loss", "train/lr"):
            assert x.get(key, 0.0) == pytest.approx(y.get(key, 0.0), rel=1e-6), (key, x["step"])
    assert rr.rel_diff(zero2.weights(), two_ranks_accum2.weights()) < 1e-6


def test_zero2_holds_half_the_optimizer_state_per_rank(zero2, two_ranks_accum2):
    full = torch.load(
        two_ranks_accum2.out / "checkpoints" / "step-00000010" / "optimizer.pt", weights_only=True
    )
    total = sum(s["exp_avg"].numel() for s in full["state"].values())
    per_rank = []
    for rank in (0, 1):
        # DeepSpeed's own file format (pickled objects): read back as DeepSpeed itself does.
        path = (
            zero2.out
            / "checkpoints"
            / "step-00000010"
            / "deepspeed"
            / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        )
        state = torch.load(path, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"]
        per_rank.append(sum(s["exp_avg"].numel() for s in state.values()))
        assert all(s["exp_avg_sq"].numel() == s["exp_avg"].numel() for s in state.values())
    assert sum(per_rank) == total
    assert all(abs(n - total / 2) <= 64 for n in per_rank), (per_rank, total)  # partitions are aligned


def test_the_plan_says_what_zero2_held(zero2):
    """The planner's ZeRO-2 arithmetic against step 2 of the real engine on rank 0 (tests/plan_check.py):
    the whole 16-bit-or-wider weights, this rank's fp32 gradient partition, its fp32 master partition and
    moments, exactly; DeepSpeed's collectives within 2% too."""
    # ZeRO-2 runs unwrapped in the simulation, its buckets and partitions as arithmetic: its peak is not compared
    figures, off = plan_check.compare(zero2, DS, peak=False)
    assert off == [] and figures["optimizer"][1] < figures["params"][1], figures  # partitioned


def test_zero2_kill_9_then_resume_is_bit_identical(tmp_path):
    straight = rr.run(tmp_path / "straight", *RESUMABLE, launch=DS, launch_args=TWO)
    out = tmp_path / "killed"
    with open(tmp_path / "killed.log", "w") as log:
        proc = rr.start_forked(out, *RESUMABLE, launch=DS, launch_args=TWO, log=log)
        rr.wait_for_step(proc, out, 8)
        rr.kill_tree(proc, signal.SIGKILL)
        proc.wait(timeout=120)
    killed_at = rr.read_metrics(out)[-1]["step"]
    assert killed_at < 16, "the run finished before it could be killed"
    resumed = rr.run(out, *RESUMABLE, launch=DS, launch_args=TWO)
    resumed_from = 6 * (killed_at // 6)
    assert (
        f"resumed from {out / 'checkpoints' / f'step-{resumed_from:08d}'} at step {resumed_from}"
        in resumed.output
    )
    assert rr.file_sha256(straight.out / "final" / "model.safetensors") == rr.file_sha256(
        resumed.out / "final" / "model.safetensors"
    )
    for x, y in zip(straight.metrics(), resumed.metrics(), strict=True):
        assert (x["step"], x.get("train/loss"), x.get("train/grad_norm"), x.get("eval/loss")) == (
            y["step"],
            y.get("train/loss"),
            y.get("train/grad_norm"),
            y.get("eval/loss"),
        )


def refused(tmp_path, *overrides, launch_args=TWO, out=None) -> str:
    run = rr.run(
        out or tmp_path / "run",
        *rr.QUICK,
        "--logging.wandb_mode=disabled",
        *overrides,
        launch=DS,
        launch_args=launch_args,
        check=False,
    )
    assert run.returncode != 0, run.output[-3000:]
    assert "pretrain:" not in run.output
    return run.output


def test_zero3_is_refused(tmp_path):
    out = refused(tmp_path, launch_args=[*TWO, "--zero_stage", "3"])
    assert "DeepSpeed ZeRO stage 3 is not supported" in out and "fsdp.yaml" in out


def test_launch_flags_cannot_override_the_recipe_batch(tmp_path):
    out = refused(tmp_path, launch_args=[*TWO, "--gradient_accumulation_steps", "4"])
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4 but train.grad_accum_steps=2" in out


def deepspeed_has_fp16() -> bool:
    """The probe runtime.py asks before a DeepSpeed fp16 launch (on CPU: oneDNN fp16, e.g. AVX512-FP16/AMX)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().is_fp16_supported()


def test_fp16_runs_where_deepspeed_supports_it_and_is_refused_elsewhere(tmp_path):
    if not deepspeed_has_fp16():
        assert "DeepSpeed has no fp16 on cpu" in refused(tmp_path, "--train.precision=fp16")
        return
    # A CPU with fp16 support (AVX512-FP16 / AMX): the engine's fp16 with its loss scaling runs to the end.
    run = rr.run(
        tmp_path / "fp16",
        *rr.QUICK,
        "--train.precision=fp16",
        "--train.max_steps=6",
        "--eval.every=0",
        "--logging.wandb_mode=disabled",
        launch=DS,
        launch_args=TWO,
    )
    assert "done: step 6" in run.output
    losses = run.losses()
    assert sorted(losses) == list(range(1, 7)) and all(math.isfinite(x) for x in losses.values()), losses


def test_ddp_checkpoint_is_not_resumed_under_deepspeed(tmp_path, two_ranks_accum2):
    out = tmp_path / "from-ddp"
    shutil.copytree(two_ranks_accum2.out, out)
    msg = refused(tmp_path, *EXACT, "--train.max_steps=12", out=out)
    assert "was written without DeepSpeed" in msg
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000010"]  # nothing touched


def test_async_checkpoints_are_refused_under_deepspeed(tmp_path):
    out = refused(tmp_path, "--checkpoint.async_save=true")
    assert "checkpoint.async_save=true is not supported under DeepSpeed" in out
