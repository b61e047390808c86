"""The numbers logged for one optimizer step: the objective's terms as `train/<name>`, the update and the
speed, the data's counters, the run's restarts and spike rollbacks. The recipe's `train_step` returns the
step's math; this adds the rest."""

from __future__ import annotations

import time

from lmpretrain.model.speed import compile_seconds
from lmpretrain.run.runtime import peak_memory_bytes


class StepMetrics:
    """`step_metrics(step, batch, state, lr, t_start, t_data)`: the metrics of the step just taken.

    `restarts`: torch elastic's restarts of this launch (run/restarts); `compiled` (train.compile): the
    first step this process takes also logs perf/compile_s (compiling happens in the first steps)."""

    def __init__(self, accelerator, meter, precision, max_norm: float, *, restarts: int = 0, compiled=False):
        self.accelerator, self.meter, self.precision, self.max_norm = accelerator, meter, precision, max_norm
        self.restarts, self.compiled, self.first = restarts, compiled, True

    def __call__(self, step, batch, state, lr, t_start, t_data) -> dict:
        """`step`: what train_step returned; `state`: the advanced TrainState; `t_start`: the step's start
        (time.perf_counter), `t_data`: the seconds it waited for its batch."""
        step_time = time.perf_counter() - t_start
        accelerator = self.accelerator
        tokens = batch.input_ids.numel() * accelerator.num_processes  # the global batch
        tokens_per_s = tokens / step_time
        metrics = {f"train/{name}": value for name, value in step["terms"].items()}  # train/loss first
        metrics |= {
            "train/lr": lr,
            "train/grad_norm": step["grad_norm"],
            "train/clipped": step["grad_norm"] > self.max_norm,
            "train/tokens_seen": state.tokens_seen,
            "train/global_batch": tokens // batch.input_ids.shape[1],  # blocks (a batch ramp changes it)
            "train/skipped_steps": state.skipped_steps,
            "perf/tokens_per_s": tokens_per_s,
            "perf/step_time_s": step_time,
            "perf/data_wait_frac": t_data / step_time,
            "perf/peak_mem_bytes": peak_memory_bytes(accelerator.device),
            **self.meter.metrics(tokens_per_s / accelerator.num_processes),  # perf/mfu
        }
        if self.precision.scaler:
            metrics["train/loss_scale"] = self.precision.loss_scale
        # The data's counters over all ranks (train/epoch, train/skipped_docs, data/<source>/tokens),
        # combined in the step's one device read.
        metrics |= {name: int(value) for name, value in step["host"].items() if name != "stop"}
        metrics |= {
            "run/restarts": self.restarts,
            # train.on_spike=rollback (update/rollback.py): the rollbacks so far, the steps and tokens skipped
            "train/rollbacks": state.rollbacks,
            "train/rolled_back_steps": state.rolled_back_steps,
            "train/rolled_back_tokens": state.rolled_back_tokens,
        }
        if self.compiled and self.first:
            metrics["perf/compile_s"] = compile_seconds()
        self.first = False
        return metrics
