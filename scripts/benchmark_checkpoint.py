#!/usr/bin/env python
"""What a checkpoint costs each rank: peak memory during the save (full vs sharded) and how long
training stalls (sync vs async), with the recipe's own Checkpointer on a sharded model.

    accelerate launch --config_file configs/accelerate/cpu-fsdp.yaml scripts/benchmark_checkpoint.py \\
        --format full|sharded [--async-save] [--hidden 768 --layers 8 --vocab 32000] [--json report.json] \
        [--load [--fresh]]

A Llama of the given shape (float32) is sharded with FSDP2 as the recipe does and takes one AdamW step,
so there are weights and moments to save; then it is saved ``--repeats`` times (fresh directories):
* memory: this process's resident set size sampled every millisecond from the call to the commit,
  minus its size just before: the extra memory the save needs on that rank. Only the first save is a
  clean figure (the allocator keeps and reuses what a save freed), hence one case per launch;
* stall: how long ``save()`` blocks the training loop; ``total``: until the checkpoint is committed.
  An async save is committed by ``poll()`` between the training steps that follow it, as in the recipe.
Rank 0 prints one row per save and rank; other processes on the machine make the times noisy.
``--load`` then loads the last save on every rank: the extra RSS at its peak and what stays after it (the
allocator trimmed). Into the live model and stepped optimizer (a rollback's case), or with ``--fresh``
into a newly built model and an optimizer without moments (a resume's case).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object

from lmpretrain.checkpoint.checkpointer import Checkpointer
from lmpretrain.config import ModelConfig, TrainConfig
from lmpretrain.model.build import build_model, build_model_config
from lmpretrain.run.runtime import exit_process, setup

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The highest resident set size seen by a 1 ms sampler while the block runs."""

    def __enter__(self):
        self.peak, self._running = rss(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while self._running:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()


def train_step(model, optimizer, batch) -> None:
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(accelerator, model, optimizer, batch, fmt: str, async_save: bool, out: Path) -> dict:
    ck = Checkpointer(out, accelerator, keep_last=1, format=fmt, async_save=async_save)
    accelerator.wait_for_everyone()
    before = rss()
    with PeakRSS() as peak:
        started = time.perf_counter()
        ck.save(1, model=model, optimizer=optimizer, states={})
        stall = time.perf_counter() - started
        steps = 0
        while async_save and ck.poll() is None:  # training goes on until the write is committed
            train_step(model, optimizer, batch)
            steps += 1
        total = time.perf_counter() - started
    ck.close()
    return {
        "format": fmt,
        "async": async_save,
        "rank": accelerator.process_index,
        "extra_rss_bytes": peak.peak - before,
        "stall_s": stall,
        "total_s": total,
        "steps_during_write": steps,
    }


def measure_load(accelerator, model, optimizer, out: Path) -> dict:
    """Extra resident memory of this rank while it loads the newest checkpoint in ``out``."""
    ck = Checkpointer(out, accelerator, keep_last=1)
    path = ck.resolve_resume("auto", overwrite=False)
    accelerator.wait_for_everyone()
    # glibc keeps what the saves freed and the load would reuse it unseen: hand it back first
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = rss()
    with PeakRSS() as peak:
        started = time.perf_counter()
        ck.load(path, model=model, optimizer=optimizer, states={})
        total = time.perf_counter() - started
    ck.close()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    kept = rss() - before
    return {
        "rank": accelerator.process_index,
        "extra_rss_bytes": peak.peak - before,
        "kept_rss_bytes": kept,
        "load_s": total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=("full", "sharded"), required=True)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load", action="store_true", help="then measure loading the last save")
    parser.add_argument("--fresh", action="store_true", help="load into a new model and optimizer (a resume)")
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args()
    accelerator, info = setup(TrainConfig(micro_batch_size=1, grad_accum_steps=1))
    overrides = {
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 8 // 3 // 64 * 64,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": args.hidden // 64,
        "vocab_size": args.vocab,
        "max_position_embeddings": 128,
    }

    def build():
        model = build_model(build_model_config(ModelConfig(type="llama", overrides=overrides)))
        return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    model, optimizer = build()
    batch = torch.randint(0, args.vocab, (1, 128))
    train_step(model, optimizer, batch)
    params = sum(p.numel() for p in model.parameters())
    state_bytes = 3 * 4 * params  # float32 weights + two AdamW moments
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-")) if accelerator.is_main_process else None
    root = Path(gather_object([str(root)])[0])
    rows = []
    for i in range(args.repeats):
        rows += gather_object(
            [measure(accelerator, model, optimizer, batch, args.format, args.async_save, root / str(i))]
        )
    if args.load and args.fresh:  # as at a resume: the weights of a new model, no moments yet
        del model, optimizer
        accelerator.free_memory()
        gc.collect()
        model, optimizer = build()
    loads = gather_object([measure_load(accelerator, model, optimizer, root / str(i))]) if args.load else []
    if accelerator.is_main_process:
        shutil.rmtree(root, ignore_errors=True)
        print(
            f"{info.describe()}; {params:,} parameters, {state_bytes / 2**20:,.0f} MiB of weights + moments"
        )
        print(
            f"{'format':>8} {'mode':>5} {'rank':>4} {'extra RSS MiB':>13} {'stall s':>8} {'total s':>8} {'steps':>5}"
        )
        for r in rows:
            print(
                f"{r['format']:>8} {'async' if r['async'] else 'sync':>5} {r['rank']:>4} "
                f"{r['extra_rss_bytes'] / 2**20:>13,.0f} {r['stall_s']:>8.2f} {r['total_s']:>8.2f} "
                f"{r['steps_during_write']:>5}"
            )
        for r in loads:
            print(
                f"load rank {r['rank']}{' (fresh)' if args.fresh else ''}: extra RSS {r['extra_rss_bytes'] / 2**20:,.0f} "
                f"MiB at the peak, {r['kept_rss_bytes'] / 2**20:,.0f} MiB kept, {r['load_s']:.2f} s"
            )
        if args.json:
            Path(args.json).write_text(json.dumps({"params": params, "rows": rows, "loads": loads}, indent=2))
    accelerator.end_training()


if __name__ == "__main__":
    main()
    exit_process(0)
