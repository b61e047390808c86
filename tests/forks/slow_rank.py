"""The recipe with one rank made a straggler: rank $SLOW_RANK waits $SLOW_RANK_S seconds before each of
its batches, a real delay in its data loading (a slow filesystem on one node), for the watchdog's test."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import pretrain  # noqa: E402

from lmpretrain.data import TrainStream  # noqa: E402

if os.environ.get("RANK") == os.environ["SLOW_RANK"]:
    delay, steps = float(os.environ["SLOW_RANK_S"]), TrainStream._steps

    def slow_steps(self, items):
        for blocks in steps(self, items):
            time.sleep(delay)
            yield blocks

    TrainStream._steps = slow_steps

if __name__ == "__main__":
    pretrain.cli()
