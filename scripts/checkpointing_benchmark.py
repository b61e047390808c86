#!/usr/bin/env python
"""Tokens/s and peak tensor memory of one training step with train.activation_checkpointing none, full and
selective, side by side, on a config's model shape and batch.

    python scripts/checkpointing_benchmark.py configs/default.yaml [--steps 6] [--rounds 2] [--section.field=value ...]

Each step is what the recipe's step computes on one process: grad_accum_steps micro-batches of
micro_batch_size x seq_len tokens through the config's model and loss (train.loss_impl), backward, then the
config's optimizer step; the model is built and checkpointed by the recipe's own functions
(model.build, model.speed.enable_activation_checkpointing). The tokens are random ids of the vocabulary
(a step's cost does not depend on their values), so no corpus or tokenizer is needed. The modes run in
turn, the order reversed every other round; a mode's speed is its median step over the rounds (after one
warm-up step each round). Peak memory is torch's MemTracker in real mode over one more step: the peak of
live tensor bytes (parameters, gradients, optimizer state, activations, temporaries), not the RSS.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lmpretrain.config import load_config
from lmpretrain.model.build import build_model, build_model_config
from lmpretrain.model.objective import LMObjective, install_loss_forward, weighted_sum
from lmpretrain.model.speed import enable_activation_checkpointing
from lmpretrain.update.optim import build_optimizer

MODES = ("none", "full", "selective")


def trainer(cfg, mode: str):
    """The config's model with `mode`'s checkpointing and its optimizer; returns a function running one step."""
    torch.manual_seed(0)
    model = build_model(build_model_config(cfg.model), None, cfg.train.param_dtype).train()
    install_loss_forward(model)
    enable_activation_checkpointing(model, mode)
    optimizer = build_optimizer(model, cfg.optim)
    objective = LMObjective.from_config(cfg, eos_token_id=model.config.eos_token_id)
    shape = (cfg.train.micro_batch_size, cfg.data.seq_len)
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, model.config.vocab_size, shape, generator=gen)
        for _ in range(cfg.train.grad_accum_steps)
    ]

    def step(before_micro_batch=lambda: None):
        for ids in batches:
            before_micro_batch()
            (weighted_sum(objective(model, ids, ids)) / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def peak_bytes(model, step) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        # The tracker's per-module stats refuse a second call of the model; its step-wide peak is kept.
        step(before_micro_batch=tracker.reset_mod_stats)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    args, overrides = parser.parse_known_args()
    cfg = load_config([args.config, *overrides])
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len
    trainers = {mode: trainer(cfg, mode) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            _, step = trainers[mode]
            step()  # warm-up
            for _ in range(args.steps):
                t = time.perf_counter()
                step()
                times[mode].append(time.perf_counter() - t)
    peaks = {mode: peak_bytes(*trainers[mode]) for mode in MODES}
    print(
        f"{args.config}: {tokens:,} tokens per step ({cfg.train.micro_batch_size} x {cfg.train.grad_accum_steps}"
        f" x {cfg.data.seq_len}), loss {cfg.train.loss_impl}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds x {args.steps} steps; load average {open('/proc/loadavg').read().split()[0]}"
    )
    print(f"{'checkpointing':<14}{'step':>9}{'tokens/s':>10}{'vs none':>9}{'peak':>11}{'vs none':>9}")
    for mode in MODES:
        step_s = statistics.median(times[mode])
        none_s = statistics.median(times["none"])
        print(
            f"{mode:<14}{step_s:>8.3f}s{tokens / step_s:>10,.0f}{none_s / step_s:>9.2f}"
            f"{peaks[mode] / 2**20:>8.1f}MiB{peaks[mode] / peaks['none']:>9.2f}"
        )


if __name__ == "__main__":
    main()
