"""FSDP2 mixed precision: bf16 compute on fp32 shards, the policy torchtitan and OLMo-core train with.

With train.precision=bf16 under FSDP2, `fully_shard` gets `MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`: each rank keeps its shard of the parameters in fp32 (the master weights, and the
AdamW moments built from them), all-gathers them as bf16 (half the traffic and half the unsharded memory
of fp32) and reduce-scatters the gradients in fp32 (train.fsdp_reduce_dtype=bfloat16 halves that traffic
too, at the cost of summing gradients in bf16). Without the policy FSDP2 gathers and reduces fp32 and
the recipe's autocast casts every weight again in every forward. The recipe keeps its autocast on top:
the ops autocast runs in fp32 (softmax, norms' reductions) stay fp32, the rest are bf16 already.
`check_sharded_precision` reports what really runs, read from torch's FSDP state and from a forward.
"""

from __future__ import annotations

import torch

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fsdp_policy(train):
    """The MixedPrecisionPolicy for `train` (TrainConfig): bf16 parameters in compute with fp32 shards,
    gradients reduced in train.fsdp_reduce_dtype; None (FSDP2's default: all fp32) for other precisions."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if train.precision != "bf16":
        return None
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=REDUCE_DTYPES[train.fsdp_reduce_dtype]
    )


def _name(dtypes) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) or "none"


@torch.no_grad()
def sharded_precision(model, optimizer) -> dict[str, str]:
    """What FSDP2 runs, as dtype names: `gathered` (the parameters the forward computes with, recorded
    by a hook on each unit during one forward of a few tokens; every rank must call this), `shards` (the
    master weights `optimizer` steps on this rank), `reduce` (the gradients' reduce-scatter, from each
    FSDP parameter's state) and the number of `units`."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    inner = getattr(model, "_orig_mod", model)
    units = [m for m in inner.modules() if isinstance(m, FSDPModule)]
    gathered: set[torch.dtype] = set()

    def record(module, *_):  # after FSDP's own pre-forward hook (prepended): this unit is unsharded now
        gathered.update(p.dtype for p in module.parameters() if not isinstance(p, DTensor))

    hooks = [unit.register_forward_pre_hook(record) for unit in units]
    was_training = inner.training
    inner.eval()
    try:
        device = next(p.device for p in inner.parameters())
        ids = torch.arange(8, device=device)[None] % inner.config.vocab_size
        model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
        inner.train(was_training)
        # FSDP2 leaves the root unit's parameters gathered after a forward with no backward; a full-format
        # resume loads into the sharded DTensors, and fails on the root's ("mixed torch.Tensor and DTensor").
        for unit in units:
            unit.reshard()
    # What the optimizer steps (its AdamW moments are created like them): the sharded parameters.
    # (model.parameters() would list a unit's gathered parameters while it is unsharded.)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    shards = {p.to_local().dtype if isinstance(p, DTensor) else p.dtype for p in stepped}
    reduce = set()
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group  # torch's per-unit record of its parameters
        for param in group.fsdp_params if group is not None else ():
            reduce.add(param.reduce_dtype or param.param_dtype or param.orig_dtype)
    return {
        "gathered": _name(gathered),
        "shards": _name(shards),
        "reduce": _name(reduce),
        "units": len(units),
    }


def check_sharded_precision(model, optimizer, train) -> str:
    """The start-up line: the policy asked for and what runs (see `sharded_precision`)."""
    seen = sharded_precision(model, optimizer)
    policy = fsdp_policy(train)
    asked = (
        f"MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype={train.fsdp_reduce_dtype})"
        if policy is not None
        else f"no MixedPrecisionPolicy (train.precision={train.precision})"
    )
    return (
        f"FSDP2 mixed precision: {asked} on {seen['units']} units; a forward gathers {seen['gathered']} "
        f"parameters from {seen['shards']} shards (master weights and optimizer state), gradients are "
        f"reduce-scattered in {seen['reduce']}"
    )
