"""The few small collectives the parts share. Each is a no-op in a single process, and every rank
must call it (a rank that skips one leaves the others waiting forever)."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist


def _group_active(state) -> bool:
    return state.num_processes > 1 and dist.is_available() and dist.is_initialized()


def any_rank(flag: bool, state) -> bool:
    """True on every rank when ``flag`` is True on any rank (all-reduce max)."""
    if not _group_active(state):
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=state.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_int(value: int, state) -> int:
    """Rank 0's ``value`` on every rank, as a tensor broadcast (no pickling)."""
    if not _group_active(state):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=state.device)
    dist.broadcast(t, src=0)
    return int(t.item())


def broadcast_object(obj, state):
    """Rank 0's ``obj`` (a small picklable value: a path, a message) on every rank."""
    if not _group_active(state):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_problem(problem: str | None, state) -> str | None:
    """The lowest rank's ``problem`` (a message, or None) on every rank: one int all-reduce, and a broadcast
    from that rank only when some rank has one."""
    if not _group_active(state):
        return problem
    none = state.num_processes
    t = torch.tensor(
        [none if problem is None else state.process_index], dtype=torch.int64, device=state.device
    )
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    src = int(t.item())
    if src == none:
        return None
    box = [problem]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def replica_digests(model, accelerator) -> list[str]:
    """sha256 of this rank's parameters, gathered from every rank (replicas must agree bit for bit)."""
    from accelerate.utils import gather_object

    digest = hashlib.sha256()
    for param in model.parameters():  # a DDP wrapper or DeepSpeed engine yields its module's
        digest.update(param.detach().float().cpu().numpy().tobytes())
    return gather_object([digest.hexdigest()[:16]])


def check_replicas_identical(model, accelerator) -> str:
    """Raise unless every replica holds bit-identical parameters (DDP, ZeRO); returns the log line."""
    digests = replica_digests(model, accelerator)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks hold different parameters after training: {digests}")
    return f"parameter sha256 per rank: {' '.join(digests)}"
