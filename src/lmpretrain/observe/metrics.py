"""The numbers logged for one optimizer step: the objective's terms as `train/<name>`, the update and the
speed, and the data's counters. The recipe's `train_step` returns the step's math; this adds the rest."""

from __future__ import annotations

import time

from lmpretrain.run.runtime import peak_memory_bytes


def step_metrics(step, batch, state, lr, max_norm, t_start, t_data, accelerator, meter, precision) -> dict:
    """Metrics of the step just taken (`step`: what train_step returned; `state`: the advanced TrainState)."""
    step_time = time.perf_counter() - t_start
    tokens = batch.input_ids.numel() * accelerator.num_processes  # the global batch
    tokens_per_s = tokens / step_time
    metrics = {f"train/{name}": value for name, value in step["terms"].items()}  # train/loss first
    metrics |= {
        "train/lr": lr,
        "train/grad_norm": step["grad_norm"],
        "train/clipped": step["grad_norm"] > max_norm,
        "train/tokens_seen": state.tokens_seen,
        "train/global_batch": tokens // batch.input_ids.shape[1],  # blocks (a batch ramp changes it)
        "train/skipped_steps": state.skipped_steps,
        "perf/tokens_per_s": tokens_per_s,
        "perf/step_time_s": step_time,
        "perf/data_wait_frac": t_data / step_time,
        "perf/peak_mem_bytes": peak_memory_bytes(accelerator.device),
        **meter.metrics(tokens_per_s / accelerator.num_processes),  # perf/mfu
    }
    if precision.scaler:
        metrics["train/loss_scale"] = precision.loss_scale
    # The data's counters over all ranks (train/epoch, train/skipped_docs, data/<source>/tokens), combined
    # in the step's one device read.
    metrics |= {name: int(value) for name, value in step["host"].items() if name != "stop"}
    return metrics
