"""What a run's steps spend their time and memory on: train.profile_steps and CUDA out-of-memory snapshots.

With train.profile_steps=[start, end], steps start..end run under torch.profiler and each rank writes
`<output_dir>/profile/trace-rank<R>-steps<start>-<end>.json` (Chrome trace format: open it in Perfetto,
https://ui.perfetto.dev, or chrome://tracing), each step a "train step N" range holding its ops; on CUDA
also `memory-rank<R>-steps<start>-<end>.pickle`, the allocator's history over those steps (drag it onto
https://pytorch.org/memory_viz); on every device `syncs-rank<R>-steps<start>-<end>.json`: the blocking
transfers between host and device of each step and the source lines that make them (observe/host_transfers.py;
on CUDA beside torch's own count of synchronizing operations, torch.cuda.set_sync_debug_mode). On CUDA,
whatever the setting, an out-of-memory error writes
`oom-rank<R>.pickle` (the allocator's segments and blocks at that moment) before the error propagates.
The loop calls `profiler.step(n)` once, before step n; leaving the `with` block ends an open window.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import torch

from lmpretrain.observe.host_transfers import HostTransfers

HISTORY_ENTRIES = 100_000  # allocation events kept in a CUDA memory snapshot (torch's example value)


def per_step_report(counts: dict[int, Counter]) -> dict:
    """{"per_step": {step: total}, "where": {source line: total over the steps}, most first}."""
    where = sum(counts.values(), Counter())
    return {"per_step": {n: sum(c.values()) for n, c in counts.items()}, "where": dict(where.most_common())}


class StepProfiler:
    def __init__(self, steps: list[int] | None, folder: Path, device: torch.device, rank: int, say=print):
        self.window = tuple(steps) if steps else None
        self.folder, self.device, self.rank, self.say = Path(folder), device, rank, say
        self.cuda = device.type == "cuda"
        self._profile = None
        self._range = None
        self._step = None
        self._transfers: dict[int, Counter] = {}  # step -> source line -> blocking transfers (the probe's)
        self._syncs: dict[int, Counter] = {}  # the same from torch's CUDA sync debug mode
        self._probe = None
        self._warnings = None

    def __enter__(self) -> StepProfiler:
        if self.cuda:
            torch._C._cuda_attach_out_of_memory_observer(self._on_oom)
        return self

    def __exit__(self, *exc) -> None:
        if self._profile is not None:
            self._stop()

    def step(self, n: int) -> None:
        """Call before step `n` runs: opens the window at its start, ends it after its last step."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.window is None:
            return
        start, end = self.window
        if n == start:
            self._start()
        elif n == end + 1 and self._profile is not None:
            self._stop()
        if self._profile is not None:
            self._step = n
            self._syncs[n] = Counter()
            self._probe.counts = self._transfers[n] = Counter()
            self._range = torch.profiler.record_function(f"train step {n}")
            self._range.__enter__()

    def _name(self, kind: str, ext: str) -> Path:
        start, end = self.window
        return self.folder / f"{kind}-rank{self.rank}-steps{start}-{end}.{ext}"

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
            self._count_syncs()
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profile.__enter__()
        self._probe = HostTransfers(self.device)
        self._probe.__enter__()

    def _stop(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self._probe.__exit__(None, None, None)
        self._profile.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self._name("trace", "json")
        self._profile.export_chrome_trace(str(trace))
        self._profile = None
        written = [trace]
        if self.cuda:
            written.append(self._name("memory", "pickle"))
            torch.cuda.memory._dump_snapshot(str(written[-1]))
            torch.cuda.memory._record_memory_history(enabled=None)
        written.append(self._write_syncs())
        self.say(f"profile of steps {self.window[0]}-{self.window[1]}: {', '.join(map(str, written))}")

    def _count_syncs(self) -> None:
        """torch warns at each synchronizing CUDA operation; count them per step, by source line."""
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always", UserWarning)
        shown = warnings.showwarning

        def count(message, category, filename, lineno, *args, **kwargs):
            if "synchronizing CUDA operation" in str(message) and self._step is not None:
                self._syncs[self._step][f"{filename}:{lineno}"] += 1
            else:
                shown(message, category, filename, lineno, *args, **kwargs)

        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")

    def _write_syncs(self) -> Path:
        report = per_step_report(self._transfers)
        line = f"blocking host<->device transfers per step {report['per_step']}; where: {dict(list(report['where'].items())[:5])}"
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(None, None, None)
            cuda = per_step_report(self._syncs)
            report |= {"cuda_syncs_per_step": cuda["per_step"], "cuda_syncs_where": cuda["where"]}
            line += f"; torch's CUDA synchronizations per step {cuda['per_step']}"
        path = self._name("syncs", "json")
        path.write_text(json.dumps(report, indent=1))
        self.say(line)
        return path

    def _on_oom(self, device, alloc, device_alloc, device_free) -> None:
        """torch calls this when the CUDA allocator gives up, before it raises OutOfMemoryError."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"oom-rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        print(
            f"[lmpretrain] CUDA out of memory on device {device} asking for {alloc / 2**20:.0f} MiB "
            f"({device_free / 2**20:.0f} MiB free): allocator snapshot in {path}",
            flush=True,
        )
