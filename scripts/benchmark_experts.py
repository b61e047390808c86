#!/usr/bin/env python
"""Tokens/s of the recipe with each experts implementation (model.experts_implementation), side by side.

    python scripts/benchmark_experts.py configs/default.yaml [--steps 10] [--warmup 3] [--rounds 2]
                                        [--threads 1] [--implementations eager,batched_mm,grouped_mm]
                                        [--section.field=value ...]

The config's shape turned into a mixture of experts (a Qwen3-MoE of the same width, depth, heads and
vocabulary, `--experts` experts per layer, `--top-k` per token, each expert `--expert-width` wide; the
defaults, 8 experts, top-2, 256 wide, give each token the dense config's 512-wide MLP in active
parameters), trained by real `accelerate launch` runs of the recipe (scripts/benchmark.py's `recipe`:
timed between metrics rows after the warmup steps, evaluation and checkpoints off), each implementation
once per round, odd rounds in reverse order. Two clocks: wall (the fastest quarter of the steps) and CPU
(the median CPU seconds of a step, every thread of the process); on a shared machine the CPU clock is the
one to compare. The start-up line of each run says which kernel ran (`experts: ...`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import measure, recipe  # noqa: E402

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def moe_overrides(experts: int, top_k: int, width: int) -> list[str]:
    """The config's model as a Qwen3-MoE (the config's own overrides carry the shape over)."""
    return [
        "--model.type=qwen3_moe",
        f"--model.overrides.num_experts={experts}",
        f"--model.overrides.num_experts_per_tok={top_k}",
        f"--model.overrides.moe_intermediate_size={width}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per run (0: every core)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    args, overrides = parser.parse_known_args()
    names = args.implementations.split(",")
    overrides = [
        *moe_overrides(args.experts, args.top_k, args.expert_width),
        *overrides,
        f"--run.threads={args.threads}",
    ]
    print(
        f"{args.config} as a Qwen3-MoE: {args.experts} experts, top-{args.top_k}, {args.expert_width} wide; "
        f"{args.steps} timed steps after {args.warmup}, {args.rounds} rounds, {args.threads} thread(s) per run"
    )
    results: dict[str, list[dict]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        order = names if round_ % 2 == 0 else list(reversed(names))
        print(f" round {round_ + 1}: {', '.join(order)}", flush=True)
        for name in order:
            run = [*overrides, f"--model.experts_implementation={name}"]
            results[name].append(
                measure(name, lambda run=run: recipe(args.config, run, {}, args.steps, args.warmup))
            )
    base = names[0]
    print(f"{'':12} {'tokens/s':>10} {f'x {base}':>9} {'tokens/CPU-s':>13} {f'x {base}':>9} {'peak RSS':>9}")
    for name in names:
        wall = statistics.median(r["tokens_per_s"] for r in results[name])
        cpu = statistics.median(r["tokens_per_cpu_s"] for r in results[name])
        wall_x = statistics.median(
            r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(results[name], results[base], strict=True)
        )
        cpu_x = statistics.median(
            r["tokens_per_cpu_s"] / b["tokens_per_cpu_s"]
            for r, b in zip(results[name], results[base], strict=True)
        )
        rss = statistics.median(r["peak_rss_bytes"] for r in results[name]) / 2**30
        print(f"{name:12} {wall:>10,.0f} {wall_x:>8.2f}x {cpu:>13,.0f} {cpu_x:>8.2f}x {rss:>8.2f}G")


if __name__ == "__main__":
    main()
