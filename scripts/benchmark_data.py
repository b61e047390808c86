"""Measure the data pipeline: throughput, restore cost, memory and mixing.

    python scripts/benchmark_data.py                       # everything below (each in its own subprocess)
    python scripts/benchmark_data.py big-restore rss       # some of it: throughput restore big-restore rss mixing
                                                           #   tokens tokens-rss prepare shards
    python scripts/benchmark_data.py mixing --rows rows.npy --corpus DIR --tokenizer DIR   # rows saved elsewhere

* throughput: tokens/s of the default corpus' stream (seq_len 256, 8 streams, 16 blocks per step), 0 and 2 workers.
* restore:    the default stream after --restore-steps steps: reached by iteration vs restored from its state.
* big-restore: restore time (new stream + load_state_dict + first step) at the start and at the end of a
  generated >= 1 GB JSON Lines file and a >= 1 GB parquet file (no compression, 20,000-row ~60 MB row groups);
  one stream owns the whole file. The end position is the start state moved to a record 98% into the file
  (a line start / a row of the last row group but one); the restored stream is checked to resume exactly.
* rss:        peak RSS of the recipe (smoke model, 8 streams, --rss-steps steps) on a generated 220 MB single
  text file and on a 10x smaller one, and of the loader alone on each.
* tokens:     tokens/s one data worker delivers (num_workers=1; and in the trainer's process, num_workers=0),
  the default corpus as text tokenized on the fly (windows shuffle) vs as token files (global shuffle),
  written to the workdir by scripts/prepare_data.py if absent.
* tokens-rss: peak RSS of the loader alone over those token files (global shuffle, --token-rss-steps steps)
  and over the same shards listed 10 times (a 10x corpus): flat in corpus size.
* prepare:    tokens/s of scripts/prepare_data.py (the datatrove pipeline) on --prepare-shards train shards of
  the default corpus with 1 and 2 tasks; with --baseline CHECKOUT, that checkout's writer with --processes 1
  and 2 too, one after the other in this command (e.g. --baseline /path/to/an/older/lmpretrain).
* shards:     the same token stream as the default corpus' token files (32 shards) and re-cut into 2,000 shards:
  one data worker's tokens/s (num_workers=1, 256 blocks per step) and the loader's peak RSS on each (the
  2,000 shards open at most data.max_open_files descriptors per process, and no document index is cached).
* mixing:     the mixing statistics of the default recipe's first --mixing-steps steps. Each block's source
  files are found by matching its complete lines (>= 40 characters, unique in the corpus) to the file they
  occur in; then: distinct files per step, and the drift of the data with training: the Spearman correlation
  between the step and the alphabetical rank of the files it reads (0 for i.i.d. data; a path-ordered corpus
  read in order gives a curriculum: positive), and their mean rank (0.5 for i.i.d.).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, STREAMS, BLOCKS = 256, 8, 16
WORDS = (
    "def return self class import for while if else None True False lambda yield with as try except".split()
)


def _stream(sources=None, workers=0, streams=STREAMS, blocks=BLOCKS):
    from lmpretrain.config import DataConfig
    from lmpretrain.data import SourceSpec, TrainStream
    from lmpretrain.data.tokenizer import load_tokenizer

    data = DataConfig(seq_len=SEQ_LEN, num_streams=streams, num_workers=workers)
    if sources:
        data.train = [SourceSpec(**s) for s in sources]
    tok = load_tokenizer("builtin:python-stdlib")
    return TrainStream(data, tok, blocks_per_step=blocks, rank=0, world_size=1, seed=0)


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _steps_per_s(ts, steps: int) -> float:
    """Steps a second `ts` delivers after 10 warm-up steps (worker start, first windows); closes it."""
    it = iter(ts)
    for _ in range(10):
        next(it)
    start = time.perf_counter()
    for _ in range(steps):
        next(it)
    elapsed = time.perf_counter() - start
    ts.close()
    return steps / elapsed


def child_throughput(workers: int, steps: int) -> dict:
    rate = _steps_per_s(_stream(workers=workers), steps)
    return {"workers": workers, "steps": steps, "tokens_per_s": rate * BLOCKS * SEQ_LEN}


def _restore(sources, state, streams=STREAMS) -> tuple[float, object, object]:
    """(seconds to build a stream, load `state` and produce one step; that step; the stream)."""
    start = time.perf_counter()
    ts = _stream(sources, streams=streams)
    ts.load_state_dict(state)
    it = iter(ts)
    step = next(it)
    return time.perf_counter() - start, step, (ts, it)


def child_restore(steps: int) -> dict:
    start = time.perf_counter()
    ts = _stream()
    it = iter(ts)
    for _ in range(steps):
        next(it)
    state = ts.state_dict()
    want = next(it).input_ids
    by_iteration = time.perf_counter() - start
    restore, got, (fresh, _) = _restore(None, state)
    assert (got.input_ids == want).all(), "restored step differs"
    return {
        "steps": steps,
        "reach_by_iteration_s": by_iteration,
        "restore_s": restore,
        "records_read_restore": fresh.records_read(),
        "records_read_iteration": ts.records_read(),
    }


def _deep_position(path: str, kind: str) -> list[int]:
    """A record start 98% into the file: a line start (JSON Lines) or row 5000 of the last row group but one."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        return [pq.ParquetFile(path).metadata.num_row_groups - 2, 5000]
    with open(path, "rb") as f:
        f.seek(int(os.path.getsize(path) * 0.98))
        f.readline()
        return [f.tell()]


