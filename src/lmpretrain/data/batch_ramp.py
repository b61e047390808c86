"""`BatchRamp`: how many blocks optimizer step s takes (`train.batch_ramp`), the one function the data
stream, the token counter, the accumulation and the lr all read.

A ramp is a list of stages (until_tokens N_i, global batch B_i) and then the final batch B (micro x accum x
world size). Stage i lasts while fewer than N_i tokens have been trained on: it starts at T_i tokens and
takes ceil((N_i - T_i) / (B_i x seq_len)) steps (its last step may run past N_i; the next stage starts where
it ended). So the blocks of step s, and the blocks before it, are closed forms of s over a handful of
stages: a resumed run (any process count) finds its batch from its step alone, and nothing about the ramp
is saved but the step.

The schedule counts tokens: `schedule_steps(n)` is how many steps of the final batch the first n steps'
tokens make, so warmup_steps, max_steps and wsd's decay are measured in steps of the final batch (the same
numbers as without a ramp, and the lr at the end of the ramp matches the constant-batch run's at the same
tokens). The lr of a stage is further scaled by (B_i / B)^{1/2 | 1 | 0} (`train.batch_ramp_lr`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

LR_POWERS = {"sqrt": 0.5, "linear": 1.0, "constant": 0.0}


@dataclass(frozen=True)
class BatchRamp:
    final: int
    """Blocks per step after the ramp (the config's global batch)."""
    seq_len: int = 1
    stages: tuple[tuple[int, int], ...] = ()
    """(until_tokens, blocks per step) of each stage, in order."""
    lr_power: float = 0.5

    @classmethod
    def from_config(cls, train, global_batch: int, seq_len: int) -> BatchRamp:
        stages = tuple((int(s.until_tokens), s.global_batch) for s in train.batch_ramp)
        return cls(global_batch, seq_len, stages, LR_POWERS[train.batch_ramp_lr])

    def __post_init__(self):
        # first step and blocks before it, of each stage and of the final batch (the last entry)
        starts, step, blocks = [], 0, 0
        for until, size in self.stages:
            starts.append((step, blocks))
            n = max(0, -(-(until - blocks * self.seq_len) // (size * self.seq_len)))
            step, blocks = step + n, blocks + n * size
        starts.append((step, blocks))
        object.__setattr__(self, "_starts", starts)
        object.__setattr__(self, "_first_steps", [s for s, _ in starts])

    def _stage(self, step: int) -> int:
        return bisect.bisect_right(self._first_steps, step) - 1

    def blocks(self, step: int) -> int:
        """Blocks of the step after `step` completed ones (0-based step index)."""
        i = self._stage(step)
        return self.stages[i][1] if i < len(self.stages) else self.final

    def blocks_before(self, step: int) -> int:
        """Blocks the first `step` steps took together."""
        i = self._stage(step)
        first, before = self._starts[i]
        return before + (step - first) * self.blocks(step)

    def schedule_steps(self, step: int) -> float:
        """The first `step` steps' tokens in steps of the final batch (= step without a ramp)."""
        return step if not self.stages else self.blocks_before(step) / self.final

    def lr_scale(self, step: int) -> float:
        """The lr multiplier of step `step` (0-based): (its batch / the final batch)^power."""
        return 1.0 if not self.stages else (self.blocks(step) / self.final) ** self.lr_power

    def describe(self) -> str:
        if not self.stages:
            return f"{self.final} blocks per step"
        parts = [
            f"{size} blocks for steps {first + 1}-{nxt}"
            for (_, size), (first, _), (nxt, _) in zip(
                self.stages, self._starts[:-1], self._starts[1:], strict=True
            )
            if nxt > first
        ]
        return (
            f"batch ramp: {', '.join(parts)}, then {self.final} blocks per step "
            f"(lr x (batch / {self.final})^{self.lr_power:g})"
        )
