"""Name the rank that stopped, while the others wait for it, and when a collective times out.

A rank that stops (SIGSTOP, a hung driver, its node gone) leaves the others waiting in a collective
until `run.collective_timeout_s` ends it. Gloo then raises "Timed out waiting ... for recv operation",
which says neither who nor when; NCCL's watchdog aborts the process without raising at all. So each rank
beats: a daemon thread counts up a key of its own in the launcher's TCPStore every `interval_s`, with the
step the rank is on, and judges for itself. When its own step has not moved for `run.stall_report_s`, it
reads every rank's beat twice, a few intervals apart: a rank whose count did not move is stopped (a
stopped process's threads stop with it), a live rank at an earlier step is stuck there. The lowest rank
still beating prints one line naming them, long before the collective's timeout, whatever the backend.
When a collective does raise its timeout (gloo; NCCL with blocking wait), the same reading names them in
the error that ends the run. Counting, not timestamps: the nodes' clocks need not agree. The store is
torch elastic's, held by the launcher, so it answers while any rank is stopped; one beat per rank per
interval, and a rank reads the W beats (one request) only after its step stalled.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lmpretrain.errors import UserError
from lmpretrain.run.process_group import restart_count

JUDGE_BEATS = 3  # a stopped rank's count does not move over this many of our beats


class CollectiveTimeout(UserError):
    """A collective waited `run.collective_timeout_s` for a rank that never joined it."""


def is_timeout(err: BaseException) -> bool:
    """Whether ``err`` is a collective that timed out (gloo's and NCCL's blocking-wait wording)."""
    return isinstance(err, RuntimeError) and "timed out" in str(err).lower()


def _say(line: str) -> None:
    # Any rank may speak (rank 0 may be the stopped one), from a thread: one write, to stderr.
    try:
        os.write(2, f"[lmpretrain] {line}\n".encode())
    except OSError:
        pass


class StallWatch:
    """``with StallWatch(...)`` (or an ExitStack's ``enter_context``) around the loop: beats while it
    runs, names stopped ranks once this rank's step has not moved for ``report_s`` seconds (``say``), and
    turns a timed-out collective into one CollectiveTimeout naming them and the step. ``step`` returns
    the optimizer steps completed so far. Does nothing in a single process or without a launcher's store
    (MASTER_ADDR/MASTER_PORT)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        step,
        timeout_s: float,
        report_s: float = 60.0,
        interval_s: float = 1.0,
        say=_say,
    ):
        self.rank, self.world_size, self.step = rank, world_size, step
        self.timeout_s, self.report_s, self.interval_s, self.say = timeout_s, report_s, interval_s, say
        self.store = self._connect() if world_size > 1 else None
        self._stop = threading.Event()
        if self.store is not None:
            self._beat_once(0)
            threading.Thread(target=self._beat, name="lmpretrain-heartbeat", daemon=True).start()

    @classmethod
    def from_config(cls, run, rank: int, world_size: int, step) -> StallWatch:
        """The watch of a run config's `run` section (collective_timeout_s, stall_report_s)."""
        return cls(rank, world_size, step, run.collective_timeout_s, run.stall_report_s)

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
        count, step, since = 0, self.step(), time.monotonic()  # since: when `step` was last seen to change
        judge_at, first, spoken = since + self.report_s, None, False  # first: (beats read, our count then)
        while not self._stop.wait(self.interval_s):
            count += 1
            try:
                self._beat_once(count)
                now = time.monotonic()
                if self.step() != step:
                    step, since, first, spoken = self.step(), now, None, False
                    judge_at = now + self.report_s
                elif spoken or now < judge_at:
                    continue
                elif first is None:
                    first = (self._read(), count)
                elif count - first[1] >= JUDGE_BEATS:
                    spoken = self._report(first[0], self._read(), now - since)
                    first, judge_at = None, now + self.report_s  # nothing to say: judge again later
            except Exception:  # noqa: BLE001 - the launcher's store is gone: the job is ending anyway
                return

    def _report(self, before, after, waited_s: float) -> bool:
        """Say which ranks this one waits for, if any, when it is the lowest rank still beating."""
        stopped, behind = self._judge(before, after)
        live = [r for r in range(self.world_size) if r in after and before.get(r) != after[r]]
        if not (stopped or behind):
            return False
        if self.rank == min(live, default=self.rank):
            what = (
                f"{self._name(stopped, after, 'stopped during')} no longer beat: the run cannot go on"
                if stopped
                else f"{self._name(behind, after, 'still at')} beat but did not finish it"
            )
            self.say(
                f"no step has ended for {waited_s:.0f} s (rank {self.rank} is in step {self.step() + 1}): "
                f"{what}. Its collectives end the run after run.collective_timeout_s={self.timeout_s:g} s "
                "(on NCCL the watchdog aborts every process); the last complete checkpoint is intact"
            )
        return True

    def _read(self) -> dict[int, tuple[int, int]]:
        """Each rank's (beat count, steps done), for the ranks that have beaten."""
        keys = [str(r) for r in range(self.world_size)]
        if self.store.check(keys):  # every rank has beaten: one request
            values = dict(zip(range(self.world_size), self.store.multi_get(keys), strict=True))
        else:
            values = {r: self.store.get(k) for r, k in enumerate(keys) if self.store.check([k])}
        return {r: tuple(int(x) for x in v.decode().split()) for r, v in values.items()}

    def _judge(self, before: dict, after: dict) -> tuple[list[int], list[int]]:
        """(the other ranks that stopped beating between two readings or never beat, the live ranks at an
        earlier step than the others)."""
        others = [r for r in range(self.world_size) if r != self.rank]
        stopped = [r for r in others if r not in after or before.get(r) == after[r]]
        steps = {r: s for r, (_, s) in after.items() if r not in stopped}
        behind = [r for r, s in steps.items() if s < max(steps.values())]
        return stopped, behind

    @staticmethod
    def _name(ranks: list[int], after: dict, how: str) -> str:
        """E.g. 'rank(s) 1 (stopped during step 8), 3 (never started)'."""
        return "rank(s) " + ", ".join(
            f"{r} ({how} step {after[r][1] + 1})" if r in after else f"{r} (never started)" for r in ranks
        )

    def stalled(self) -> str:
        """Which ranks stopped beating, at which step (reads the beats twice, 3 intervals apart)."""
        before = self._read()
        time.sleep(JUDGE_BEATS * self.interval_s)
        after = self._read()
        stopped, behind = self._judge(before, after)
        if stopped:
            return self._name(stopped, after, "stopped during")
        if behind:
            return self._name(behind, after, "still at")
        return "no rank stopped beating (a rank is alive but did not join the collective)"

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
