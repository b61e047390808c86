"""The blocking transfers between the host and the run's device that Python code makes, counted by source
line: the probe behind train.profile_steps' `syncs-rank<R>-steps<a>-<b>.json` on every device, so a CPU test
asserts the count the GPU check (scripts/gpu_check.sh) reports.

A TorchFunctionMode sees each torch call made from Python (in this thread) and counts
* a read: a tensor of the run's device brought to the host (`item`, `tolist`, `numpy`, `bool`, `int`,
  `float`, `cpu()`, a copy to the CPU). On a CPU run every tensor is on the run's device: a read there is
  where a GPU run would wait for the device;
* a blocking write: host data copied to the device so that the host waits: a CPU tensor moved or copied
  there without `non_blocking=True` from pinned memory, and a tensor made from Python numbers with
  `device=` the run's device (a pageable copy on CUDA; counted on a CPU run too, where it is the same code).
Synchronisations inside torch's own C++ (a boolean mask's nonzero) make no Python call: on CUDA the
profiler also keeps torch's own count of synchronizing operations (torch.cuda.set_sync_debug_mode).
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

_READS = frozenset(
    [
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.cpu,
    ]
)
_FROM_PYTHON = frozenset([torch.tensor, torch.as_tensor])


class HostTransfers(TorchFunctionMode):
    """``with HostTransfers(device) as probe:`` counts into ``probe.counts`` ("file:line" -> transfers);
    point ``counts`` at a new Counter to count the next step apart."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.counts = torch.device(device), Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._blocks(func, args, kwargs):
            caller = sys._getframe(1)
            self.counts[f"{caller.f_code.co_filename}:{caller.f_lineno}"] += 1
        return func(*args, **kwargs)

    def _here(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type

    def _blocks(self, func, args, kwargs) -> bool:
        if func in _READS:
            return self._here(args[0])
        if func in _FROM_PYTHON:
            device = kwargs.get("device")
            made_here = device is not None and torch.device(device).type == self.device.type
            return made_here and not isinstance(args[0], torch.Tensor)
        if func is torch.Tensor.to:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            return device is not None and self._crosses(args[0], torch.device(device), non_blocking)
        if func is torch.Tensor.cuda:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            return self._crosses(args[0], torch.device("cuda"), non_blocking)
        if func is torch.Tensor.copy_:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            return self._crosses(args[1], args[0].device, non_blocking)
        return False

    def _crosses(self, src: torch.Tensor, dst: torch.device, non_blocking: bool) -> bool:
        """A copy from `src` to device `dst` that makes the host wait."""
        if src.device.type == dst.type:
            return False
        if dst.type == "cpu":  # device -> host
            return self._here(src)
        return not (non_blocking and src.is_pinned())  # host -> device: async only from pinned memory
