"""The update guard: a step whose loss or gradient norm is not finite, or (with train.skip_spikes) whose
loss spikes far above its recent level, is not applied; too many such steps in a row stop the run.

The loop asks the guard after the gradients are unscaled and clipped and before the optimizer steps, so
a skipped step changes no weight and no Adam moment (and the schedule does not advance). The decision
depends only on the loss reduced over all ranks and the global gradient norm, so every rank takes the
same one. Its state (the consecutive-skip count and the spike window) is saved in checkpoints, so a
resumed run decides exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math
from collections import deque

from lmpretrain.errors import ConfigError, TrainingDiverged

# Why a step's update was skipped; each is warned about once (console.ConsoleWarnings).
NONFINITE = "nonfinite"  # the loss or the gradient norm is inf/NaN: divergence
OVERFLOW = "overflow"  # fp16 gradients overflowed the loss scale: the scaler halves it and goes on
SPIKE = "spike"  # the loss is far above the recent window (train.skip_spikes)


def _retry_hint(first_skipped: int) -> str:
    return (
        f"Lower optim.lr (or raise optim.warmup_steps or set train.max_grad_norm), then resume from a "
        f"checkpoint written before step {first_skipped} with --run.resume=<output_dir>/checkpoints/step-... "
        f"and the new values (they take effect at resume)."
    )


class LossWindow:
    """The last `size` losses; a loss is a spike when it exceeds their mean + sigma * std."""

    def __init__(self, size: int, min_count: int):
        self.min_count = min_count
        self.losses: deque[float] = deque(maxlen=size)

    def stats(self) -> tuple[float, float] | None:
        """(mean, population std) of the window, or None while it holds fewer than min_count losses."""
        if len(self.losses) < self.min_count:
            return None
        mean = sum(self.losses) / len(self.losses)
        return mean, math.sqrt(sum((x - mean) ** 2 for x in self.losses) / len(self.losses))

    def is_spike(self, loss: float, sigma: float) -> bool:
        stats = self.stats()
        return stats is not None and stats[1] > 0 and loss > stats[0] + sigma * stats[1]

    def push(self, loss: float) -> None:
        self.losses.append(float(loss))

    def state_dict(self) -> list[float]:
        return list(self.losses)

    def load_state_dict(self, losses: list[float]) -> None:
        self.losses.clear()
        self.losses.extend(float(x) for x in losses)


def guard_problems(train_cfg, *, engine_steps: bool) -> list[str]:
    """What the guard cannot do with this backend (`engine_steps`: DeepSpeed steps inside backward)."""
    if train_cfg.skip_spikes and engine_steps:
        return [
            "train.skip_spikes cannot run under DeepSpeed: its engine applies the update inside the last "
            "micro-batch's backward, before the step's loss is known. Launch without DeepSpeed (DDP/FSDP) or "
            "set --train.skip_spikes=false"
        ]
    return []


class UpdateGuard:
    """Decides per step whether the update is applied, and stops the run after too many skips in a row."""

    def __init__(self, train_cfg, *, engine_steps: bool = False):
        problems = guard_problems(train_cfg, engine_steps=engine_steps)
        if problems:
            raise ConfigError(problems)
        self.max_skipped = train_cfg.max_skipped_steps
        self.sigma = train_cfg.spike_sigma if train_cfg.skip_spikes else None
        # Half a window before judging: the mean and std of a few losses are too noisy to skip on.
        self.window = LossWindow(train_cfg.spike_window, min_count=max(2, train_cfg.spike_window // 2))
        self.consecutive = 0
        self.nonfinite = 0  # of the skips since the last applied update, those with a non-finite loss or norm

    def check(self, loss: float, grad_norm: float, scaler_backs_off: bool = False) -> str | None:
        """Why this step's update must be skipped (NONFINITE, OVERFLOW or SPIKE), or None to apply it.

        `scaler_backs_off`: an fp16 loss scaler will halve its scale after inf/NaN gradients
        (MixedPrecision.backs_off_overflows); such gradients with a finite loss are then its business.
        """
        if not math.isfinite(loss):
            return NONFINITE
        if not math.isfinite(grad_norm):
            return OVERFLOW if scaler_backs_off else NONFINITE
        if self.sigma is not None and self.window.is_spike(loss, self.sigma):
            return SPIKE
        return None

    def record(self, step: int, loss: float, grad_norm: float, skipped: str | None) -> None:
        """Count the step (applied when `skipped` is None); raise TrainingDiverged after
        train.max_skipped_steps skipped updates in a row (fp16 overflows the scaler handles excepted)."""
        if skipped is None:
            self.consecutive = self.nonfinite = 0
            self.window.push(loss)
            return
        if skipped == OVERFLOW:
            return
        self.consecutive += 1
        self.nonfinite += skipped == NONFINITE
        if self.consecutive >= self.max_skipped:
            first = step - self.consecutive + 1
            raise TrainingDiverged(
                f"training diverged: the updates of steps {first}-{step} ({self.consecutive} in a row, "
                f"train.max_skipped_steps={self.max_skipped}) were all skipped; at step {step} the loss is "
                f"{loss:.4g} and the gradient norm {grad_norm:.4g}. No weight changed in these steps. "
                + _retry_hint(first)
            )

    @property
    def stalled(self) -> bool:
        """Whether the updates since the last applied one were skipped for a non-finite loss or gradient
        (a skipped loss spike is the guard working, not a stalled run)."""
        return self.nonfinite > 0

    def checkpoint_due(self, step: int, every: int, final: bool) -> bool:
        """Whether step `step` saves a checkpoint: every `every` steps (0: never) and at the end. Not
        periodically while updates are skipped, nor at the end while they are non-finite: a diverging run
        must not rotate its last good checkpoints out for copies of the weights it stalled on."""
        periodic = bool(every) and step % every == 0 and not self.consecutive
        return periodic or (final and not self.stalled)

    def check_finished(self, step: int, eval_loss: float | None) -> None:
        """At the end of the run, before anything is exported: raise TrainingDiverged when the last
        updates were being skipped as non-finite (a streak shorter than train.max_skipped_steps that the
        end cut off) or the final evaluation's loss is not finite. Either way the model is not the trained one."""
        if self.stalled:
            first = step - self.consecutive + 1
            raise TrainingDiverged(
                f"training diverged: the run reached its last step {step} while skipping updates: those of "
                f"steps {first}-{step} ({self.consecutive} in a row, fewer than "
                f"train.max_skipped_steps={self.max_skipped}) were all skipped, so the weights are those of "
                f"step {first - 1} and the run did not train to the end. Nothing was exported. "
                + _retry_hint(first)
            )
        if eval_loss is not None and not math.isfinite(eval_loss):
            raise TrainingDiverged(
                f"training diverged: the final evaluation at step {step} has loss {eval_loss:.4g}, so the "
                f"model does not work. Nothing was exported. Lower optim.lr (or raise optim.warmup_steps or "
                f"set train.max_grad_norm), then resume from a checkpoint whose eval loss is finite with "
                f"--run.resume=<output_dir>/checkpoints/step-... and the new values (they take effect at "
                f"resume)."
            )

    def state_dict(self) -> dict:
        return {
            "consecutive": self.consecutive,
            "nonfinite": self.nonfinite,
            "losses": self.window.state_dict(),
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Restore a checkpoint's guard state (None: a checkpoint written before the guard existed)."""
        state = state or {}
        self.consecutive = int(state.get("consecutive", 0))
        self.nonfinite = int(state.get("nonfinite", 0))
        self.window.load_state_dict(state.get("losses", []))
