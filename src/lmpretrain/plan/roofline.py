"""Step time from a stated roofline: compute at the GPU's peak times an achievable fraction, HBM traffic at
its bandwidth, each collective at the bandwidth of the links its group spans, and a stated overlap.

Calibration (docs/planning.md compares the plan with each): the fractions (lmpretrain/gpus.py, beside the GPU
table, where Muon's spread decision reads them too) are what well-tuned PyTorch trainers publish on H100s in bf16. MATMUL_FRACTION 0.5: OLMo-core trains OLMo-2 1B at ~55k tokens/s per
H100 (~48% MFU of 989 TFLOP/s at 4k context), torchtitan reports Llama-3.1-8B at 33-39% MFU under FSDP2
with activation checkpointing, whose recomputed forward is executed FLOPs the MFU does not count
(0.39 x 4/3 = 0.52 of peak executed). HBM_FRACTION 0.8: large copies reach ~80% of the datasheet bandwidth.
COMM_FRACTION 0.8: NCCL's ring bus bandwidth reaches ~80% of the link's.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmpretrain.gpus import GPU, HBM_FRACTION, MATMUL_FRACTION
from lmpretrain.layout import Layout

OVERLAP = (
    "FSDP2 all-gathers/reduce-scatters and the gradients' all-reduce (DDP's, ZeRO's, HSDP's over the replica "
    "groups) overlap with compute (prefetched, bucketed); the optimizer step's collectives (Muon's), FSDP2's "
    "gradient-norm all-reduce and expert parallelism's token all-to-alls (each waited on by the layer's experts) "
    "do not"
)


@dataclass
class Timing:
    compute_s: float
    hbm_s: float
    comm_s: dict[str, float]  # kind -> seconds
    exposed_comm_s: float
    step_s: float
    link: str


def hbm_bytes(step, accum: int) -> float:
    """HBM traffic of one step, a lower bound: each micro-batch reads the weights three times (forward, two
    backward matmuls) and writes then reads its saved activations; the optimizer reads and writes the
    parameters, gradients and its state once."""
    per_micro = 3 * step.unsharded_param_bytes + 2 * step.activations_peak
    return accum * per_micro + 2 * (step.params + step.grads + step.optimizer)


def step_time(step, gpu: GPU, layout: Layout, accum: int, dtype: str = "bf16") -> Timing:
    """Each collective at the links its group spans on `layout`'s machines (across machines, as many NICs as
    the group has members on each: GPU.link_bytes_per_s): under HSDP the all-gathers,
    reduce-scatters and Muon's all-to-alls stay in a shard group and the gradient all-reduce and Muon's
    all-gather cross a replica group; `dtype`: the matmuls' (gpus.DTYPES), whose peak times the compute."""
    executed = sum(step.flops.values())
    compute = executed / (gpu.peak_flops(dtype) * MATMUL_FRACTION)
    hbm = hbm_bytes(step, accum) / (gpu.hbm_gbps * 1e9 * HBM_FRACTION)
    bandwidth, link = gpu.group_link(layout, layout.num_processes)
    per_kind = dict.fromkeys(step.comm, bandwidth)
    if layout.hsdp:
        in_group, in_words = gpu.group_link(layout, layout.shards)
        across, across_words = gpu.group_link(layout, layout.replicas, layout.shards)
        per_kind |= dict.fromkeys(("all_gather", "reduce_scatter"), in_group)
        per_kind["all_reduce"] = across
        if layout.spans_machines(layout.num_processes):
            link = (
                f"{in_words} in each shard group of {layout.shards}, {across_words} across the replica groups"
            )
    comm = {kind: value / per_kind[kind] for kind, value in step.comm.items() if value}
    if layout.hsdp and comm.get(
        "muon"
    ):  # its all-to-alls stay in the shard group, its replica all-gather crosses
        links = {k: per_kind["all_gather"] if k == "all_to_all" else across for k in step.muon_comm}
        comm["muon"] = sum(v / links[k] for k, v in step.muon_comm.items())
    if layout.experts > 1:  # the tokens' all-to-alls stay in an ep group: ep consecutive ranks
        # not a ring: each member's tokens for other machines leave through its own NIC
        per_kind["all_to_all"] = gpu.link_bytes_per_s(layout.spans_machines(layout.experts))
        comm["all_to_all"] = step.comm.get("all_to_all", 0.0) / per_kind["all_to_all"]
    # The step's all-reduce is the gradients' where ranks replicate them (DDP's buckets, ZeRO's, HSDP's over the
    # replica groups: overlapped with the backward at any world size), else FSDP2's small gradient norm
    # after the backward.
    gradients = layout.replicated or layout.hsdp
    exposed_kinds = (
        {"muon"}
        | (set() if gradients else {"all_reduce"})
        | ({"all_to_all"} if layout.experts > 1 else set())
    )
    overlapped = sum(t for kind, t in comm.items() if kind not in exposed_kinds)
    exposed = sum(comm.get(kind, 0.0) for kind in exposed_kinds)
    busy = max(compute, hbm)
    return Timing(compute, hbm, comm, exposed, max(busy, overlapped) + exposed, link)
