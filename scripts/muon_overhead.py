#!/usr/bin/env python
"""Muon's training-step time over AdamW's, side by side in one process.

    python scripts/muon_overhead.py configs/default.yaml [--shape chars|config] [--steps 20] [--warmup 3]
                                    [--threads 1] [--section.field=value ...]

Three copies of the model (same init) train, with optim.name=adamw, muon and normuon (the rest of the
config as given), alternating step by step (A B C A B C ...) so that a loaded machine slows them alike. A step is the recipe's work minus data loading: grad_accum_steps forwards and backwards of
micro_batch_size random token rows (the step's time does not depend on the tokens), clipping, the
optimizer step, zero_grad. Prints each optimizer's median step and optimizer-step-only time and the
ratios of the medians, on the wall clock and on the CPU clock (time.process_time: what a step costs,
whoever else has the cores; with --threads 1 the two agree on a quiet machine). `--shape chars` is make benchmark's small-vocabulary shape: GPT-2 4 layers x 4
heads x 128 wide, 64-token blocks, 12 rows a step, the 65-symbol character tokenizer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402  (make benchmark's shapes)

from lmpretrain.config import load_config  # noqa: E402
from lmpretrain.data.tokenizer import load_tokenizer  # noqa: E402
from lmpretrain.model.build import build_model, build_model_config  # noqa: E402
from lmpretrain.update.optim import build_optimizer, describe_implementation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--shape", choices=["chars", "config"], default="config")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.config
        if args.shape == "chars":
            path = benchmark.gpt2_shape(
                path, Path(tmp), benchmark.CHARS, len(load_tokenizer(benchmark.CHARS))
            )
        runs = {}
        for name in ("adamw", "muon", "normuon"):
            cfg = load_config([path, *overrides, f"--optim.name={name}"])
            torch.manual_seed(0)
            model = build_model(
                build_model_config(cfg.model, load_tokenizer(cfg.data.tokenizer)), None, "float32"
            )
            opt = build_optimizer(model, cfg.optim)
            runs[name] = (cfg, model, opt)
            print(f"{name}: {describe_implementation(opt, cfg.optim, torch.device('cpu'))}")
    cfg = runs["adamw"][0]
    vocab = runs["adamw"][1].config.vocab_size
    shape = (cfg.train.micro_batch_size, cfg.data.seq_len)
    print(
        f"shape: {type(runs['adamw'][1]).__name__}, {cfg.train.grad_accum_steps} x {shape} tokens a step, "
        f"vocab {vocab}, {args.threads} thread(s)"
    )
    clocks = {"wall": time.perf_counter, "CPU": time.process_time}
    step_t = {(c, n): [] for c in clocks for n in runs}
    opt_t = {(c, n): [] for c in clocks for n in runs}
    gen = torch.Generator().manual_seed(1)
    for i in range(args.warmup + args.steps):
        batches = [torch.randint(0, vocab, shape, generator=gen) for _ in range(cfg.train.grad_accum_steps)]
        for name, (run_cfg, model, opt) in runs.items():
            start = {c: clock() for c, clock in clocks.items()}
            for ids in batches:
                model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), run_cfg.train.max_grad_norm)
            mid = {c: clock() for c, clock in clocks.items()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            end = {c: clock() for c, clock in clocks.items()}
            if i >= args.warmup:
                for c in clocks:
                    step_t[c, name].append(end[c] - start[c])
                    opt_t[c, name].append(end[c] - mid[c])
    med = {k: statistics.median(v) for k, v in step_t.items()}
    med_opt = {k: statistics.median(v) for k, v in opt_t.items()}
    for c in clocks:
        for n in runs:
            print(
                f"{n} ({c} clock): step median {med[c, n] * 1e3:.1f} ms, optimizer step median "
                f"{med_opt[c, n] * 1e3:.1f} ms"
            )
        for n in ("muon", "normuon"):
            print(
                f"{n} / adamw step time ({c} clock, ratio of medians, {args.steps} interleaved steps each): "
                f"{med[c, n] / med[c, 'adamw']:.3f}x; optimizer step alone: "
                f"{med_opt[c, n] / med_opt[c, 'adamw']:.2f}x"
            )


if __name__ == "__main__":
    main()
