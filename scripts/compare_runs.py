#!/usr/bin/env python
"""Compare runs locally, without a W&B server.

    python scripts/compare_runs.py runs/a runs/b [--keys train/mtp ...] [--plot loss.png] [--assert-close 1e-4] [--wandb]

Prints a table (steps, final train loss, final/best eval loss, final eval bits per byte, their standard
errors and the held-out set's size in tokens, the EMA's final/best eval loss for runs with train.ema_decay,
median tokens/s, wall time from the first step to the last, stops and resumes included, and the last value
of each metric named by --keys; numbers with the digits that tell the runs apart, long values wrapped),
each run's final eval/loss and eval/bpb minus the first run's with a standard error (paired over the
held-out blocks when both runs scored the same ones) and whether the difference is within noise (under 2
standard errors), and the config keys that differ (what trained each
run included: recipe and fork files and their hashes, commit, package versions), writes a PNG of train and
eval loss vs tokens seen and one panel per --keys metric (default ``compare_runs.png``), and with
``--assert-close TOL`` exits 1 when two runs' train-loss curves differ by more than TOL at a common
step (for CI regression checks). Reads ``metrics.jsonl``, or the offline W&B files with ``--wandb``.
"""

from __future__ import annotations

import argparse
import sys

from lmpretrain.analysis.noise import noise_lines
from lmpretrain.analysis.runs import (
    check_close,
    config_diff,
    format_config_diff,
    format_table,
    load_runs,
    plot_runs,
    summarize,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--plot", default="compare_runs.png", help="PNG to write (default: %(default)s)")
    parser.add_argument(
        "--assert-close",
        type=float,
        metavar="TOL",
        help="exit 1 when any two runs' train/loss differ by more than TOL at a common step",
    )
    parser.add_argument(
        "--wandb", action="store_true", help="read the offline W&B files instead of metrics.jsonl"
    )
    parser.add_argument(
        "--keys",
        nargs="+",
        default=[],
        metavar="KEY",
        help="more metrics to show, e.g. train/z_loss eval/ppl",
    )
    args = parser.parse_args(argv)

    runs = load_runs(args.run_dirs, source="wandb" if args.wandb else "metrics")
    keys = tuple(args.keys)
    print(format_table([summarize(r, keys) for r in runs], keys))
    print()
    noise = noise_lines(runs)
    if noise:
        print("\n".join(noise))
        print()
    print(format_config_diff(runs, config_diff(runs)))
    print()
    print(f"plot: {plot_runs(runs, args.plot, keys)}")
    if args.assert_close is not None:
        problems = check_close(runs, args.assert_close)
        for p in problems:
            print(f"NOT CLOSE: {p}")
        if problems:
            return 1
        print(f"loss curves agree within {args.assert_close:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
