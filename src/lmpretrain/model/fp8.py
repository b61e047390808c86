"""Float8 training of the blocks' large Linear layers through torchao (train.fp8: tensorwise | rowwise).

torchao swaps the chosen nn.Linear modules for its Float8Linear: inputs, weights and output gradients are
cast to float8 (e4m3 forward, e5m2 backward) with dynamic scales, one per tensor (tensorwise) or per row
(rowwise, more accurate, slower), and the matmuls run on float8 tensor cores; weights, gradients and
optimizer state stay as they were (fp32 shards under FSDP2). Which layers: `converts` below. Float8 needs
compute capability >= 8.9 (H100/H200, L4, RTX 4090) and pays off only compiled (the casts and scales fuse
into the blocks' kernels), so train.compile=true is required. Under FSDP2, tensorwise also all-gathers the
weights in float8 (torchao's enable_fsdp_float8_all_gather); rowwise gathers them in bf16. A float8
all-gather needs each weight's scale, its amax over every rank: without `precompute_fp8_scales` each weight
all-reduces its own in the next forward, one small collective per weight per step; with it, torchao
computes all of them in one all-reduce right after each optimizer step (what torchtitan does).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

# torchao's published H100 microbenchmarks (torchao/float8 README): below these sizes the casts cost more
# than the float8 matmul saves. Our rule, per recipe, on a Linear of in_features x out_features:
#   tensorwise: in_features > 1024 or out_features > 4096
#   rowwise:    in_features > 2048 and out_features > 1024, and not (in_features <= 4096 and out_features <= 2048)


def large_enough(recipe: str, in_features: int, out_features: int) -> bool:
    """Whether a Linear of this shape gains from float8 under `recipe` (the thresholds above)."""
    if in_features % 16 or out_features % 16:  # float8 tensor cores take multiples of 16
        return False
    if recipe == "tensorwise":
        return in_features > 1024 or out_features > 4096
    return in_features > 2048 and out_features > 1024 and not (in_features <= 4096 and out_features <= 2048)


def fp8_module_filter(model: nn.Module, recipe: str):
    """The `module_filter_fn(module, fqn)` for torchao's convert_to_float8_training: an nn.Linear inside a
    transformer block (never the output head or anything outside the blocks) that is `large_enough`."""
    from lmpretrain.model.speed import transformer_blocks

    inside = {id(m) for block in transformer_blocks(model) for m in block.modules()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def keep(module: nn.Module, fqn: str) -> bool:
        return (
            type(module) is nn.Linear
            and id(module) in inside
            and module is not head
            and large_enough(recipe, module.in_features, module.out_features)
        )

    return keep


def converted_modules(model: nn.Module, recipe: str) -> list[str]:
    """The names of the modules `fp8_module_filter` picks (what convert_to_float8_training would swap)."""
    keep = fp8_module_filter(model, recipe)
    return [name for name, module in model.named_modules() if keep(module, name)]


def fp8_problems(recipe: str) -> list[str]:
    """Why train.fp8=`recipe` cannot run here (device, capability, package): one message, or none."""
    if recipe == "none":
        return []
    if not torch.cuda.is_available():
        where = "there is no CUDA device here"
    elif torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        where = f"this {torch.cuda.get_device_name()} has compute capability {major}.{minor}"
    elif importlib.util.find_spec("torchao") is None:
        where = "torchao is not installed (pip install -e .[gpu])"
    else:
        return []
    return [
        f"train.fp8={recipe} needs a CUDA GPU of compute capability >= 8.9 (H100/H200, L4, RTX 4090) and "
        f"torchao; {where}. Use train.fp8=none (bf16)"
    ]


def convert_to_fp8(model: nn.Module, recipe: str, sharded: bool) -> str:
    """Swap the chosen Linear layers for torchao's Float8Linear, in place, before compile and sharding."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = converted_modules(model, recipe)
    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=sharded)
    else:
        config = Float8LinearConfig.from_recipe_name("rowwise")
    convert_to_float8_training(model, module_filter_fn=fp8_module_filter(model, recipe), config=config)
    swapped = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    gather = ""
    if sharded:
        gather = f"; FSDP2 all-gathers their weights in {'float8' if recipe == 'tensorwise' else 'bf16'}"
    return f"fp8: {recipe} scaling, {swapped} of {len(names)} chosen Linear layers are torchao Float8Linear{gather}"


def after_each_step(optimizer, fn) -> None:
    """Call fn() right after each optimizer step that runs: not after a skipped one (the update guard's
    skip, or fp16's GradScaler finding inf gradients), which leaves the weights as they were."""
    # accelerate's AcceleratedOptimizer steps the optimizer it wraps: the hook goes on that one
    getattr(optimizer, "optimizer", optimizer).register_step_post_hook(lambda *_: fn())


def precompute_fp8_scales(model: nn.Module, optimizer, recipe: str) -> list[str]:
    """Under FSDP2 with float8 all-gather: after each optimizer step that ran (a skipped step leaves the
    weights, so their scales, as they were), torchao's precompute_float8_dynamic_scale_for_fsdp. Call it
    once the model is sharded; returns the line to log, or none when the weights are not gathered in float8."""
    if recipe == "none":
        return []
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    gathered = [
        p
        for p in model.parameters()
        if isinstance(getattr(p, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)
    ]
    if not gathered:
        return []
    after_each_step(optimizer, lambda: precompute_float8_dynamic_scale_for_fsdp(model))
    return [
        f"fp8: the float8 scales of {len(gathered)} FSDP2-sharded weights are computed after each optimizer "
        "step, in one all-reduce (torchao's precompute_float8_dynamic_scale_for_fsdp)"
    ]
