"""Tokenize a source once into token files (`format: tokens`) with a datatrove pipeline, for the global shuffle.

    python scripts/prepare_data.py --files 'corpus/**/*.jsonl' --tokenizer gpt2 --out data/corpus-tok
    python scripts/prepare_data.py --executor local --tasks 8 --workers 4 --files 'books/*.txt' \\
        --separator blank_lines --tokenizer gpt2 --out data/books-tok
    python scripts/prepare_data.py --executor slurm --partition cpu --tasks 512 --hub HuggingFaceFW/fineweb-edu \\
        --hub-config sample-10BT --tokenizer gpt2 --out /shared/fineweb-tok
    python scripts/prepare_data.py --files 'corpus/*.jsonl' --dedup exact --transform my_filters.py:keep_long \\
        --tokenizer gpt2 --out data/corpus-dedup-tok
    # then, in the config:  data.train: [{files: [data/corpus-tok]}]

Writes a folder of flat token arrays (uint16/uint32) and document indexes with a tokens.json header
(layout in docs/data.md); the folder appears only when complete, and the same bytes for any --tasks.
Every document is framed [BOS] ids EOS as the run will read it (--add-bos: as data.add_bos). --transform
applies data.transforms (pure functions) first and records them in the header; --dedup runs datatrove's
exact or minhash deduplication over the whole source before tokenizing and says how many documents it
removed (docs/data.md: offline dedup or a filter on the fly). Run the same command again after an
interruption: the tasks already done are skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lmpretrain.data import SourceSpec
from lmpretrain.data.prepare import DEDUP_METHODS, EXECUTORS, plan_prepare, run_prepare
from lmpretrain.data.tokenizer import load_tokenizer
from lmpretrain.data.transforms import load_transforms
from lmpretrain.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--files", action="append", help="file, glob or folder (repeatable)")
    src.add_argument("--builtin", help="a builtin dataset, e.g. python-stdlib")
    src.add_argument("--hub", help="a Hub dataset id")
    parser.add_argument("--hub-config")
    parser.add_argument("--split", default="train")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--format", choices=["text", "json", "parquet"])
    parser.add_argument(
        "--separator", help="text files: documents end at this string, or at blank lines with 'blank_lines'"
    )
    parser.add_argument(
        "--tokenizer", default="builtin:python-stdlib", help="local dir, Hub id or builtin:..."
    )
    parser.add_argument(
        "--add-bos",
        choices=["auto", "true", "false"],
        default="auto",
        help="BOS before each document, as data.add_bos (auto: when the tokenizer has a distinct BOS)",
    )
    parser.add_argument("--executor", choices=EXECUTORS, default="local", help="datatrove executor")
    parser.add_argument(
        "--tasks", type=int, default=os.cpu_count(), help="datatrove tasks (each takes whole files/pieces)"
    )
    parser.add_argument("--workers", type=int, default=-1, help="tasks running at once (-1: all)")
    cluster = parser.add_argument_group("slurm / ray")
    cluster.add_argument("--partition", help="slurm partition (required with --executor slurm)")
    cluster.add_argument("--time", default="24:00:00", help="slurm time limit per task")
    cluster.add_argument("--cpus-per-task", type=int, default=1)
    cluster.add_argument("--mem-per-cpu-gb", type=float, default=2)
    cluster.add_argument("--venv-path", help="slurm: a virtualenv the jobs activate")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    parser.add_argument(
        "--transform",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="a data transform applied to each document before tokenizing, as data.transforms (repeatable)",
    )
    parser.add_argument(
        "--dedup",
        choices=DEDUP_METHODS,
        help="remove duplicate documents first with datatrove: exact (same text, the first copy kept) or "
        "minhash (near-duplicates, 5-word shingles)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.executor == "slurm" and not args.partition:
        parser.error("--executor slurm needs --partition")
    if args.tasks < 1:
        parser.error("--tasks must be >= 1")

    spec = SourceSpec(
        name=args.builtin,
        files=args.files,
        hub=args.hub,
        hub_config=args.hub_config,
        split=args.split,
        format=args.format,
        text_field=args.text_field,
        separator=args.separator,
    )
    add_bos = {"auto": None, "true": True, "false": False}[args.add_bos]
    cluster = {"cpus_per_task": args.cpus_per_task, "mem_per_cpu_gb": args.mem_per_cpu_gb}
    if args.executor == "slurm":
        cluster.update(partition=args.partition, time=args.time, venv_path=args.venv_path)
    start = time.time()
    try:
        prep = plan_prepare(
            spec,
            load_tokenizer(args.tokenizer),
            args.out,
            add_bos=add_bos,
            overwrite=args.overwrite,
            tasks=args.tasks,
            transforms=load_transforms(args.transform),
            dedup=args.dedup,
        )
        print(f"[lmpretrain] prepare: {prep.summary}; {args.tasks} {args.executor} tasks into {prep.out}")
        header = run_prepare(prep, args.executor, args.tasks, args.workers, **cluster)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if header is None:
        print(f"submitted to {args.executor}: logs in {prep.work / 'logs'}; {prep.out} appears when done")
        return 0
    print(
        f"wrote {len(header['shards'])} shards to {args.out} in {time.time() - start:.1f}s: "
        f"{header['documents']:,} documents, {header['tokens']:,} tokens ({header['dtype']}), "
        f"{header['skipped']:,} bad records skipped (tokenizer {header['tokenizer_hash']}, add_bos "
        f"{header['add_bos']})"
    )
    if header.get("filtered"):
        print(f"--transform dropped {header['filtered']:,} documents")
    if "dedup" in header:
        d = header["dedup"]
        print(f"--dedup {d['method']} removed {d['removed']:,} of {d['documents']:,} documents")
    print(f"use it as a source: {{files: [{args.out}]}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
