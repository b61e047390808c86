"""Bytes each rank receives per collective, counted as the ops are dispatched (fake or real process group).

torch's CommDebugMode counts collectives but not their bytes; `CollectiveBytes` is a CommDebugMode that
also sizes each one from its tensors and its process group. Received bytes per rank, for the
bandwidth-optimal (ring) algorithms NCCL uses: all-gather and reduce-scatter (W-1)/W of the full
tensor, all-reduce 2 (W-1)/W of it, all-to-all (W-1)/W of the input, broadcast (W-1)/W of it averaged over
ranks (each non-root rank receives it whole, and roots rotate as in Muon's rounds)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed._tools.fake_collectives import CollectiveOp
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")

# op -> (kind, which tensors are the full tensor: "out" = the result/output, "in" = the input)
_OPS = {
    c10d._allgather_base_.default: ("all_gather", 0),
    c10d.allgather_.default: ("all_gather", 0),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    c10d.reduce_scatter_.default: ("reduce_scatter", 1),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1),
    c10d.allreduce_.default: ("all_reduce", 0),
    c10d.allreduce_coalesced_.default: ("all_reduce", 0),
    c10d.broadcast_.default: ("broadcast", 0),
    c10d.alltoall_base_.default: ("all_to_all", 1),
    c10d.alltoall_.default: ("all_to_all", 1),
    funcol.all_gather_into_tensor.default: ("all_gather", "out"),
    funcol.all_gather_into_tensor_coalesced.default: ("all_gather", "out"),
    funcol.all_gather_into_tensor_out.default: ("all_gather", "out"),
    funcol.reduce_scatter_tensor.default: ("reduce_scatter", 0),
    funcol.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", 0),
    funcol.all_reduce.default: ("all_reduce", 0),
    funcol.all_reduce_.default: ("all_reduce", 0),
    funcol.all_reduce_coalesced.default: ("all_reduce", 0),
    funcol.broadcast.default: ("broadcast", 0),
    funcol.broadcast_.default: ("broadcast", 0),
    funcol.all_to_all_single.default: ("all_to_all", 0),
    torch.ops._c10d_functional_autograd.all_to_all_single.default: ("all_to_all", 0),
}
_FACTOR = {"all_reduce": 2.0}


def _nbytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(t) for t in tree)
    return 0


class CollectiveBytes(CommDebugMode):
    """CommDebugMode's counts (`comm_counts`) plus `received[kind]` bytes and `largest[kind]`, this rank."""

    def __init__(self):
        super().__init__()
        self.received: dict[str, float] = defaultdict(float)

    # CommDebugMode's module tracker breaks under MemTracker's module hooks; only the dispatch is needed.
    def __enter__(self):
        self.comm_counts.clear()
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args):
        TorchDispatchMode.__exit__(self, *args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t == DTensor for t in types):  # let DTensor desugar into collectives first
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func in _OPS:
            kind, which = _OPS[func]
            full = _nbytes(out if which == "out" else args[which])
            try:
                size = CollectiveOp.get_process_group(func, args).size()
            except (TypeError, RuntimeError, IndexError):  # an op torch's table lacks: the world
                size = torch.distributed.get_world_size()
            self.comm_counts[func._overloadpacket] += 1
            self.received[kind] += _FACTOR.get(kind, 1.0) * full * (size - 1) / size
        return out
