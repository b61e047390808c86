"""One blocking device->host read per optimizer step.

Each read of a GPU value (`.item()`, `float(t)`, `.tolist()`) makes the host wait until the GPU has run
everything queued before it, so the next step's kernels are not queued meanwhile. The step needs on the
host only the loss, the gradient norm (the guard decides on them and the log shows them), the global
target count (to refuse a batch without targets) and whether any rank was signalled to stop. Here:
the target count stays on the device for the loss scale, the ranks' loss sums and stop flags travel in
one all-reduce, and all of it comes to the host in one `.tolist()` after clipping, before the update.

    readout = StepReadout(accelerator, world_size=W, accum_steps=K)
    n_targets = readout.target_count(labels)              # device tensor, all-reduced: no read
    scale = readout.loss_scale(n_targets)                 # W * K / n_targets, on the device
    ... backward(sums.objective * scale) per micro-batch, loss_sums += [ce, z] ...
    grad_norm = accelerator.clip_grad_norm_(...)          # a tensor: not float()-ed
    step = readout.read(loss_sums, n_targets, grad_norm, stop=preemption.received)   # the one read
    guard.check(step.loss, step.grad_norm, ...)           # host floats from here on

fp16's GradScaler still reads its inf/NaN flag inside `scaler.step` (a second read, fp16 only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmpretrain.model.loss import count_targets


@dataclass(frozen=True)
class StepScalars:
    """What the host learns about a step, read at once (loss and z are per target, over all ranks)."""

    loss: float
    z_loss: float
    grad_norm: float
    n_targets: int
    stop: bool
    """Some rank was signalled (SIGTERM/SIGINT) before the read: every rank sees the same value."""

    @property
    def finite(self) -> bool:
        """The guard's check: the loss and the gradient norm are finite."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class StepReadout:
    def __init__(self, accelerator, world_size: int, accum_steps: int):
        self.accelerator = accelerator
        self.device = accelerator.device
        self.factor = world_size * accum_steps
        # The rank's stop flag, set with fill_ (a kernel with a scalar argument): building it with
        # torch.tensor(..., device=cuda) each step would be a host->device copy, which synchronises too.
        self._flag = torch.zeros(1, dtype=torch.float64, device=self.device)

    def target_count(self, labels: torch.Tensor) -> torch.Tensor:
        """The next-token targets of the global batch (every micro-batch, every rank), on the device."""
        return self.accelerator.reduce(count_targets(labels), reduction="sum")

    def loss_scale(self, n_targets: torch.Tensor) -> torch.Tensor:
        """W * K / n_targets as a device scalar: gradients are averaged over W ranks and accelerate divides
        by K, so the summed objective times this is the global per-target mean. inf for no targets (the
        read then reports n_targets == 0 before any update)."""
        return self.factor / n_targets.double()

    def read(
        self, loss_sums: torch.Tensor, n_targets: torch.Tensor, grad_norm, stop: bool = False
    ) -> StepScalars:
        """One all-reduce (sum) of this rank's [cross-entropy sum, z sum, stop flag], then one device->host
        read of it with the target count and the gradient norm (a tensor, a DTensor, or a float)."""
        self._flag.fill_(1.0 if stop else 0.0)
        local = torch.cat([loss_sums.to(torch.float64).reshape(2), self._flag])
        total = self.accelerator.reduce(local, reduction="sum")
        if hasattr(grad_norm, "full_tensor"):  # a DTensor norm (FSDP2): the value every rank agrees on
            grad_norm = grad_norm.full_tensor()
        if isinstance(grad_norm, torch.Tensor):
            norm = grad_norm.to(self.device, torch.float64).reshape(1)
        else:  # DeepSpeed's engine reports a float (or None before its first step)
            value = math.nan if grad_norm is None else float(grad_norm)
            norm = torch.full((1,), value, dtype=torch.float64, device=self.device)
        n = n_targets.to(torch.float64).reshape(1)
        ce, z, stops, count, norm_value = torch.cat([total, n, norm]).tolist()  # the step's one read
        return StepScalars(
            loss=ce / count if count else math.nan,
            z_loss=z / count if count else math.nan,
            grad_norm=norm_value,
            n_targets=int(count),
            stop=stops > 0,
        )
