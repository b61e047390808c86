"""Step time from a stated roofline: compute at the GPU's peak times an achievable fraction, HBM traffic at
its bandwidth, each collective at the bandwidth of the links its group spans, and a stated overlap.

Calibration (docs/planning.md compares the plan with each): the fractions are what well-tuned PyTorch
trainers publish on H100s in bf16. MATMUL_FRACTION 0.5: OLMo-core trains OLMo-2 1B at ~55k tokens/s per
H100 (~48% MFU of 989 TFLOP/s at 4k context), torchtitan reports Llama-3.1-8B at 33-39% MFU under FSDP2
with activation checkpointing, whose recomputed forward is executed FLOPs the MFU does not count
(0.39 x 4/3 = 0.52 of peak executed). HBM_FRACTION 0.8: large copies reach ~80% of the datasheet bandwidth.
COMM_FRACTION 0.8: NCCL's ring bus bandwidth reaches ~80% of the link's.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmpretrain.plan.hardware import GPU

MATMUL_FRACTION = 0.5
HBM_FRACTION = 0.8
COMM_FRACTION = 0.8
OVERLAP = (
    "FSDP2 all-gathers/reduce-scatters and DDP's all-reduce overlap with compute (prefetched, bucketed); "
    "the optimizer step's collectives (Muon's) and the gradient-norm all-reduce do not"
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


def _link(gpu: GPU, ranks: int) -> tuple[float, str]:
    """The effective bandwidth of a collective over `ranks` GPUs, placed on as few nodes as they fit."""
    spans_nodes = ranks > gpu.gpus_per_node
    bandwidth = (gpu.inter_node_gbps if spans_nodes else gpu.intra_node_gbps) * 1e9 * COMM_FRACTION
    name = "inter-node" if spans_nodes else "NVLink/intra-node"
    return bandwidth, f"{name} {bandwidth / 1e9:.0f} GB/s effective"


def step_time(step, gpu: GPU, world: int, accum: int, fp8: bool = False, shards: int | None = None) -> Timing:
    """`shards` < world: HSDP, whose all-gathers, reduce-scatters and Muon all-to-alls stay in a shard group
    (on its own link) and whose gradient all-reduce over the replica groups overlaps the backward as DDP's
    does."""
    executed = sum(step.flops.values())
    compute = executed / (gpu.peak_flops(fp8) * MATMUL_FRACTION)
    hbm = hbm_bytes(step, accum) / (gpu.hbm_gbps * 1e9 * HBM_FRACTION)
    hsdp = shards is not None and shards < world
    bandwidth, link = _link(gpu, world)
    per_kind = dict.fromkeys(step.comm, bandwidth)
    if hsdp:
        in_group, group_link = _link(gpu, shards)
        per_kind |= {"all_gather": in_group, "reduce_scatter": in_group}
        if group_link != link:
            link = f"{group_link} in each shard group of {shards}, {link} across the replica groups"
    comm = {kind: value / per_kind[kind] for kind, value in step.comm.items() if value}
    if hsdp and comm.get("muon"):  # its all-to-alls stay in the shard group, its replica all-gather crosses
        links = {k: in_group if k == "all_to_all" else bandwidth for k in step.muon_comm}
        comm["muon"] = sum(v / links[k] for k, v in step.muon_comm.items())
    exposed_kinds = {"muon"}
    overlapped = sum(t for kind, t in comm.items() if kind not in exposed_kinds and kind != "all_reduce")
    # the all-reduce of the step is DDP's gradients (overlapped) or, under FSDP2, the small gradient norm
    grad_all_reduce = comm.get("all_reduce", 0.0)
    exposed = sum(comm.get(kind, 0.0) for kind in exposed_kinds)
    if hsdp or (step.grads and grad_all_reduce * bandwidth > step.grads):  # gradients, DDP/ZeRO-1's or HSDP's
        overlapped += grad_all_reduce
    else:
        exposed += grad_all_reduce
    busy = max(compute, hbm)
    return Timing(compute, hbm, comm, exposed, max(busy, overlapped) + exposed, link)
