"""What one optimizer step really sends and holds on this rank: `logging.bytes_at_step: N`.

Step N runs under `CollectiveBytes`, the planner's own counter (observe/collectives.py: every collective the
step dispatches, DDP's gradient buckets, FSDP2's gathers and reduce-scatters, Muon's and DeepSpeed's
included, sized as bytes *received* per rank for ring algorithms), and at its optimizer step it reads the
bytes this rank holds of parameters and optimizer state and the gradients the optimizer steps (ZeRO-2:
this rank's fp32 gradient partition; DeepSpeed's transient copies in the model's dtype are not in it). The step
also runs under torch's MemTracker on the real tensors: `memory/peak_bytes` is the most bytes of tensors alive
at once on this rank during the step (parameters, gradients, optimizer state, activations, gathered weights,
collective buffers, temporaries; storages FSDP2 frees by resizing count as freed), the figure the plan's
peak predicts. They are logged once, as
`comm/<kind>_bytes` and `memory/<kind>_bytes` in that step's metrics (metrics.jsonl, W&B), and said in one
line: what `python -m lmpretrain.plan` predicts for the same config, from the run itself (the tests
compare the two). The step's own bookkeeping collectives (the target count, the logged numbers) are in it
too: a few hundred bytes.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def innermost_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that steps: inside accelerate's wrapper, and DeepSpeed's ZeRO optimizer (whose
    own torch optimizer steps this rank's fp32 partition)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _stepped_grad_bytes(inner: torch.optim.Optimizer) -> int:
    return sum(_nbytes(p.grad) for g in inner.param_groups for p in g["params"])


def held_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters (local shards under FSDP2) and optimizer state. The stepping
    optimizer's own parameters, when they are not the model's (DeepSpeed's fp32 master partition), are
    optimizer state."""
    inner = innermost_optimizer(optimizer)
    params = {id(p): p for p in model.parameters()}
    own = [p for g in inner.param_groups for p in g["params"] if id(p) not in params]
    state = sum(_nbytes(t) for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    return {"params": sum(_nbytes(p) for p in params.values()), "optimizer": state + sum(map(_nbytes, own))}


def _local_mem_tracker():
    """torch's MemTracker seeing the local tensors of DTensor ops (FSDP2's sharded parameters, their optimizer
    state) rather than the DTensors: as FSDPMemTracker does, a DTensor op is let run down to its local ops,
    which the tracker then counts."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class LocalMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            # Each micro-batch calls the model again, which torch's tracker refuses for its per-module stats;
            # only the step's peak is read, and that is kept apart from them.
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                if set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                    self.reset_mod_stats()
            return super()._pre_fw_hook(module, inputs)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):
                return NotImplemented
            return super().__torch_dispatch__(func, types, args, kwargs)

    return LocalMemTracker()


class StepBytes:
    """`with step_bytes.at(n): <the step>` counts step n when it is `logging.bytes_at_step`; `metrics()` then
    returns its figures once (comm/<kind>_bytes for every kind, comm/muon_bytes: those of Muon's step)."""

    def __init__(self, step: int, model, optimizer, say=None, held=()):
        self.step, self.model, self.optimizer, self.say = step, model, optimizer, say
        self.held = list(held)  # other tensors alive through the step (the EMA's average), for the peak
        self._figures: dict[str, float] = {}

    @contextlib.contextmanager
    def at(self, step: int):
        if step != self.step:
            yield
            return
        # Imported only for the counted step: CommDebugMode's module imports torch.distributed._tools and
        # inductor (~1 s of every rank's start-up otherwise).
        from lmpretrain.observe.collectives import KINDS, CollectiveBytes

        inner = innermost_optimizer(self.optimizer)
        grads, in_step = [], CollectiveBytes()

        # DeepSpeed steps its torch optimizer once per parameter group, on that group alone (each group's
        # fp32 gradient partition exists only then): the gradients are summed over the calls.
        def at_optimizer_step(*_):
            grads.append(_stepped_grad_bytes(inner))
            in_step.__enter__()  # the optimizer step's collectives apart: Muon's own line

        def after_optimizer_step(*_):
            in_step.__exit__(None, None, None)

        hooks = [
            inner.register_step_pre_hook(at_optimizer_step),
            inner.register_step_post_hook(after_optimizer_step),
        ]
        tracker = _local_mem_tracker()
        tracker.track_external(self.model, inner, *self.held)
        try:
            with CollectiveBytes() as counted, tracker:
                yield
        finally:
            for hook in hooks:
                hook.remove()
        optimizer_step = dict(in_step.received)
        muon = any(g.get("kind") == "muon" for g in inner.param_groups)
        comm = {kind: counted.received.get(kind, 0.0) for kind in KINDS}
        comm["muon"] = sum(optimizer_step.values()) if muon else 0.0
        if muon:  # the outer counter saw Muon's collectives too: they are its own line only
            for kind, value in optimizer_step.items():
                comm[kind] -= value
        self._figures = {f"comm/{k}_bytes": round(v) for k, v in comm.items()}
        peak = max((snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()), default=0)
        held = {**held_bytes(self.model, self.optimizer), "grads": sum(grads), "peak": peak}
        self._figures |= {f"memory/{k}_bytes": v for k, v in held.items()}
        if self.say:
            figures = ", ".join(f"{k.split('/')[1]} {v:,}" for k, v in self._figures.items() if v)
            self.say(f"step {step} on this rank (logging.bytes_at_step): {figures}")

    def metrics(self) -> dict[str, float]:
        figures, self._figures = self._figures, {}
        return figures
