#!/usr/bin/env python
"""Where one training step's time goes: the recipe's step against the lean reference's (scripts/benchmark.py).

    python scripts/profile_step.py configs/default.yaml [--shape chars|gpt2|config] [--after 10] [--top 20]
                                   [--threads 1] [--python] [--section.field=value ...]

Both train in this process on the same shape and batches: the lean reference (benchmark.py's minimal
model, fused AdamW), then the real recipe (`recipes/pretrain.py`, one process, evaluation and
checkpoints off). After `--after` steps, one step of each is profiled with torch.profiler on the CPU:
the step's wall time, the time inside torch operators (the rest is Python: module calls, the loop's
bookkeeping) and the operators with the most self time. A recipe step runs from one metrics row to
the next, so everything the loop does counts. `--python` adds cProfile's functions by cumulative time
for the recipe's step (cProfile slows Python, not torch operators: read its shares, not its seconds).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402  (the shapes and the lean reference)

from lmpretrain.config import load_config  # noqa: E402
from lmpretrain.data import TrainStream  # noqa: E402
from lmpretrain.data.tokenizer import load_tokenizer  # noqa: E402
from lmpretrain.model.build import build_model_config  # noqa: E402
from lmpretrain.observe.tracking import Tracker  # noqa: E402
from lmpretrain.run.runtime import configure_threads  # noqa: E402


def report(label: str, prof, wall: float, top: int) -> None:
    events = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6
    print(
        f"\n{label}: step {wall * 1e3:.1f} ms; in torch operators {in_ops * 1e3:.1f} ms, outside them "
        f"(Python) {(wall - in_ops) * 1e3:.1f} ms; {sum(e.count for e in events)} operator calls"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48))


def lean_step(config_path: str, overrides: list[str], after: int, top: int) -> None:
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
    batches = [s.input_ids for s, _ in zip(stream, range(after + 1), strict=False)]
    stream.close()
    torch.manual_seed(cfg.run.seed)
    model = benchmark.LeanLM(build_model_config(cfg.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.95), fused=True)

    def step(batch):
        for x in batch.split(B):
            logits = model(x)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
            (loss / K).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for batch in batches[:after]:
        step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step(batches[after])
        wall = time.perf_counter() - start
    report("lean reference", prof, wall, top)


def recipe_step(config_path: str, overrides: list[str], after: int, top: int, python: bool) -> None:
    """The recipe in this process; Tracker.log (once per step) starts and stops the profilers."""
    spec = importlib.util.spec_from_file_location("pretrain", benchmark.ROOT / "recipes/pretrain.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    prof, py = profile(activities=[ProfilerActivity.CPU]), cProfile.Profile()
    seen, wall = {}, {}
    log = Tracker.log

    def log_and_profile(self, metrics, step):
        log(self, metrics, step)
        if step == after:
            wall["start"] = time.perf_counter()
            prof.start()
            if python:
                py.enable()
        elif step == after + 1:
            if python:
                py.disable()
            prof.stop()
            wall["s"] = time.perf_counter() - wall["start"]
            seen["metrics"] = metrics

    Tracker.log = log_and_profile
    try:
        with tempfile.TemporaryDirectory() as out:
            recipe.main(
                [
                    config_path,
                    f"--run.output_dir={out}",
                    f"--train.max_steps={after + 2}",
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
    report("recipe", prof, wall["s"], top)
    if python:
        text = io.StringIO()
        pstats.Stats(py, stream=text).sort_stats("cumulative").print_stats(top * 2)
        print("recipe, Python functions by cumulative time (cProfile):\n" + text.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--shape", default="chars", choices=["chars", "gpt2", "config"])
    parser.add_argument("--after", type=int, default=10, help="steps before the profiled one")
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
        lean_step(config, overrides, args.after, args.top)
        recipe_step(config, overrides, args.after, args.top, args.python)


if __name__ == "__main__":
    main()
