#!/usr/bin/env python
"""Where one training step's time goes: the recipe's step against the lean reference's (scripts/benchmark.py).

    python scripts/profile_step.py configs/default.yaml [--shape chars|gpt2|config] [--after 10] [--steps 5]
                                   [--top 20] [--threads 1] [--python] [--section.field=value ...]

Both train in this process on the same shape and batches: the lean reference (benchmark.py's minimal
model, fused AdamW), then the real recipe (`recipes/pretrain.py`, one process, evaluation and
checkpoints off). After `--after` steps, `--steps` steps of each are profiled with torch.profiler on the
CPU; per step: the wall time, the time inside torch operators (the rest is Python: module calls, the
loop's bookkeeping) and the operators with the most self time. A recipe step runs from one metrics row to
the next, so everything the loop does counts. `--python` adds cProfile's functions by cumulative time
for the recipe Python, not torch operators: read its shares, not its seconds).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402  (the shapes and the lean reference)

from lmpretrain.config import load_config  # noqa: E402
from lmpretrain.data import TrainStream  # noqa: E402
from lmpretrain.data.tokenizer import load_tokenizer  # noqa: E402
from lmpretrain.model.build import build_model_config  # noqa: E402
from lmpretrain.observe.tracking import Tracker  # noqa: E402
from lmpretrain.run.runtime import configure_threads  # noqa: E402


class GCTimer:
    """Time spent in Python's cyclic garbage collector (gc.callbacks), by generation, while active."""

    def __init__(self):
        self.active, self.started, self.seconds, self.counts = False, 0.0, [0.0] * 3, [0] * 3
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if not self.active:
            return
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self.started
            self.counts[info["generation"]] += 1

    def describe(self, steps: int) -> str:
        per_gen = ", ".join(f"gen {g}: {self.counts[g]} in {self.seconds[g] * 1e3:.1f} ms" for g in range(3))
        return f"garbage collection: {sum(self.seconds) / steps * 1e3:.1f} ms per step ({per_gen})"


def report(label: str, prof, wall: float, steps: int, top: int, gc_timer: GCTimer) -> None:
    events = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6 / steps
    calls = sum(e.count for e in events) // steps
    print(
        f"\n{label}, per step (mean of {steps}): {wall / steps * 1e3:.1f} ms; in torch operators "
        f"{in_ops * 1e3:.1f} ms, outside them (Python) {(wall / steps - in_ops) * 1e3:.1f} ms; {calls} operator calls"
    )
    print(gc_timer.describe(steps))
    print(f"{'operator':<56} {'self ms/step':>12} {'calls/step':>10}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"{e.key[:56]:<56} {e.self_cpu_time_total / 1e3 / steps:>12.2f} {e.count / steps:>10.1f}")


def lean_step(config_path: str, overrides: list[str], after: int, steps: int, top: int) -> None:
    cfg = load_config([config_path, *overrides])
    configure_threads(cfg.run.threads, 1)
    B, K = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
    stream = TrainStream(
        cfg.data,
        load_tokenizer(cfg.data.tokenizer),
        blocks_per_step=B * K,
        rank=0,
        world_size=1,
        seed=cfg.run.seed,
    )
    batches = [s.input_ids for s, _ in zip(stream, range(after + steps), strict=False)]
    stream.close()
    torch.manual_seed(cfg.run.seed)
    model = benchmark.LeanLM(build_model_config(cfg.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95), fused=True)

    def step(batch):
        benchmark.lean_step(model, optimizer, batch, B, K, cfg.train.max_grad_norm)

    for batch in batches[:after]:
        step(batch)
    gc_timer = GCTimer()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gc_timer.active = True
        start = time.perf_counter()
        for batch in batches[after:]:
            step(batch)
        wall = time.perf_counter() - start
        gc_timer.active = False
    report("lean reference", prof, wall, steps, top, gc_timer)


def recipe_step(
    config_path: str, overrides: list[str], after: int, steps: int, top: int, python: bool
) -> None:
    """The recipe in this process; Tracker.log (once per step) starts and stops the profilers."""
    spec = importlib.util.spec_from_file_location("pretrain", benchmark.ROOT / "recipes/pretrain.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    prof, py = profile(activities=[ProfilerActivity.CPU]), cProfile.Profile()
    wall, gc_timer = {}, GCTimer()
    log = Tracker.log

    def log_and_profile(self, metrics, step):
        log(self, metrics, step)
        if step == after:
            wall["start"] = time.perf_counter()
            prof.start()
            gc_timer.active = True
            if python:
                py.enable()
        elif step == after + steps:
            if python:
                py.disable()
            prof.stop()
            gc_timer.active = False
            wall["s"] = time.perf_counter() - wall["start"]

    Tracker.log = log_and_profile
    try:
        with tempfile.TemporaryDirectory() as out:
            recipe.main(
                [
                    config_path,
                    f"--run.output_dir={out}",
                    f"--train.max_steps={after + steps + 1}",
                    "--eval.every=0",
                    "--eval.batches=1",
                    "--eval.sample_tokens=0",
                    "--checkpoint.every=0",
                    "--optim.warmup_steps=1",
                    "--logging.wandb_mode=disabled",
                    *overrides,
                ]
            )
    finally:
        Tracker.log = log
    report("recipe", prof, wall["s"], steps, top, gc_timer)
    if python:
        text = io.StringIO()
        pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(top * 2)
        print("recipe, functions by their own time (cProfile):\n" + text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--shape", default="chars", choices=["chars", "gpt2", "config"])
    parser.add_argument("--after", type=int, default=10, help="steps before the profiled one")
    parser.add_argument("--steps", type=int, default=5, help="steps profiled")
    parser.add_argument("--top", type=int, default=20, help="operators shown")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--python", action="store_true", help="also cProfile the recipe's step")
    args, overrides = parser.parse_known_args()
    overrides.append(f"--run.threads={args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        config = args.config
        if args.shape == "gpt2":
            config = benchmark.gpt2_shape(args.config, Path(tmp))
        elif args.shape == "chars":
            config = benchmark.gpt2_shape(
                args.config, Path(tmp), benchmark.CHARS, len(load_tokenizer(benchmark.CHARS))
            )
        lean_step(config, overrides, args.after, args.steps, args.top)
        recipe_step(config, overrides, args.after, args.steps, args.top, args.python)


if __name__ == "__main__":
    main()
