"""The recipe with one rank made a straggler: rank $SLOW_RANK waits $SLOW_RANK_S seconds before each of
its batches, a real delay in its data loading (a slow filesystem on one node), for the watchdog's test;
and a run slow enough for SLURM's time-limit signal to land mid-run (tests/test_slurm.py), where only a
job's first allocation is slow (a requeued job has SLURM_RESTART_COUNT > 0)."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import pretrain  # noqa: E402

from lmpretrain.data import TrainStream  # noqa: E402

first_allocation = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
if os.environ.get("RANK", "0") == os.environ["SLOW_RANK"] and first_allocation:
    delay, steps = float(os.environ["SLOW_RANK_S"]), TrainStream._steps

    def slow_steps(self, items):
        for blocks in steps(self, items):
            time.sleep(delay)
            yield blocks

    TrainStream._steps = slow_steps

if __name__ == "__main__":
    pretrain.cli()