def child_big_restore(path: str, kind: str) -> dict:
    sources = [{"files": [path]}]
    ts = _stream(sources, streams=1)
    it = iter(ts)
    for _ in range(2):
        next(it)
    start_state = ts.state_dict()
    want = next(it).input_ids
    t_start, got, _ = _restore(sources, start_state, streams=1)
    assert (got.input_ids == want).all()
    end_state = copy.deepcopy(start_state)
    stream = end_state["streams"][0]
    position = stream["docs"]["start"]["sources"][0]
    stream.update(window=0, emitted=0)
    stream["docs"] = {
        "start": {
            "mix": 0,
            "open": -1,
            "sources": [{**position, "at": _deep_position(path, kind), "segment": 0}],
        },
        "window": 0,
        "unit": 0,
        "offset": 0,
    }
    t_end, _, (deep, deep_it) = _restore(sources, end_state, streams=1)
    for _ in range(3):
        next(deep_it)
    later = deep.state_dict()
    want = next(deep_it).input_ids
    t_later, got, _ = _restore(sources, later, streams=1)
    return {
        "file": path,
        "gb": os.path.getsize(path) / 1e9,
        "restore_start_s": t_start,
        "restore_end_s": t_end,
        "restore_end_plus_3_steps_s": t_later,
        "exact_at_end": bool((got.input_ids == want).all()),
    }


def child_token_throughput(folder: str, workers: int, steps: int, blocks: int) -> dict:
    """tokens/s of a stream over the default corpus: as text (folder "") or as the token files in `folder`."""
    ts = _stream([{"files": [folder]}] if folder else None, workers=workers, blocks=blocks)
    rate = _steps_per_s(ts, steps)
    return {"steps": steps, "shuffle": ts.shuffle, "tokens_per_s": rate * blocks * SEQ_LEN}


def child_token_rss(folder: str, steps: int) -> dict:
    ts = _stream([{"files": [folder]}])
    it = iter(ts)
    for _ in range(steps):
        next(it)
    files = ts.sources[0].token_files
    return {"tokens": files.tokens, "bytes": files.tokens * files.dtype.itemsize, "peak_rss_mb": _maxrss_mb()}


def stdlib_token_files(work: Path) -> Path:
    """The default corpus as token files (prepared once into the workdir)."""
    out = work / "stdlib-tokens"
    if not out.exists():
        script = ROOT / "scripts" / "prepare_data.py"
        subprocess.run(
            [sys.executable, str(script), "--builtin", "python-stdlib", "--out", str(out)], check=True
        )
    return out


def repeated_token_files(folder: Path, times: int, out: Path) -> Path:
    """Token files holding `folder`'s shards `times` over (copies): a corpus `times` the size."""
    import shutil

    from lmpretrain.data.token_layouts import HEADER

    if (out / HEADER).exists():
        return out
    header = json.loads((folder / HEADER).read_text())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = []
    for r in range(times):
        for shard in header["shards"]:
            name = f"r{r}-{shard['name']}"
            for ext in (".bin", ".idx"):
                shutil.copyfile(folder / f"{shard['name']}{ext}", tmp / f"{name}{ext}")
            shards.append({**shard, "name": name})
    totals = {k: header[k] * times for k in ("tokens", "documents", "skipped")}
    (tmp / HEADER).write_text(json.dumps({**header, **totals, "shards": shards}))
    tmp.rename(out)
    return out


