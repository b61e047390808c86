#!/usr/bin/env python
"""Show real sharding on CPU: FSDP2 and ZeRO train exactly like DDP while each rank holds half the state.

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \\
        scripts/sharding_cpu.py [--steps 10] [--json sharding.json]

(`accelerate launch --config_file configs/accelerate/cpu-ddp.yaml scripts/sharding_cpu.py` and
`torchrun --nproc_per_node 2 scripts/sharding_cpu.py` work too; `--cpu --num_processes 2` starts one
process and is refused.) accelerate turns an FSDP request on CPU into plain DDP, so the recipe refuses
it there; torch itself can shard on gloo, and this script uses it directly. The same float64 Llama is
trained on the same data three ways:

* ``ddp``   - DistributedDataParallel + AdamW: every rank holds all parameters and all optimizer state;
* ``fsdp2`` - ``fully_shard`` on each decoder layer and the root: parameters, gradients and AdamW state
  are DTensor shards (dim 0 split across ranks);
* ``zero``  - DDP + ``ZeroRedundancyOptimizer(AdamW)``: parameters replicated, each rank keeps the AdamW
  state of the parameters it owns and broadcasts their updates.

Each rank takes its half of a fixed global batch; the loss is normalised by the global target count, so
the three runs are the same optimisation. Prints per-step losses, the largest relative L2 difference of
the gathered parameters against DDP, and the optimizer-state bytes each rank holds; ``--json`` writes
them. float64 keeps the comparison tight: fp32 reduction-order noise is amplified by Adam's division.
Launches that silently degrade (one process, or processes outside one group) are refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from lmpretrain.config import ModelConfig, TrainConfig
from lmpretrain.errors import LaunchError
from lmpretrain.loss import IGNORE_INDEX, causal_lm_loss_sum, count_targets
from lmpretrain.model import build_model, build_model_config
from lmpretrain.optim import param_groups
from lmpretrain.runtime import setup

MODES = ("ddp", "fsdp2", "zero")
MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 64,
    "head_dim": 16,  # AutoConfig.for_model keeps the 4096-wide default (128) when only hidden_size changes
}
# Embeddings decay so both big matrices share one group: ZeRO places whole tensors greedily, group by
# group, and an embedding alone in the no-decay group would land on one rank (about 0.62 / 0.38 here).
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
WEIGHT_DECAY, MAX_GRAD_NORM = 0.1, 1.0


def batch(args, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the fixed global batch; later rows ignore more targets, so ranks are uneven."""
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, MODEL["vocab_size"], (args.global_batch, args.seq_len), generator=g)
    drop = torch.linspace(0.0, 0.6, args.global_batch).unsqueeze(1)
    labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < drop, IGNORE_INDEX)
    rows = args.global_batch // world
    return ids[rank * rows : (rank + 1) * rows], labels[rank * rows : (rank + 1) * rows]


def build(mode: str, seed: int):
    torch.manual_seed(seed)  # identical init on every rank; fully_shard keeps each rank's slice of it
    config = build_model_config(ModelConfig(type="llama", overrides=MODEL))
    model = build_model(config, dtype="float64").train()
    if mode == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer)
        model = fully_shard(model)
        groups = param_groups(model, WEIGHT_DECAY, decay_embeddings=True)  # groups of the DTensor params
        return model, model, torch.optim.AdamW(groups, **ADAMW)
    groups = param_groups(model, WEIGHT_DECAY, decay_embeddings=True)
    wrapped = DDP(model)
    if mode == "zero":
        return wrapped, model, ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **ADAMW)
    return wrapped, model, torch.optim.AdamW(groups, **ADAMW)


