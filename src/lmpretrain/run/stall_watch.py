"""Name the rank that stopped when a collective times out.

A rank that stops (SIGSTOP, a hung driver, its node gone) leaves the others waiting in a collective
until `run.collective_timeout_s` ends it with gloo's "Timed out waiting ... for recv operation", which
says neither who nor when. Each rank therefore beats: a daemon thread counts up a key of its own in the
launcher's TCPStore every `interval_s`, with the step the rank is on. When a collective times out, a
rank reads every rank's beat twice, a few intervals apart: a rank whose count did not move is stopped
(a stopped process's threads stop with it). Counting, not timestamps: the nodes' clocks need not agree.
The store is torch elastic's, held by the launcher, so it answers while any rank is stopped.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lmpretrain.errors import UserError
from lmpretrain.run.process_group import restart_count


class CollectiveTimeout(UserError):
    """A collective waited `run.collective_timeout_s` for a rank that never joined it."""


def is_timeout(err: BaseException) -> bool:
    """Whether ``err`` is a collective that timed out (gloo's and NCCL's blocking-wait wording)."""
    return isinstance(err, RuntimeError) and "timed out" in str(err).lower()


class StallWatch:
    """``with StallWatch(...)`` (or an ExitStack's ``enter_context``) around the loop: beats while it
    runs, and turns a timed-out collective into one CollectiveTimeout naming the stopped rank(s) and the
    step. ``step`` returns the optimizer steps completed so far. Does nothing in a single process or
    without a launcher's store (MASTER_ADDR/MASTER_PORT)."""

    def __init__(self, rank: int, world_size: int, step, timeout_s: float, interval_s: float = 1.0):
        self.rank, self.world_size, self.step = rank, world_size, step
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.store = self._connect() if world_size > 1 else None
        self._stop = threading.Event()
        if self.store is not None:
            self._beat_once(0)
            threading.Thread(target=self._beat, name="lmpretrain-heartbeat", daemon=True).start()

    def _connect(self):
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not (addr and port):
            return None
        # A client of its own: the beats never queue behind the process group's use of the store.
        client = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30))
        return dist.PrefixStore(f"lmpretrain/attempt_{restart_count()}/heartbeat", client)

    def _beat_once(self, count: int) -> None:
        self.store.set(str(self.rank), f"{count} {self.step()}")

    def _beat(self) -> None:
        count = 0
        while not self._stop.wait(self.interval_s):
            count += 1
            try:
                self._beat_once(count)
            except Exception:  # noqa: BLE001 - the launcher's store is gone: the job is ending anyway
                return

    def _read(self) -> dict[int, tuple[int, int]]:
        beats = {}
        for r in range(self.world_size):
            if self.store.check([str(r)]):
                count, step = self.store.get(str(r)).decode().split()
                beats[r] = int(count), int(step)
        return beats

    def stalled(self) -> str:
        """Which ranks stopped beating, at which step (reads the beats twice, 3 intervals apart)."""
        before = self._read()
        time.sleep(3 * self.interval_s)
        after = self._read()
        others = [r for r in range(self.world_size) if r != self.rank]
        stopped = [r for r in others if r not in after or before.get(r) == after[r]]
        if not stopped:
            steps = {r: s for r, (_, s) in after.items()}
            behind = [r for r, s in steps.items() if s < max(steps.values())]
            if behind:
                return "rank(s) " + ", ".join(f"{r} (still at step {steps[r] + 1})" for r in behind)
            return "no rank stopped beating (a rank is alive but did not join the collective)"
        return "rank(s) " + ", ".join(
            f"{r} (stopped during step {after[r][1] + 1})" if r in after else f"{r} (never started)"
            for r in stopped
        )

    def close(self) -> None:
        self._stop.set()

    def __enter__(self) -> StallWatch:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc is None or not is_timeout(exc):
                return
            who = self.stalled() if self.store is not None else "unknown (no launcher store to ask)"
        finally:
            self.close()
        raise CollectiveTimeout(
            f"rank {self.rank} waited run.collective_timeout_s={self.timeout_s:g} s in a collective during "
            f"step {self.step() + 1} for {who}; stopping. The last complete checkpoint is intact: resume "
            "with the same command (under accelerate launch --max_restarts the launcher restarts the job)"
        ) from None
