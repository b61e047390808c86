"""Where Muon's orthogonalisation runs when there is more than one rank (optim.muon_spread).

* FSDP2 (a DTensor sharded on dim 0 over one mesh dim): each matrix has one owner rank (largest first, to
  the least-loaded rank). One all-to-all sends every rank's rows of a matrix to its owner, the owner
  orthogonalises its matrices (batched), and a second all-to-all returns each rank its rows of the
  results. A rank receives about 2 x (the matrices' bytes / world): its own matrices' other rows, then its
  rows of everyone else's. A 3-D expert stack sharded on dim 0 holds whole experts on each rank: they are
  orthogonalised where they are, with no communication. Under HSDP (a 2-D mesh: replicas x shards) the
  same runs within each shard group, and the replica groups split each owner's matrices (and expert
  stacks) as DDP does: each replica orthogonalises its share, one all-gather over the replica group
  shares the results, so the work per rank falls by the whole world size, not the shard group's.
* DDP (plain tensors, every rank holds every update): each rank orthogonalises its share and one
  all-gather gives every rank all the results.
* Not spread: every rank orthogonalises every matrix (FSDP2: each update is gathered whole first).
* Expert parallelism (model.ep_size): an expert stack is sharded on its experts over the ep group and over
  efsdp, so every rank holds whole experts: it orthogonalises those, spread or not, and sends nothing.

Every collective is a plain torch.distributed call whose sizes come from shapes only (no host reads of
tensor values), so it runs on gloo, NCCL and a fake process group alike.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lmpretrain.gpus import GPU, MATMUL_FRACTION, UNKNOWN, gpu_for_device
from lmpretrain.layout import Layout
from lmpretrain.update.newton_schulz import iteration_dtype, orthogonalise_all


class SpreadRates(NamedTuple):
    """The roofline optim.muon_spread=auto weighs: spreading saves (1 - 1/ranks) of the Newton-Schulz FLOPs at
    `flops` FLOP/s and costs an all-gather of (1 - 1/ranks) of the matrices' bytes at `bandwidth` bytes/s (the
    results shared over every rank under DDP, over a replica group under HSDP)."""

    flops: float
    bandwidth: float
    source: str


# One CPU process's float32 matmul and gloo over loopback, round figures.
CPU_RATES = SpreadRates(5e10, 2e9, "round figures for a CPU process and gloo")


def spread_rates(device: torch.device, layout: Layout | None = None, gpu: GPU | None = None) -> SpreadRates:
    """The roofline of the GPU the run trains on: `gpu` (the planner's target), else the GPU table's entry for
    this CUDA device (gpus.UNKNOWN's round figures for one it lacks); its bf16 peak and the link the results'
    all-gather crosses (NVLink within a machine, the NIC when its group spans machines: `layout`), at the
    planner's achievable fractions (lmpretrain/gpus.py), so that a run, its plan and its pre-flight decide
    alike. A CPU: CPU_RATES."""
    if gpu is None:
        if device.type == "cpu":
            return CPU_RATES
        gpu = (
            gpu_for_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        ) or UNKNOWN
    layout = layout or Layout()
    size, stride = (layout.replicas, layout.shards) if layout.hsdp else (layout.num_processes, 1)
    # Newton-Schulz runs in bf16 on GPUs (optim.muon_ns_dtype=auto); fp16's peak where the GPU has no bf16
    dtype = next((d for d in ("bf16", "fp16") if gpu.peak_flops(d)), None)
    if dtype is None:
        gpu, dtype = UNKNOWN, "bf16"
    bandwidth, link = gpu.group_link(layout, size, stride)
    return SpreadRates(
        gpu.peak_flops(dtype) * MATMUL_FRACTION,
        bandwidth,
        f"{gpu.key}'s {dtype} peak x {MATMUL_FRACTION} and {link}",
    )


def ns_flops(shape: tuple[int, ...], steps: int, pieces: int = 1) -> int:
    """Newton-Schulz FLOPs of one update: per matrix (rows <= cols) and step, X X^T, its square and the
    product with X: 4 r^2 c + 2 r^3."""
    rows, cols = shape[-2:]
    batch = math.prod(shape[:-2]) * pieces
    rows, cols = sorted((rows, cols // pieces if pieces > 1 else cols))
    return batch * steps * (4 * rows * rows * cols + 2 * rows**3)


class Spread(NamedTuple):
    """Where the orthogonalisation runs: over the ranks (the shard group under FSDP2), also over HSDP's
    replica groups, and the start-up line's words for it."""

    ranks: bool
    replicas: bool
    where: str


def _roofline(
    params: list, groups: list[dict], world: int, rates: SpreadRates, share: float = 1.0
) -> tuple[bool, str]:
    """Whether spreading `share` of the matrices over `world` ranks saves more Newton-Schulz time than the
    all-gather of their results costs at `rates`, and the figures."""
    flops = share * sum(
        ns_flops(tuple(p.shape), g["ns_steps"], g["pieces"]) for p, g in zip(params, groups, strict=True)
    )
    nbytes = share * sum(p.numel() * p.element_size() for p in params)
    saved, cost = flops / rates.flops * (1 - 1 / world), nbytes / rates.bandwidth * (1 - 1 / world)
    words = (
        f"Newton-Schulz {flops / 1e9:.3g} GFLOP at {rates.flops:.2g} FLOP/s saves {saved * 1e3:.3g} ms, the "
        f"all-gather of {nbytes / 2**20:.3g} MiB at {rates.bandwidth:.2g} B/s costs {cost * 1e3:.3g} ms; "
        f"{rates.source}"
    )
    return saved > cost, words


def spread_decision(
    params: list,
    groups: list[dict],
    world: int,
    sharded: bool,
    device,
    replicas: int = 1,
    rates: SpreadRates | None = None,
) -> Spread:
    """Whether the matrices' orthogonalisation is spread over the ranks (and, under HSDP, over the
    `replicas` replica groups), and why (the start-up line's words); `rates`: the roofline auto weighs
    (spread_rates; None: the round figures of `device`'s type)."""
    rates = rates or (CPU_RATES if device.type == "cpu" else spread_rates(device, gpu=UNKNOWN))
    setting = groups[0]["spread"]
    if world == 1:
        return Spread(False, False, "one process: every matrix here")
    if setting == "never":
        return Spread(
            False, False, f"optim.muon_spread=never: each of the {world} ranks orthogonalises every matrix"
        )
    if sharded:
        how = "each matrix's rows go to its owner rank and its result's rows come back (two all-to-alls)"
        why = "always" if setting == "always" else "auto: it moves fewer bytes than gathering every matrix"
        if replicas == 1:
            return Spread(True, False, f"spread over {world} ranks under FSDP2 ({why}): {how}")
        shards = world // replicas
        line = f"spread over the {shards} ranks of each shard group under HSDP ({why}): {how}; "
        over, roofline = _roofline(params, groups, replicas, rates, share=1 / shards)
        if setting == "always" or over:
            why = "optim.muon_spread=always" if setting == "always" else f"optim.muon_spread=auto: {roofline}"
            return Spread(
                True,
                True,
                line + f"and over the {replicas} replica groups ({why}): each does its share of an owner's "
                "matrices, one all-gather over the replica group shares the results",
            )
        return Spread(
            True,
            False,
            line
            + f"not over the {replicas} replica groups (optim.muon_spread=auto: {roofline}): each repeats the work",
        )
    how = "each rank orthogonalises its share, one all-gather shares the results"
    if setting == "always":
        return Spread(True, False, f"spread over {world} ranks (optim.muon_spread=always): {how}")
    over, roofline = _roofline(params, groups, world, rates)
    if over:
        return Spread(True, False, f"spread over {world} ranks (optim.muon_spread=auto: {roofline}): {how}")
    return Spread(
        False,
        False,
        f"not spread (optim.muon_spread=auto: {roofline}): every rank orthogonalises every matrix",
    )


def replica_count(t: torch.Tensor) -> int:
    """HSDP: how many replica groups hold a dim-0-sharded DTensor (1 for plain tensors and FSDP2)."""
    dim = _replica_dim(t) if isinstance(t, DTensor) else None
    return 1 if dim is None else t.device_mesh.size(dim)


def owners(sizes: list[int], world: int) -> list[int]:
    """The rank that orthogonalises each matrix: largest first, each to the least-loaded rank (ties: the
    lowest), the same on every rank."""
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + sizes[i]
    return owner


def shard_rows(n: int, world: int) -> list[int]:
    """Rows of each rank's dim-0 shard of an n-row tensor (torch.chunk's split, as DTensor's Shard(0))."""
    size = -(-n // world)
    return [max(0, min(size, n - r * size)) for r in range(world)]


def orthogonalised(updates: list, groups: list[dict], spread: bool, over_replicas: bool = False) -> list:
    """Every update orthogonalised (per projection, per expert); DTensors come back with their placements.
    `over_replicas`: under HSDP, the replica groups split the work too."""
    out: list = [None] * len(updates)
    plain = [i for i, u in enumerate(updates) if not isinstance(u, DTensor)]
    sharded = [i for i, u in enumerate(updates) if isinstance(u, DTensor)]
    if plain:
        world = dist.get_world_size() if dist.is_initialized() else 1
        results = (_gathered if spread and world > 1 else _local)(
            [updates[i] for i in plain], [groups[i] for i in plain]
        )
        for i, r in zip(plain, results, strict=True):
            out[i] = r
    routable = [i for i in sharded if spread and _shard_dim(updates[i]) is not None]
    for i, r in zip(
        routable,
        _routed([updates[i] for i in routable], [groups[i] for i in routable], over_replicas),
        strict=True,
    ):
        out[i] = r
    # Expert parallelism's stacks (sharded on dim 0 over the ep group and over efsdp): each rank holds
    # whole experts and orthogonalises only those, whatever the spread setting; nothing is sent.
    held = [i for i in sharded if i not in set(routable) and holds_whole_experts(updates[i])]
    for i, r in zip(
        held, _local([updates[i].to_local() for i in held], [groups[i] for i in held]), strict=True
    ):
        out[i] = _like(r, updates[i])
    rest = [i for i in sharded if i not in set(routable) | set(held)]
    if rest:  # not spread (or a placement other than dim-0 shards): every rank gathers and does every matrix
        whole = _local([updates[i].full_tensor() for i in rest], [groups[i] for i in rest])
        for i, full in zip(rest, whole, strict=True):
            u = updates[i]
            out[i] = distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None)
    return out


def _pieces(update: torch.Tensor, group: dict) -> tuple[torch.Tensor, ...]:
    """The update as (n, rows, cols) stacks: one per fused projection (side by side along the outputs, or
    every `pieces`-th output where they are interleaved)."""
    x = update if update.dim() == 3 else update.unsqueeze(0)
    dim, n = 1 + group["out_dim"], group["pieces"]
    if group.get("interleaved"):
        return tuple(x[(slice(None),) * dim + (slice(i, None, n),)] for i in range(n))
    return x.chunk(n, dim=dim)


def _joined(parts: list[torch.Tensor], group: dict) -> torch.Tensor:
    """The projections' results put back where `_pieces` took them from."""
    dim = 1 + group["out_dim"]
    if len(parts) == 1:  # the batched iteration's own output (a view), not a copy
        return parts[0]
    if group.get("interleaved"):
        return torch.stack(parts, dim=dim + 1).flatten(dim, dim + 1)
    return torch.cat(parts, dim=dim)


def _local(updates: list[torch.Tensor], groups: list[dict]) -> list[torch.Tensor]:
    """Orthogonalised here, every same-shape matrix of a (steps, dtype, coefficients) batch at once."""
    mats, keys = [], []
    for u, g in zip(updates, groups, strict=True):
        parts = _pieces(u, g)
        mats.append(parts)
        dtype = iteration_dtype(g["ns_dtype"], u.dtype, u.device)
        keys.append((g["ns_steps"], dtype, g["coefficients"]))
    results: list = [None] * len(updates)
    for key in dict.fromkeys(keys):
        idx = [i for i, k in enumerate(keys) if k == key]
        flat = orthogonalise_all([m for i in idx for m in mats[i]], *key)
        for i in idx:
            parts, flat = flat[: len(mats[i])], flat[len(mats[i]) :]
            results[i] = _joined(parts, groups[i]).reshape(updates[i].shape)
    return results


def _flat(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not tensors:
        return like.new_empty(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def _by_dtype(updates: list) -> list[list[int]]:
    """Indices per dtype: each collective carries one dtype."""
    order = dict.fromkeys(u.dtype for u in updates)
    return [[i for i, u in enumerate(updates) if u.dtype == d] for d in order]


def _gathered(updates: list[torch.Tensor], groups: list[dict], pg=None) -> list[torch.Tensor]:
    """DDP (and HSDP's replica groups, `pg`): each rank orthogonalises the updates it owns; an all-gather
    of equal-size (padded) buffers. Every rank of `pg` holds the same updates."""
    world, me = dist.get_world_size(pg), dist.get_rank(pg)
    out: list = [None] * len(updates)
    for idx in _by_dtype(updates):
        owner = owners([updates[i].numel() for i in idx], world)
        mine = [i for i, o in zip(idx, owner, strict=True) if o == me]
        per_rank = [[i for i, o in zip(idx, owner, strict=True) if o == r] for r in range(world)]
        width = max(sum(updates[i].numel() for i in ranks) for ranks in per_rank)
        like = updates[idx[0]]
        buffer = like.new_zeros(width)
        done = _flat(_local([updates[i] for i in mine], [groups[i] for i in mine]), like)
        buffer[: done.numel()] = done
        everything = like.new_empty(world * width)
        dist.all_gather_into_tensor(everything, buffer, group=pg)
        for r, chunk in enumerate(everything.split(width)):
            sizes = [updates[i].numel() for i in per_rank[r]]
            for i, part in zip(per_rank[r], chunk[: sum(sizes)].split(sizes), strict=True):
                out[i] = part.view(updates[i].shape)
    return out


def _shard_dim(update: DTensor) -> int | None:
    """The mesh dim that shards the tensor on dim 0 when every other mesh dim replicates it, else None."""
    dims = [d for d, p in enumerate(update.placements) if p == Shard(0)]
    others = all(p == Replicate() for d, p in enumerate(update.placements) if d not in dims)
    return dims[0] if len(dims) == 1 and others else None


def holds_whole_experts(update: torch.Tensor) -> bool:
    """An expert stack laid out by expert parallelism: a DTensor sharded on dim 0 (the experts) over more
    than one mesh dim (ep, efsdp) and replicated over any other (HSDP's replicas)."""
    if not isinstance(update, DTensor) or update.dim() != 3 or _shard_dim(update) is not None:
        return False
    # Shard(0), and FSDP2's _StridedShard(0) over the ep group's Shard(0) (not a Shard subclass in torch 2.13)
    return all(p.is_replicate() or getattr(p, "dim", None) == 0 for p in update.placements)


def _replica_dim(update: DTensor) -> int | None:
    """HSDP: the one other mesh dim of a tensor sharded on dim 0 (it replicates it), else None."""
    shard = _shard_dim(update)
    if shard is None or len(update.placements) != 2:
        return None
    return 1 - shard


def _here(updates: list[torch.Tensor], groups: list[dict], like: DTensor, over_replicas: bool) -> list:
    """Whole matrices this rank holds, orthogonalised here or, under HSDP, shared with its replica group."""
    dim = _replica_dim(like) if over_replicas else None
    if dim is None:
        return _local(updates, groups)
    return _gathered(updates, groups, like.device_mesh.get_group(dim))


def _routed(updates: list[DTensor], groups: list[dict], over_replicas: bool) -> list[DTensor]:
    """FSDP2: expert stacks where they are; matrices to their owners and back (see the module's doc)."""
    out: list = [None] * len(updates)
    stacks = [i for i, u in enumerate(updates) if u.dim() == 3]  # dim-0 shards of experts: whole matrices
    local = (
        _here(
            [updates[i].to_local() for i in stacks],
            [groups[i] for i in stacks],
            updates[stacks[0]],
            over_replicas,
        )
        if stacks
        else []
    )
    for i, r in zip(stacks, local, strict=True):
        out[i] = _like(r, updates[i])
    matrices = [i for i, u in enumerate(updates) if u.dim() != 3]
    for idx in _by_dtype([updates[i] for i in matrices]):
        idx = [matrices[j] for j in idx]
        exchanged = _exchange([updates[i] for i in idx], [groups[i] for i in idx], over_replicas)
        for i, r in zip(idx, exchanged, strict=True):
            out[i] = r
    return out


def _like(local: torch.Tensor, update: DTensor) -> DTensor:
    return DTensor.from_local(
        local,
        update.device_mesh,
        update.placements,
        run_check=False,
        shape=update.shape,
        stride=update.stride(),
    )


def _exchange(updates: list[DTensor], groups: list[dict], over_replicas: bool) -> list[DTensor]:
    """Rows to the owners, orthogonalised there (HSDP: split with the replica group), rows back: two
    all-to-alls over the shard group."""
    mesh, dim = updates[0].device_mesh, _shard_dim(updates[0])
    pg, world, me = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    n = len(updates)
    rows = [shard_rows(u.shape[0], world) for u in updates]
    width = [math.prod(u.shape[1:]) for u in updates]
    owner = owners([u.numel() for u in updates], world)
    mine = [j for j in range(n) if owner[j] == me]
    of = [[j for j in range(n) if owner[j] == r] for r in range(world)]
    like = updates[0].to_local()
    # 1: my rows of every matrix to its owner; from every rank s, its rows of mine
    sent = [sum(rows[j][me] * width[j] for j in of[r]) for r in range(world)]
    received = [sum(rows[j][s] * width[j] for j in mine) for s in range(world)]
    inbox = like.new_empty(sum(received))
    outbox = _flat([updates[j].to_local() for r in range(world) for j in of[r]], like)
    dist.all_to_all_single(inbox, outbox, received, sent, group=pg)
    parts: dict[int, list] = {j: [] for j in mine}
    for s, chunk in enumerate(inbox.split(received)):
        for j, piece in zip(mine, chunk.split([rows[j][s] * width[j] for j in mine]), strict=True):
            parts[j].append(piece.view(rows[j][s], *updates[j].shape[1:]))
    results = _here([torch.cat(parts[j]) for j in mine], [groups[j] for j in mine], updates[0], over_replicas)
    # 2: to every rank s its rows of my results; from every owner, my rows of its
    starts = [[sum(rows[j][:s]) for s in range(world)] for j in range(n)]
    outbox = _flat(
        [
            r[starts[j][s] : starts[j][s] + rows[j][s]]
            for s in range(world)
            for j, r in zip(mine, results, strict=True)
        ],
        like,
    )
    inbox = like.new_empty(sum(sent))
    dist.all_to_all_single(inbox, outbox, sent, received, group=pg)
    out: list = [None] * n
    for r, chunk in enumerate(inbox.split(sent)):
        for j, piece in zip(of[r], chunk.split([rows[j][me] * width[j] for j in of[r]]), strict=True):
            out[j] = _like(piece.view(rows[j][me], *updates[j].shape[1:]), updates[j])
    return out
