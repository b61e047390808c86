"""Console output of a run: concise log lines, and warnings said once per kind instead of every step."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lmpretrain.progress import step_bar
from lmpretrain.update.guard import NONFINITE, OVERFLOW, SPIKE, LossWindow


def as_scalar(value: Any) -> Any:
    """A Python number from a 0-d tensor or numpy scalar; anything else unchanged."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    return value


class ConsoleWarnings:
    """Warnings said once per kind: clipping on every step, skipped updates (by reason), loss spikes."""

    def __init__(
        self,
        printer: Callable[[str], Any] = print,
        *,
        spike_sigma: float = 4.0,
        window: int = 50,
        min_window: int = 10,
        clip_streak: int = 20,
        max_skipped: int | None = None,
    ) -> None:
        self.printer = printer
        self.spike_sigma = spike_sigma
        self.clip_streak = clip_streak
        self.max_skipped = max_skipped
        self.said: set[str] = set()
        self._losses = LossWindow(window, min_count=min_window)
        self._clipped_run = 0

    def _say(self, kind: str, message: str) -> None:
        if kind not in self.said:
            self.said.add(kind)
            self.printer(f"warning: {message} (said once)")

    def observe(self, step: int, loss: float, clipped: bool = False, skipped: str | None = None) -> None:
        """Feed one optimizer step (`skipped`: why its update was skipped, see lmpretrain.update.guard); prints
        each kind of warning the first time it happens."""
        loss = float(loss)
        self._clipped_run = self._clipped_run + 1 if clipped else 0
        if self._clipped_run >= self.clip_streak:
            self._say(
                "clipping",
                f"the gradient was clipped on each of the last {self._clipped_run} steps "
                f"(step {step}): max_grad_norm may be too low or the lr too high",
            )
        if skipped is not None:
            stop = f"; {self.max_skipped} in a row stop the run" if self.max_skipped else ""
            self._say(
                f"skipped:{skipped}",
                {
                    OVERFLOW: f"step {step} was skipped: inf/nan gradients under fp16 loss scaling, the "
                    "scale is halved",
                    NONFINITE: f"the update of step {step} was skipped: its loss ({loss:.4g}) or gradient "
                    f"norm is not finite{stop}",
                    SPIKE: f"the update of step {step} was skipped: its loss {loss:.4f} is a spike "
                    f"(train.skip_spikes){stop}",
                }[skipped]
                + " (train/skipped_steps counts skipped steps)",
            )
            return  # a skipped step's loss is no part of the recent level
        if self._losses.is_spike(loss, self.spike_sigma):
            mean, std = self._losses.stats()
            self._say(
                "spike",
                f"loss spike at step {step}: {loss:.4f} is more than "
                f"{self.spike_sigma:g} sigma above the last {len(self._losses.losses)} steps' "
                f"mean {mean:.4f} (sigma {std:.4f})",
            )
        self._losses.push(loss)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def format_log_line(
    step: int, metrics: Mapping[str, Any], max_steps: int | None = None, terms: Iterable[str] = ()
) -> str:
    """A concise console line from the logged metrics (only the keys present are shown); `terms`: the
    objective's term names, each shown after the loss."""
    m = {k: as_scalar(v) for k, v in metrics.items()}
    parts = [f"step {step}/{max_steps}" if max_steps else f"step {step}"]
    if "train/loss" in m:
        parts.append(f"loss {m['train/loss']:.4f}")
    parts += [f"{name} {m[f'train/{name}']:.4g}" for name in terms if name != "loss" and f"train/{name}" in m]
    if "train/lr" in m:
        parts.append(f"lr {m['train/lr']:.2e}")
    if "train/grad_norm" in m:
        parts.append(f"gnorm {m['train/grad_norm']:.3g}" + (" (clipped)" if m.get("train/clipped") else ""))
    if "moe/load_max" in m:  # the busiest expert's share of its layer's tokens, against an even share
        parts.append(f"expert load max {m['moe/load_max']:.2f}x")
    if "perf/tokens_per_s" in m:
        parts.append(f"{_si(m['perf/tokens_per_s'])} tok/s")
    if "perf/mfu" in m:
        parts.append(f"mfu {100 * m['perf/mfu']:.1f}%")
    if "perf/data_wait_frac" in m:
        parts.append(f"data wait {100 * m['perf/data_wait_frac']:.0f}%")
    if "perf/peak_mem_bytes" in m:
        parts.append(f"mem {m['perf/peak_mem_bytes'] / 2**30:.2f} GiB")
    if m.get("train/skipped_steps"):
        parts.append(f"skipped {m['train/skipped_steps']}")
    if "eval/loss" in m:
        parts.append(
            f"eval loss {m['eval/loss']:.4f}"
            + (f" ± {m['eval/loss_se']:.4f}" if "eval/loss_se" in m else "")  # the held-out set's noise
            + (f" (ema {m['eval/ema/loss']:.4f})" if "eval/ema/loss" in m else "")
            + (f" ppl {m['eval/ppl']:.2f}" if "eval/ppl" in m else "")
        )
    if "eval/bpb" in m:
        parts.append(f"bpb {m['eval/bpb']:.3f}")
    for task, (metric, value) in main_task_metrics(m).items():
        parts.append(f"{task} {metric} {value:.3f}")
    if "train/tokens_seen" in m:
        parts.append(f"{_si(m['train/tokens_seen'])} tokens")
    return " | ".join(parts)


# The headline of a downstream task, in this order of preference: length-normalised accuracy where the
# task reports it (multiple choice over answers of different lengths), else accuracy, else the others.
_MAIN_TASK_METRICS = ("acc_norm", "acc", "exact_match", "f1", "mcc", "bleu", "word_perplexity")


def main_task_metrics(metrics: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
    """task -> (metric, value) of its headline metric, from the `eval/<task>/<metric>` keys."""
    by_task: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval":
            by_task.setdefault(parts[1], {})[parts[2]] = value
    main = {}
    for task, values in by_task.items():
        name = next((n for n in _MAIN_TASK_METRICS if n in values), None)
        if name is not None:
            main[task] = (name, values[name])
    return main


class StepLog:
    """Where a step's metrics go: W&B and metrics.jsonl (`tracker`), the step bar's loss and lr, and every
    `every` steps the console line (main process only)."""

    def __init__(self, tracker, progress, every: int, max_steps: int, main: bool):
        self.tracker, self.progress, self.main = tracker, progress, main
        self.every, self.max_steps = every, max_steps

    @classmethod
    def for_run(cls, tracker, cfg, start_step: int, main: bool) -> StepLog:
        """A run's step log (logging.every) with its step bar, from `start_step` to train.max_steps."""
        progress = step_bar(total=cfg.train.max_steps, initial=start_step, enabled=main)
        return cls(tracker, progress, cfg.logging.every, cfg.train.max_steps, main)

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.progress.close()

    def __call__(self, step: int, metrics: Mapping[str, Any], terms: Iterable[str] = ()) -> None:
        self.tracker.log(metrics, step=step)
        self.progress.update(1)
        loss, lr = f"{metrics['train/loss']:.3f}", f"{metrics['train/lr']:.2e}"
        self.progress.set_postfix(loss=loss, lr=lr, refresh=False)
        if step % self.every == 0 and self.main:
            self.progress.write(format_log_line(step, metrics, self.max_steps, terms=terms))