def prepare_rate(checkout: Path, corpus: Path, out: Path, parallel: list[str]) -> dict:
    """Tokens/s of `checkout`'s scripts/prepare_data.py on `corpus` (wall time of the whole command)."""
    import shutil

    from lmpretrain.data.token_layouts import HEADER

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(checkout / "scripts" / "prepare_data.py"), "--files", str(corpus)]
    cmd += ["--tokenizer", "builtin:python-stdlib", "--out", str(out), *parallel]
    env = {**os.environ, "PYTHONPATH": str(checkout / "src"), "CI": "true", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    tokens = json.loads((out / HEADER).read_text())["tokens"]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def resharded_token_files(folder: Path, shards: int, out: Path) -> Path:
    """`folder`'s token stream cut into `shards` shards: its first document, then equal lengths (a shard may
    start inside a document: its index then lists a document start at 0), for reading benchmarks of the
    global shuffle."""
    import numpy as np

    from lmpretrain.data.token_layouts import HEADER

    if (out / HEADER).exists():
        return out
    header = json.loads((folder / HEADER).read_text())
    names = [s["name"] for s in header["shards"]]
    stream = np.concatenate([np.fromfile(folder / f"{n}.bin", dtype=header["dtype"]) for n in names])
    lengths = [s["tokens"] for s in header["shards"]]
    offsets = np.cumsum([0, *lengths[:-1]])
    starts = np.concatenate(
        [
            np.fromfile(folder / f"{n}.idx", dtype="<u8")[:-1].astype(np.int64) + o
            for n, o in zip(names, offsets, strict=True)
        ]
    )
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # The first shard is the first document (its framing is what opening the source checks), the rest equal cuts.
    rest = len(stream) - int(starts[1])
    bounds = [0, *(int(starts[1]) + rest * k // (shards - 1) for k in range(shards))]
    entries = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        name = f"shard-{k:05d}"
        stream[a:b].tofile(tmp / f"{name}.bin")
        inside = starts[(starts > a) & (starts < b)] - a
        idx = np.concatenate([[0], inside, [b - a]]).astype("<u8")
        idx.tofile(tmp / f"{name}.idx")
        entries.append({"name": name, "tokens": int(b - a), "documents": len(idx) - 1})
    documents = sum(e["documents"] for e in entries)
    (tmp / HEADER).write_text(json.dumps({**header, "documents": documents, "shards": entries}))
    tmp.rename(out)
    return out


def child_loader_rss(path: str, steps: int) -> dict:
    ts = _stream([{"files": [path]}])
    it = iter(ts)
    for _ in range(steps):
        next(it)
    return {"file": path, "steps": steps, "peak_rss_mb": _maxrss_mb()}


def run_child(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- generated corpora -----------------------------------------------------------------------------------------


def _lines(rng: random.Random, n: int, prefix: str) -> list[str]:
    return [f"{prefix}{i} = {' '.join(rng.choices(WORDS, k=rng.randint(3, 14)))}\n" for i in range(n)]


def make_text(path: Path, mib: int) -> Path:
    """A text file of `mib` MiB: 8 distinct 1 MiB blocks of Python-like lines in a seeded order."""
    if path.exists() and path.stat().st_size >= mib << 20:
        return path
    rng = random.Random(0)
    blocks = []
    for b in range(8):
        lines, size = [], 0
        while size < 1 << 20:
            lines += _lines(rng, 100, f"    x{b}_{len(lines)}_")
            size = sum(map(len, lines))
        blocks.append("".join(lines).encode())
    with open(path, "wb") as f:
        for i in range(mib):
            f.write(f"# block {i}\n".encode() + blocks[rng.randrange(8)])
    return path


def _records(n: int):
    rng = random.Random(1)
    texts = ["".join(_lines(rng, 40, f"    v{k}_")) for k in range(256)]  # ~3 KB each
    for i in range(n):
        yield f"# record {i}\n" + texts[rng.randrange(256)]


def make_jsonl(path: Path, gb: float) -> Path:
    if path.exists() and path.stat().st_size >= gb * 1e9:
        return path
    with open(path, "w", encoding="utf-8") as f:
        size = 0
        for text in _records(10**9):
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)
            if size >= gb * 1e9:
                break
    return path


def make_parquet(path: Path, gb: float) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.exists() and path.stat().st_size >= gb * 1e9:
        return path
    records = _records(10**9)
    with pq.ParquetWriter(
        path, pa.schema([("text", pa.string())]), compression="none", use_dictionary=False
    ) as w:
        while path.stat().st_size < gb * 1e9:
            w.write_table(pa.table({"text": [next(records) for _ in range(20_000)]}), row_group_size=20_000)
    return path


# ---- the recipe's peak RSS on a big single file ------------------------------------------------------------------


def recipe_peak_rss(path: Path, steps: int) -> dict:
    """Peak RSS of the real recipe (smoke model, 8 streams) training on one text file; benchmark.py runs it."""
    from benchmark import recipe  # scripts/benchmark.py, next to this file

    overrides = [f"--data.train=[{{files: [{path}]}}]", "--data.num_streams=8", "--eval.batches=1"]
    overrides.append("--logging.wandb_mode=disabled")
    result = recipe(str(ROOT / "configs/smoke.yaml"), overrides, switches={}, steps=steps, warmup=2)
    return {"peak_rss_mb": result["peak_rss_bytes"] / 2**20, "overrides": " ".join(overrides)}


# ---- mixing ----------------------------------------------------------------------------------------------------


def line_index(files: list[Path]) -> dict[str, str]:
    """Stripped lines of >= 40 characters that occur in exactly one document -> that document's path."""
    where: dict[str, str | None] = {}
    for f in files:
        for record in map(json.loads, open(f, encoding="utf-8")):
            for line in {s.strip() for s in record["text"].splitlines()}:
                if len(line) >= 40:
                    where[line] = (
                        None if where.get(line, record["path"]) != record["path"] else record["path"]
                    )
    return {line: path for line, path in where.items() if path}


def spearman(x, y) -> float:
    """Rank correlation (ties get their average rank)."""
    import numpy as np

    def ranks(v):
        v = np.asarray(v, dtype=float)
        r = np.empty(len(v))
        r[np.argsort(v, kind="stable")] = np.arange(len(v))
        _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
        return (np.bincount(inverse, weights=r) / counts)[inverse]

    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def mixing(rows, tokenizer, files: list[Path]) -> dict:
    """Per step: distinct files among the documents its blocks' lines identify; over the steps: how the
    alphabetical rank (path order, 0..1) of each file drifts with the step it first appears at (Spearman
    correlation; 0 for i.i.d. data), and the files' mean rank (0.5 for i.i.d.)."""
    index = line_index(files)
    order = {p: i / (len(set(index.values())) - 1) for i, p in enumerate(sorted(set(index.values())))}
    per_step_files, first_seen, found = [], {}, 0
    for t, step in enumerate(rows):
        paths = set()
        for block in step:
            lines = tokenizer.decode(block, skip_special_tokens=True).split("\n")[1:-1]  # complete lines only
            hits = {index[s.strip()] for s in lines if s.strip() in index}
            found += bool(hits)
            paths |= hits
        per_step_files.append(len(paths))
        for p in paths:
            first_seen.setdefault(p, t)
    steps, ranks = zip(*((t, order[p]) for p, t in first_seen.items()), strict=True)  # each file once
    return {
        "steps": len(rows),
        "files": len(first_seen),
        "blocks_identified": found / (len(rows) * len(rows[0])),
        "distinct_files_per_step": statistics.mean(per_step_files),
        "mean_path_rank": statistics.mean(ranks),
        "step_rank_correlation": spearman(steps, ranks),
    }


def child_mixing(steps: int) -> dict:
    """Rows of the default recipe's data (configs/default.yaml: seed 1337, 16 blocks of 256, 8 streams)."""
    import numpy as np

    from lmpretrain.config import load_config
    from lmpretrain.data import TrainStream
    from lmpretrain.data.corpus import ensure_stdlib_corpus
    from lmpretrain.data.tokenizer import load_tokenizer

    cfg = load_config([str(ROOT / "configs/default.yaml")])
    tok = load_tokenizer(cfg.data.tokenizer)
    ts = TrainStream(
        cfg.data, tok, blocks_per_step=cfg.global_batch(1), rank=0, world_size=1, seed=cfg.run.seed
    )
    it = iter(ts)
    rows = np.stack([next(it).input_ids.numpy() for _ in range(steps)])
    return mixing(rows, tok, sorted(ensure_stdlib_corpus().glob("train-*.jsonl")))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", nargs="*", default=["throughput", "restore", "big-restore", "rss", "mixing"])
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "lmpretrain-bench"))
    parser.add_argument("--throughput-steps", type=int, default=400)
    parser.add_argument("--restore-steps", type=int, default=2000)
    parser.add_argument("--rss-steps", type=int, default=60)
    parser.add_argument("--mixing-steps", type=int, default=200)
    parser.add_argument("--token-steps", type=int, default=2000, help="tokens: steps timed on token files")
    parser.add_argument("--token-rss-steps", type=int, default=5000)
    parser.add_argument("--prepare-shards", type=int, default=8, help="prepare: train shards of the corpus")
    parser.add_argument(
        "--baseline", help="prepare: also time this checkout's writer (one before datatrove: --processes)"
    )
    parser.add_argument(
        "--rows", help="mixing: a .npy [steps, blocks, seq_len] of rows saved by another version"
    )
    parser.add_argument("--corpus", help="mixing with --rows: the corpus folder they came from")
    parser.add_argument("--tokenizer", help="mixing with --rows: the tokenizer folder that encoded them")
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        result = {
            "throughput": lambda: child_throughput(int(rest[0]), int(rest[1])),
            "restore": lambda: child_restore(int(rest[0])),
            "big-restore": lambda: child_big_restore(rest[0], rest[1]),
            "loader-rss": lambda: child_loader_rss(rest[0], int(rest[1])),
            "mixing": lambda: child_mixing(int(rest[0])),
            "token-throughput": lambda: child_token_throughput(rest[0], *map(int, rest[1:])),
            "token-rss": lambda: child_token_rss(rest[0], int(rest[1])),
        }[kind]()
        print(json.dumps(result))
        return

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"settings: seq_len {SEQ_LEN}, {BLOCKS} blocks per step, builtin tokenizer; files in {work}")
    if "throughput" in args.what:
        for workers in (0, 2):
            r = run_child("throughput", str(workers), str(args.throughput_steps))
            print(
                f"throughput, num_workers={workers}: {r['tokens_per_s']:,.0f} tokens/s over {r['steps']} steps"
            )
    if "restore" in args.what:
        r = run_child("restore", str(args.restore_steps))
        print(
            f"restore after {r['steps']} steps of the default corpus: reached by iteration in "
            f"{r['reach_by_iteration_s']:.2f}s ({r['records_read_iteration']} records read), restored in "
            f"{r['restore_s']:.2f}s ({r['records_read_restore']} records read)"
        )
    if "big-restore" in args.what:
        for path, kind in (
            (make_jsonl(work / "big.jsonl", 1.05), "jsonl"),
            (make_parquet(work / "big.parquet", 1.05), "parquet"),
        ):
            r = run_child("big-restore", str(path), kind)
            print(
                f"restore in a {r['gb']:.2f} GB {kind} file: at the start {r['restore_start_s']:.2f}s, at 98% "
                f"{r['restore_end_s']:.2f}s, 3 steps later {r['restore_end_plus_3_steps_s']:.2f}s "
                f"(exact: {r['exact_at_end']})"
            )
    if "rss" in args.what:
        big, small = make_text(work / "big.txt", 210), make_text(work / "small.txt", 21)
        for path in (big, small):
            loader = run_child("loader-rss", str(path), str(args.rss_steps))
            recipe = recipe_peak_rss(path, args.rss_steps)
            print(
                f"peak RSS, {path.stat().st_size / 1e6:,.0f} MB single text file, 8 streams, {args.rss_steps} steps: "
                f"recipe {recipe['peak_rss_mb']:,.0f} MB, loader alone {loader['peak_rss_mb']:,.0f} MB"
            )
        print(f"recipe: scripts/benchmark.py's run of configs/smoke.yaml {recipe['overrides']}")
    if "tokens" in args.what:
        folder = stdlib_token_files(work)
        runs = [("", args.throughput_steps, BLOCKS), (str(folder), args.token_steps, BLOCKS)]
        runs.append((str(folder), args.token_steps // 8, 256))  # a bigger batch: per-step costs amortised
        for workers in (1, 0):
            for source, steps, blocks in runs:
                r = run_child("token-throughput", source, str(workers), str(steps), str(blocks))
                what = "token files" if source else "text tokenized on the fly"
                print(
                    f"one data worker (num_workers={workers}), {what} (shuffle {r['shuffle']}), {blocks} blocks "
                    f"per step: {r['tokens_per_s']:,.0f} tokens/s over {r['steps']} steps"
                )
    if "tokens-rss" in args.what:
        one = stdlib_token_files(work)
        ten = repeated_token_files(one, 10, work / "stdlib-tokens-x10")
        peaks = []
        for folder in (one, ten):
            r = run_child("token-rss", str(folder), str(args.token_rss_steps))
            peaks.append(r["peak_rss_mb"])
            print(
                f"peak RSS of the loader, token files of {r['tokens']:,} tokens ({r['bytes'] / 1e6:,.0f} MB), "
                f"{args.token_rss_steps} steps of {BLOCKS} x {SEQ_LEN} tokens, global shuffle: {r['peak_rss_mb']:,.0f} MB"
            )
        print(f"10x corpus / 1x corpus peak RSS: {peaks[1] / peaks[0]:.3f}")
    if "prepare" in args.what:
        import shutil

        from lmpretrain.data.corpus import stdlib_split_files

        corpus = work / "prepare-corpus"
        corpus.mkdir(exist_ok=True)
        for f in stdlib_split_files("train")[: args.prepare_shards]:
            shutil.copyfile(f, corpus / Path(f).name)
        runs = [(ROOT, "datatrove", n, ["--tasks", str(n), "--workers", str(n)]) for n in (1, 2)]
        if args.baseline:
            runs += [(Path(args.baseline), "baseline", n, ["--processes", str(n)]) for n in (1, 2)]
        rates = {}
        for checkout, name, n, flags in sorted(runs, key=lambda r: r[2]):
            r = prepare_rate(checkout, corpus, work / f"prepare-{name}-{n}", flags)
            rates[name, n] = r["tokens_per_s"]
            print(
                f"prepare, {name} ({checkout}), {n} process{'es' * (n > 1)}: {r['tokens']:,} tokens in "
                f"{r['seconds']:.1f}s = {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s'] / n:,.0f} per process)"
            )
        for n in (1, 2) if args.baseline else ():
            print(
                f"datatrove / baseline, {n} process{'es' * (n > 1)}: {rates['datatrove', n] / rates['baseline', n]:.2f}"
            )
    if "shards" in args.what:
        one = stdlib_token_files(work)
        many = resharded_token_files(one, 2000, work / "stdlib-tokens-2000-shards")
        rates, peaks, counts = [], [], []
        for folder in (one, many):
            n = len(json.loads((folder / "tokens.json").read_text())["shards"])
            counts.append(n)
            r = run_child("token-throughput", str(folder), "1", str(args.token_steps // 8), "256")
            m = run_child("token-rss", str(folder), str(args.token_rss_steps))
            rates.append(r["tokens_per_s"])
            peaks.append(m["peak_rss_mb"])
            print(
                f"{n} shards, {m['tokens']:,} tokens: one data worker (num_workers=1), 256 blocks per step: "
                f"{r['tokens_per_s']:,.0f} tokens/s over {r['steps']} steps; loader peak RSS "
                f"({args.token_rss_steps} steps of {BLOCKS} blocks) {m['peak_rss_mb']:,.0f} MB"
            )
        print(
            f"{counts[1]} / {counts[0]} shards: tokens/s {rates[1] / rates[0]:.3f}, peak RSS {peaks[1] / peaks[0]:.3f}"
        )
    if "mixing" in args.what:
        if args.rows:
            import numpy as np
            from transformers import AutoTokenizer

            r = mixing(
                np.load(args.rows),
                AutoTokenizer.from_pretrained(args.tokenizer),
                sorted(Path(args.corpus).glob("train-*.jsonl")),
            )
        else:
            r = run_child("mixing", str(args.mixing_steps))
        print(
            f"mixing over {r['steps']} steps of 16 blocks ({r['blocks_identified']:.0%} of blocks identified): "
            f"{r['distinct_files_per_step']:.1f} distinct files per step; the {r['files']} files' path rank: mean "
            f"{r['mean_path_rank']:.2f} (0.50 for i.i.d.), Spearman correlation with the step "
            f"{r['step_rank_correlation']:+.2f} (0 for i.i.d.)"
        )


if __name__ == "__main__":
    main()
