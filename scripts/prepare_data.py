"""Pre-tokenize a source into parquet token shards, for corpora where tokenizing is the bottleneck.

    python scripts/prepare_data.py --builtin python-stdlib --tokenizer builtin:python-stdlib --out data/stdlib-tok
    # then, in the config:  data.train: [{files: [data/stdlib-tok], format: tokens}]

One output file per input file and one row per record (or part of a text document), so the tokens source
streams the blocks the text source would (same seed, streams, world size) whenever the source has at least
data.num_streams files; BOS/EOS are added when streaming.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lmpretrain.data import SourceSpec
from lmpretrain.data.prepare import pretokenize
from lmpretrain.data.sources import TOKENS_META
from lmpretrain.data.tokenizer import load_tokenizer
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
    start = time.time()
    try:
        shards = pretokenize(spec, load_tokenizer(args.tokenizer), args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = json.loads((Path(args.out) / TOKENS_META).read_text())
    print(
        f"wrote {len(shards)} shards to {args.out} in {time.time() - start:.1f}s: {meta['documents']:,} documents, "
        f"{meta['tokens']:,} tokens, {meta['bad']:,} bad records as empty rows (tokenizer {meta['tokenizer_hash']})"
    )
    print(f"use it as a source: {{files: [{args.out}], format: tokens}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
