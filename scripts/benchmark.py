#!/usr/bin/env python
"""Tokens/s of the full recipe against the bare ceiling, and peak memory.

    python scripts/benchmark.py configs/default.yaml [--steps 40] [--warmup 8] [--section.field=value ...]

Ceiling: the same model, optimizer, precision and batch shape — forward + backward + AdamW step on
tensors that are already in memory, nothing else. Recipe: `accelerate launch` of recipes/pretrain.py
(with its data pipeline, loss normalisation, all-reduces, clipping, schedule, metrics and W&B), timed
by the wall clock between its metrics rows, so everything the loop does between steps counts.
Evaluation and checkpoints are switched off for both; they are periodic costs, not per-step ones.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmpretrain.config import load_config
from lmpretrain.loss import causal_lm_loss_sum, count_targets
from lmpretrain.model import build_model, build_model_config
from lmpretrain.optim import build_optimizer
from lmpretrain.precision import MixedPrecision
from lmpretrain.runtime import configure_threads

ROOT = Path(__file__).resolve().parents[1]


def ceiling(cfg, steps: int, warmup: int) -> dict:
    """Median-step tokens/s of forward + backward + AdamW on ready tensors (same shapes as the recipe)."""
    threads = configure_threads(cfg.run.threads, 1)
    torch.manual_seed(0)
    model = build_model(build_model_config(cfg.model), dtype=cfg.train.param_dtype)
    optimizer = build_optimizer(model, cfg.optim)
    precision = MixedPrecision(cfg.train.precision, torch.device("cpu"))
    B, K, T = cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.data.seq_len
    batch = torch.randint(0, model.config.vocab_size, (B * K, T))
    n_targets = count_targets(batch)
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        for x in batch.split(B):
            with precision.autocast():
                logits = model(input_ids=x).logits
            precision.scale(causal_lm_loss_sum(logits, x) / n_targets).backward()
        precision.unscale_(optimizer)
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    step = statistics.median(times[warmup:])
    return {
        "tokens_per_s": B * K * T / step,
        "step_time_s": step,
        "threads": threads,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def recipe(config: str, overrides: list[str], steps: int, warmup: int) -> dict:
    """Median-step wall-clock tokens/s of the real recipe (between its metrics rows) after `warmup` steps."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            str(Path(sys.executable).with_name("accelerate")),
            "launch",
            "--config_file",
            str(ROOT / "configs/accelerate/cpu.yaml"),
            str(ROOT / "recipes/pretrain.py"),
            config,
            f"--run.output_dir={out}/run",
            f"--train.max_steps={warmup + steps}",
            "--eval.every=0",
            "--eval.sample_tokens=0",
            "--checkpoint.every=0",
            "--optim.warmup_steps=1",
            *overrides,
        ]
        env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "HF_HUB_OFFLINE": "1"}
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(f"{out}/run/metrics.jsonl")]
    timed = rows[warmup - 1 :]
    tokens_per_step = timed[1]["perf/tokens_per_s"] * timed[1]["perf/step_time_s"]
    # Wall clock between consecutive rows: the step plus everything the loop does around it.
    step = statistics.median(
        b["_timestamp"] - a["_timestamp"] for a, b in zip(timed, timed[1:], strict=False)
    )
    return {
        "tokens_per_s": tokens_per_step / step,
        "step_time_s": step,
        "data_wait_frac": statistics.mean(r["perf/data_wait_frac"] for r in timed[1:]),
        "mfu": statistics.median(r["perf/mfu"] for r in timed[1:]),
        "peak_rss_bytes": rows[-1]["perf/peak_mem_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    args, overrides = parser.parse_known_args()
    cfg = load_config([args.config, *overrides])
    B, K, T = cfg.train.micro_batch_size, cfg.train.grad_accum_steps, cfg.data.seq_len
    print(
        f"config {args.config}: micro-batch {B} x accumulation {K} x seq_len {T} = {B * K * T} tokens/step, "
        f"precision {cfg.train.precision}, {args.steps} timed steps after {args.warmup}"
    )
    # Shared machines drift: measure the ceiling before and after the recipe and use their mean.
    before = ceiling(cfg, args.steps, args.warmup)
    full = recipe(args.config, overrides, args.steps, args.warmup)
    after = ceiling(cfg, args.steps, args.warmup)
    ceil = {**after, "tokens_per_s": (before["tokens_per_s"] + after["tokens_per_s"]) / 2}
    ceil["step_time_s"] = B * K * T / ceil["tokens_per_s"]
    gib = 2**30
    print(
        f"ceiling (fwd+bwd+AdamW, ready tensors, {ceil['threads']} threads): {ceil['tokens_per_s']:,.0f} tokens/s "
        f"(before {before['tokens_per_s']:,.0f}, after {after['tokens_per_s']:,.0f}), "
        f"{ceil['step_time_s'] * 1e3:.1f} ms/step, peak RSS {ceil['peak_rss_bytes'] / gib:.2f} GiB"
    )
    print(
        f"recipe (accelerate launch, wall clock):  {full['tokens_per_s']:,.0f} tokens/s, "
        f"{full['step_time_s'] * 1e3:.1f} ms/step, data wait {full['data_wait_frac']:.2%}, "
        f"MFU {full['mfu']:.1%}, peak RSS {full['peak_rss_bytes'] / gib:.2f} GiB"
    )
    print(f"recipe / ceiling = {full['tokens_per_s'] / ceil['tokens_per_s']:.1%}")


if __name__ == "__main__":
    main()
