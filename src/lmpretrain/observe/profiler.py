"""What a run's steps spend their time and memory on: train.profile_steps and CUDA out-of-memory snapshots.

With train.profile_steps=[start, end], steps start..end run under torch.profiler and each rank writes
`<output_dir>/profile/trace-rank<R>-steps<start>-<end>.json` (Chrome trace format: open it in Perfetto,
https://ui.perfetto.dev, or chrome://tracing), each step a "train step N" range holding its ops; on CUDA
also `memory-rank<R>-steps<start>-<end>.pickle`, the allocator's history over those steps (drag it onto
https://pytorch.org/memory_viz), and `syncs-rank<R>-steps<start>-<end>.json`: the blocking device->host
reads of each step and where they happen (torch.cuda.set_sync_debug_mode). On CUDA, whatever the setting, an out-of-memory error writes
`oom-rank<R>.pickle` (the allocator's segments and blocks at that moment) before the error propagates.
The loop calls `profiler.step(n)` once, before step n; leaving the `with` block ends an open window.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import torch

HISTORY_ENTRIES = 100_000  # allocation events kept in a CUDA memory snapshot (torch's example value)


class StepProfiler:
    def __init__(self, steps: list[int] | None, folder: Path, device: torch.device, rank: int, say=print):
        self.window = tuple(steps) if steps else None
        self.folder, self.device, self.rank, self.say = Path(folder), device, rank, say
        self.cuda = device.type == "cuda"
        self._profile = None
        self._range = None
        self._step = None
        self._syncs: dict[int, Counter] = {}
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

    def _stop(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
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
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(None, None, None)
        per_step = {n: sum(c.values()) for n, c in self._syncs.items()}
        where = sum(self._syncs.values(), Counter())
        path = self._name("syncs", "json")
        path.write_text(json.dumps({"per_step": per_step, "where": dict(where.most_common())}, indent=1))
        self.say(f"blocking device->host reads per step {per_step}; where: {dict(where.most_common(5))}")
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
