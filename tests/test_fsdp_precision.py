"""FSDP2 mixed precision on 2 CPU ranks over gloo (gloo all-gathers bf16 and reduce-scatters fp32 and
bf16, so the policy runs here as on GPUs): with train.precision=bf16 the recipe gives fully_shard
MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), and trains like DDP with bf16 autocast."""

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import recipe_runner as rr
from lmpretrain.config import config_problems, load_config
from lmpretrain.model.sharded_precision import fsdp_policy

BF16 = [
    *rr.QUICK,
    "--train.precision=bf16",
    "--train.max_steps=20",
    "--optim.warmup_steps=4",
    "--eval.every=10",
    "--eval.batches=2",
    "--checkpoint.every=10",
    "--train.micro_batch_size=2",
    "--train.grad_accum_steps=2",
    "--logging.wandb_mode=disabled",
]
# bf16 has 8 significant bits: the two runs round differently where DDP multiplies by an fp32 weight
# (RMSNorm scales, the embedding lookup) and FSDP2 by its bf16 copy. Measured over these 20 steps: losses
# within 1.2e-4 relative, final weights within 8.1e-3 (docs/gpu.md); the bounds leave ~16x and ~2.5x.
LOSS_RTOL, WEIGHT_RTOL = 2e-3, 2e-2


def dtypes_saved(checkpoint) -> dict[str, set[str]]:
    """The dtypes of the model and optimizer tensors a sharded checkpoint holds, by kind."""
    found: dict[str, set[str]] = {"model": set(), "optimizer": set()}
    for fqn, meta in FileSystemReader(str(checkpoint / "dcp")).read_metadata().state_dict_metadata.items():
        kind = fqn.split(".")[0]
        if kind in found and isinstance(meta, TensorStorageMetadata) and not fqn.endswith(".step"):
            found[kind].add(str(meta.properties.dtype).removeprefix("torch."))
    return found


@pytest.mark.slow
def test_fsdp2_bf16_policy_trains_like_ddp_with_bf16_autocast(tmp_path):
    fsdp = rr.run(tmp_path / "fsdp", *BF16, launch="cpu-fsdp", timeout=600)
    ddp = rr.run(tmp_path / "ddp", *BF16, launch="cpu-ddp", timeout=600)
    assert (
        "FSDP2 mixed precision: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on 6 units; "
        "a forward gathers bfloat16 parameters from float32 shards (master weights and optimizer state), "
        "gradients are reduce-scattered in float32"
    ) in fsdp.output
    # What was really stepped and saved: fp32 master weights and fp32 AdamW moments, sharded.
    assert dtypes_saved(fsdp.out / "checkpoints" / "step-00000020") == {
        "model": {"float32"},
        "optimizer": {"float32"},
    }
    worst = 0.0
    for x, y in zip(fsdp.metrics(), ddp.metrics(), strict=True):
        for key in ("train/loss", "eval/loss"):
            if key in y:
                worst = max(worst, abs(x[key] - y[key]) / y[key])
    weights = rr.rel_diff(fsdp.weights(), ddp.weights())
    print(f"FSDP2 bf16 policy vs DDP bf16 autocast: worst loss difference {worst:.2e}, weights {weights:.2e}")
    assert worst < LOSS_RTOL and weights < WEIGHT_RTOL
    assert fsdp.losses()[20] < fsdp.losses()[1] - 0.5  # it trained
    assert all(t.dtype == torch.float32 for t in fsdp.weights().values())  # the export: whole fp32 weights


@pytest.mark.slow
def test_reduce_dtype_bfloat16_reduce_scatters_in_bf16(tmp_path):
    run = rr.run(
        tmp_path / "run",
        *BF16,
        "--train.max_steps=2",
        "--optim.warmup_steps=1",
        "--train.fsdp_reduce_dtype=bfloat16",
        launch="cpu-fsdp",
        timeout=600,
    )
    assert "reduce_dtype=bfloat16) on 6 units" in run.output
    assert (
        "from float32 shards (master weights and optimizer state), gradients are reduce-scattered in bfloat16"
        in run.output
    )


def test_the_policy_follows_precision_and_reduce_dtype():
    def cfg(*overrides):
        return load_config([str(rr.SMOKE), *overrides])

    policy = fsdp_policy(cfg("--train.precision=bf16").train)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    policy = fsdp_policy(cfg("--train.precision=bf16", "--train.fsdp_reduce_dtype=bfloat16").train)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    assert fsdp_policy(cfg("--train.precision=fp16").train) is None and fsdp_policy(cfg().train) is None
    assert config_problems(cfg("--train.fsdp_reduce_dtype=bfloat16"), 1) == [
        "train.fsdp_reduce_dtype=bfloat16 belongs to FSDP2's bf16 policy and would do nothing with "
        "train.precision=no: set train.precision=bf16 or leave it at float32"
    ]
