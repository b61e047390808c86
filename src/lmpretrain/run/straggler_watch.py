"""Warn when one rank is a straggler: its own share of each step is much longer than the other ranks'.

A whole step's wall time is the same on every rank: the first collective of the step (the target count's
all-reduce, then the gradients' sync) makes every rank wait for the slowest one. What differs between
ranks is the time a rank spends before it first waits for the others: loading its batch (the recipe's
`t_data`, from the step's start until the batch is in hand). Each rank sends that time in the step's one
cross-rank readout (`read_step`, combine "each"), so the watch adds no collective, and every rank gets
every rank's time.

The decision uses the last `window` steps (8): per rank the median of its times, so one slow read (a
shard opened, a document window refilled) is not a straggler. Rank r is one when its median exceeds
`factor` times the median of the other ranks' medians, and the excess is at least `min_share` (5%) of the
median step time, so microseconds of noise over a near-zero load never warn. Rank 0 prints one line, at
most once every `every` steps (100). A rank that is slow in compute rather than in loading is not seen on
CPU (gloo's collectives make the others wait inside the step: their host times are equal), nor on GPUs
(the host does not wait for the device before the readout); see docs/cluster.md.
"""

from __future__ import annotations

import time
from collections import deque
from statistics import median

KEY = "straggler/load_s"  # the host number read_step gathers from every rank


def find_straggler(
    times: list[list[float]], factor: float, step_time: float, min_share: float = 0.05
) -> tuple[int, float, float] | None:
    """(rank, its median time, the other ranks' median) of the slowest rank when it is a straggler, else None.

    `times[i][r]`: rank r's time at the i-th step of the window; `step_time`: the median step wall time."""
    if len(times[0]) < 2:
        return None
    per_rank = [median(column) for column in zip(*times, strict=True)]
    slowest = max(range(len(per_rank)), key=per_rank.__getitem__)
    others = median(t for r, t in enumerate(per_rank) if r != slowest)
    mine = per_rank[slowest]
    if mine > factor * others and mine - others >= min_share * step_time:
        return slowest, mine, others
    return None


class StragglerWatch:
    """`host(t_data)`: this rank's entry for the step's readout; `observe(step, shared)` after the readout:
    pops the gathered times from `shared` and says the warning when a rank is a straggler. `factor` of None
    or 0 (run.straggler_factor) turns it off; a single process has no one to compare with."""

    def __init__(self, factor: float | None, world_size: int, say, window: int = 8, every: int = 100):
        self.enabled = bool(factor) and world_size > 1
        self.factor, self.say, self.every = factor, say, every
        self.times: deque[list[float]] = deque(maxlen=window)
        self.step_times: deque[float] = deque(maxlen=window)
        self.last_seen: float | None = None  # when the previous step's readout was observed
        self.warned_at: int | None = None

    def host(self, t_data: float) -> dict:
        return {KEY: (t_data, "each")} if self.enabled else {}

    def observe(self, step: int, shared: dict) -> None:
        if not self.enabled:
            return
        times, now = shared.pop(KEY), time.perf_counter()
        if self.last_seen is not None:  # a step's wall time: from one readout to the next
            self.step_times.append(now - self.last_seen)
            self.times.append(times)
        self.last_seen = now
        if len(self.times) < self.times.maxlen:
            return
        if self.warned_at is not None and step - self.warned_at < self.every:
            return
        found = find_straggler(list(self.times), self.factor, median(self.step_times))
        if found:
            rank, mine, others = found
            self.warned_at = step
            self.say(
                f"WARNING: rank {rank} is a straggler at step {step}: it takes {mine:.3f} s to load its batch, "
                f"{mine / max(others, 1e-9):.1f}x the other ranks' median {others:.3f} s (medians of the last "
                f"{len(self.times)} steps, step time {median(self.step_times):.3f} s; run.straggler_factor="
                f"{self.factor:g}); every rank waits for it each step"
            )
