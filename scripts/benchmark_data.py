"""Measure the data pipeline on the default corpus: throughput, deep restore vs iteration, peak RSS vs corpus size.

    python scripts/benchmark_data.py            # each measurement runs in its own subprocess (clean RSS)

Settings follow the default config: seq_len 256, 8 streams, 16 rows per step, shuffle window 64.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ_LEN, STREAMS, ROWS = 256, 8, 16


def _stream(files=None, workers=0):
    from lmpretrain.data import SourceSpec, TrainStream
    from lmpretrain.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:python-stdlib")
    src = [SourceSpec(files=files)] if files else [SourceSpec(name="python-stdlib")]
    return TrainStream(
        src,
        tok,
        seq_len=SEQ_LEN,
        num_streams=STREAMS,
        rows_per_step=ROWS,
        rank=0,
        world_size=1,
        num_workers=workers,
        seed=0,
    )


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_throughput(workers: int, steps: int) -> dict:
    ts = _stream(workers=workers)
    it = iter(ts)
    for _ in range(10):  # warm-up: worker start, first windows
        next(it)
    start = time.perf_counter()
    for _ in range(steps):
        next(it)
    elapsed = time.perf_counter() - start
    ts.close()
    return {"workers": workers, "steps": steps, "tokens_per_s": steps * ROWS * SEQ_LEN / elapsed}


def child_restore(steps: int) -> dict:
    start = time.perf_counter()
    ts = _stream()
    it = iter(ts)
    for _ in range(steps):
        next(it)
    state = ts.state_dict()
    want = next(it).input_ids
    by_iteration = time.perf_counter() - start
    start = time.perf_counter()
    fresh = _stream()
    fresh.load_state_dict(state)
    got = next(iter(fresh)).input_ids
    restore = time.perf_counter() - start
    assert (got == want).all(), "restored step differs"
    return {
        "steps": steps,
        "reach_by_iteration_s": by_iteration,
        "restore_s": restore,
        "identical": True,
        "records_read_restore": fresh.records_read(),
        "records_read_iteration": ts.records_read(),
    }


def child_rss(files: str, steps: int) -> dict:
    ts = _stream(files=[files])
    it = iter(ts)
    next(it)
    after_first = _maxrss_mb()
    for _ in range(steps):
        next(it)
    return {
        "files": files,
        "steps": steps,
        "rss_after_first_step_mb": after_first,
        "peak_rss_mb": _maxrss_mb(),
    }


def run_child(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"child {args} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_big_corpus(folder: Path, factor: int) -> str:
    """`factor` x the train split: `factor` copies of each of its 32 shards (32 * factor files of ~1 MB)."""
    from lmpretrain.corpus import ensure_stdlib_corpus

    folder.mkdir(parents=True, exist_ok=True)
    for shard in sorted(ensure_stdlib_corpus().glob("train-*.jsonl")):
        for copy in range(factor):
            shutil.copyfile(shard, folder / f"copy{copy:02d}-{shard.name}")
    return str(folder / "*.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--throughput-steps", type=int, default=400)
    parser.add_argument("--restore-steps", type=int, default=2000)
    parser.add_argument(
        "--rss-steps", type=int, default=4400, help="steps of 4096 tokens (4400 ~ two 1x epochs)"
    )
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        result = {
            "throughput": lambda: child_throughput(int(rest[0]), int(rest[1])),
            "restore": lambda: child_restore(int(rest[0])),
            "rss": lambda: child_rss(rest[0], int(rest[1])),
        }[kind]()
        print(json.dumps(result))
        return

    from lmpretrain.corpus import ensure_stdlib_corpus
    from lmpretrain.tokenizer import ensure_builtin_tokenizer

    ensure_stdlib_corpus()
    ensure_builtin_tokenizer()
    print(
        f"settings: seq_len {SEQ_LEN}, {STREAMS} streams, {ROWS} rows/step ({ROWS * SEQ_LEN} tokens/step), "
        "default corpus (python-stdlib train), builtin tokenizer, on-the-fly tokenization"
    )
    for workers in (0, 2):
        r = run_child("throughput", str(workers), str(args.throughput_steps))
        print(
            f"(a) throughput, num_workers={workers}: {r['tokens_per_s']:,.0f} tokens/s over {r['steps']} steps"
        )
    r = run_child("restore", str(args.restore_steps))
    print(
        f"(b) position after {r['steps']} steps: reached by iteration in {r['reach_by_iteration_s']:.2f}s "
        f"({r['records_read_iteration']} records read); restored (new stream + load + first step) in "
        f"{r['restore_s']:.2f}s ({r['records_read_restore']} records read); next step identical: {r['identical']}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="lmpretrain-bench-"))
    try:
        one = str(ensure_stdlib_corpus() / "train-*.jsonl")
        ten = make_big_corpus(tmp / "x10", 10)
        r1 = run_child("rss", one, str(args.rss_steps))
        r10 = run_child("rss", ten, str(args.rss_steps))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"(c) peak RSS over {args.rss_steps} steps ({args.rss_steps * ROWS * SEQ_LEN / 1e6:.1f}M tokens): "
        f"1x corpus {r1['peak_rss_mb']:.0f} MB (after first step {r1['rss_after_first_step_mb']:.0f} MB), "
        f"10x corpus {r10['peak_rss_mb']:.0f} MB (after first step {r10['rss_after_first_step_mb']:.0f} MB); "
        f"ratio {r10['peak_rss_mb'] / r1['peak_rss_mb']:.3f}"
    )


if __name__ == "__main__":
    main()
