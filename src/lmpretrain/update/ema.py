"""`WeightAverage`: an exponential moving average of the trainable parameters (`train.ema_decay`).

After each applied update, ema = decay * ema + (1 - decay) * weights (a skipped update leaves it as it is);
updates up to step `train.ema_start` copy the weights instead, so the average starts there. The average is
kept in fp32 (float64 for float64 parameters), one tensor per parameter, built from the wrapped model's
parameters: under FSDP2 each is a DTensor sharded like its parameter (the update runs on the local shards),
under DDP every replica updates its own copy identically. The checkpointer saves and restores it in every
format (`averages=`), bit-exactly.

`swapped(model)` puts the average into the parameters in place (under no_grad) and the live weights back
after, exactly (a copy of them is kept meanwhile), so the EMA is evaluated, scored on tasks and exported by
the same code as the live model, and training continues bit-identically.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _reshard(model) -> None:
    """FSDP2 keeps some modules' gathered parameters (the root's) between forwards without backward: drop
    them, so the next forward gathers what the shards now hold."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class WeightAverage:
    """The EMA of `model`'s trainable parameters (`model`: the unwrapped module after accelerator.prepare)."""

    def __init__(self, model, decay: float, start: int = 0):
        self.decay, self.start = decay, start
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.average = [p.detach().to(self._dtype(p), copy=True) for p in self.params]

    @classmethod
    def from_config(cls, train, model) -> WeightAverage | None:
        """The average `train.ema_decay` / `train.ema_start` ask for, or None when it is off."""
        return None if train.ema_decay is None else cls(model, train.ema_decay, train.ema_start)

    @staticmethod
    def _dtype(p: torch.Tensor) -> torch.dtype:
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def describe(self) -> str:
        local = sum(_local(a).numel() * a.element_size() for a in self.average)
        dtype = str(self.average[0].dtype).removeprefix("torch.") if self.average else "float32"
        sharded = any(isinstance(a, DTensor) for a in self.average)
        return (
            f"EMA of {len(self.average)} trainable parameters (decay {self.decay}, from step {self.start}): "
            f"one {dtype} copy of the parameters{' (this rank shard)' if sharded else ''}, "
            f"{local / 2**20:.1f} MiB on this rank; evaluated as eval/ema/*, exported to final-ema/"
        )

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights after the applied update that ended step `step` (1-based)."""
        averages = [_local(a) for a in self.average]
        weights = [_local(p.detach()) for p in self.params]
        if step <= self.start:
            for a, w in zip(averages, weights, strict=True):
                a.copy_(w)
        else:
            torch._foreach_lerp_(averages, weights, 1.0 - self.decay)

    @contextmanager
    def swapped(self, model):
        """The average in `model`'s parameters inside the block, the live weights restored exactly after."""
        with torch.no_grad():
            live = [_local(p.detach()).clone() for p in self.params]
            _reshard(model)
            for p, a in zip(self.params, self.average, strict=True):
                _local(p.detach()).copy_(_local(a))
        try:
            yield
        finally:
            with torch.no_grad():
                _reshard(model)
                for p, w in zip(self.params, live, strict=True):
                    _local(p.detach()).copy_(w)

    def evaluate(self, model, score) -> dict:
        """`score()`'s eval/* metrics on the average, as eval/ema/*."""
        with self.swapped(model):
            metrics = score()
        return {f"eval/ema/{k.removeprefix('eval/')}": v for k, v in metrics.items() if k.startswith("eval/")}

    # -- checkpoints: the checkpointer fills these tensors in place --

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.average, strict=True))

    @torch.no_grad()
    def restart(self) -> None:
        """Start the average from the current weights (a checkpoint saved without one)."""
        for a, p in zip(self.average, self.params, strict=True):
            _local(a).copy_(_local(p.detach()))
