"""Tokenize a source once into token files (`format: tokens`), for training with the global shuffle.

    python scripts/prepare_data.py --builtin python-stdlib --tokenizer builtin:python-stdlib --out data/stdlib-tok
    python scripts/prepare_data.py --files 'corpus/**/*.jsonl' --tokenizer gpt2 --out data/corpus-tok
    # then, in the config:  data.train: [{files: [data/stdlib-tok], format: tokens}]

Writes a folder of flat token arrays (uint16/uint32) and document indexes with a tokens.json header
(layout in docs/data.md), using several processes; the folder appears only when complete. Every
document is framed [BOS] ids EOS as the run will read it (--add-bos: as data.add_bos).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from lmpretrain.data import SourceSpec
from lmpretrain.data.token_files import write_token_files
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
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="tokenizing processes")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    parser.add_argument(
        "--transform",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="a data transform applied to each document before tokenizing, as data.transforms (repeatable)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

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
    start = time.time()
    try:
        header = write_token_files(
            spec,
            load_tokenizer(args.tokenizer),
            args.out,
            add_bos=add_bos,
            processes=args.processes,
            overwrite=args.overwrite,
            transforms=load_transforms(args.transform),
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {len(header['shards'])} shards to {args.out} in {time.time() - start:.1f}s: "
        f"{header['documents']:,} documents, {header['tokens']:,} tokens ({header['dtype']}), "
        f"{header['skipped']:,} bad records skipped (tokenizer {header['tokenizer_hash']}, add_bos "
        f"{header['add_bos']})"
    )
    print(f"use it as a source: {{files: [{args.out}], format: tokens}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