def local_bytes(tensors) -> int:
    """Bytes this rank stores: the local shard of a DTensor, the whole of a plain tensor."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer) -> int:
    # ZeRO's own .state is not the live one; the AdamW it wraps holds this rank's partition.
    state = optimizer.optim.state if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer.state
    return local_bytes(v for s in state.values() for v in s.values())


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (FSDP2 shards are all-gathered)."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def train(mode: str, args, rank: int, world: int) -> dict:
    wrapped, model, optimizer = build(mode, args.seed)
    ids, labels = batch(args, rank, world)  # the same rows every step: the loss must fall as they are learnt
    targets = count_targets(labels)
    dist.all_reduce(targets)  # global target count: every token weighs the same, whichever rank has it
    losses, grad_norms = [], []
    for _ in range(args.steps):
        loss_sum = causal_lm_loss_sum(wrapped(input_ids=ids).logits, labels)
        # DDP and FSDP2 average gradients over ranks; * world turns that average into the global sum.
        (loss_sum * world / targets).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        losses.append((total / targets).item())
        grad_norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
    params = full_params(model)
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params.values())).hexdigest()[:16]
    report = {
        "rank": rank,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "param_bytes": local_bytes(model.parameters()),
        "param_digest": digest,
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, report)
    return {"losses": losses, "grad_norms": grad_norms, "ranks": ranks}, params


def max_rel_diff(params: dict, ref: dict) -> float:
    assert params.keys() == ref.keys()
    return max(((params[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)


def table(report: dict) -> str:
    world = report["world_size"]
    head = [
        "mode",
        *[f"optim bytes r{r}" for r in range(world)],
        "vs ddp",
        "param bytes r0",
        "max rel diff",
        "max |dloss|",
    ]
    rows = [head]
    for mode, m in report["modes"].items():
        rows.append(
            [
                mode,
                *[f"{r['optimizer_state_bytes']:,}" for r in m["ranks"]],
                "/".join(f"{x:.3f}" for x in m["state_ratio_vs_ddp"]),
                f"{m['ranks'][0]['param_bytes']:,}",
                f"{m['max_rel_param_diff_vs_ddp']:.2e}",
                f"{m['max_abs_loss_diff_vs_ddp']:.2e}",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=8, help="rows over all ranks per step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--json", help="write the report here (rank 0)")
    args = parser.parse_args(argv)

    try:
        _, info = setup(TrainConfig(), seed=args.seed)  # one micro-batch per step, no engine
    except LaunchError as err:
        print(f"refusing to run: {err}", file=sys.stderr)
        return 2
    if info.world_size < 2 or info.backend != "gloo" or args.global_batch % info.world_size:
        print(
            f"refusing to run: needs >= 2 gloo processes splitting --global-batch evenly, got "
            f"{info.describe()}; launch with: ACCELERATE_USE_CPU=true accelerate launch --multi_gpu "
            "--num_processes 2 scripts/sharding_cpu.py",
            file=sys.stderr,
        )
        return 2
    rank, world, main_process = info.rank, info.world_size, info.rank == 0
    if main_process:
        print(
            f"process group: world_size={world} backend={info.backend} "
            f"distributed_type={info.distributed_type} threads/process={info.threads}",
            flush=True,
        )

    report = {
        "world_size": world,
        "backend": info.backend,
        "distributed_type": info.distributed_type,
        "steps": args.steps,
        "dtype": "float64",
        "model": MODEL,
        "modes": {},
    }
    reference = None
    for mode in MODES:
        result, params = train(mode, args, rank, world)
        if reference is None:
            reference, ref_result = params, result
        result["max_rel_param_diff_vs_ddp"] = max_rel_diff(params, reference)
        pairs = zip(result["losses"], ref_result["losses"], strict=True)
        result["max_abs_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in pairs)
        result["state_ratio_vs_ddp"] = [
            r["optimizer_state_bytes"] / d["optimizer_state_bytes"]
            for r, d in zip(result["ranks"], ref_result["ranks"], strict=True)
        ]
        report["modes"][mode] = result
        if main_process:
            print(f"{mode:>5} losses: " + " ".join(f"{x:.6f}" for x in result["losses"]), flush=True)

    if main_process:
        print(table(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
