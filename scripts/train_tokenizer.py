"""Train a byte-level BPE (or character-level) tokenizer on any text source; save it as a transformers fast tokenizer.

python scripts/train_tokenizer.py --files 'data/*.jsonl' --text-field text --vocab-size 8192 --out tok/
python scripts/train_tokenizer.py --builtin python-stdlib --out tok/
python scripts/train_tokenizer.py --builtin python-stdlib --char-level --vocab-size 65 --out chars/
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

from lmpretrain.data import SourceSpec, open_source
from lmpretrain.data.readers import Unit
from lmpretrain.data.tokenizer import train_bpe, train_char_level
from lmpretrain.errors import UserError
from lmpretrain.progress import announce


def texts_of(spec: SourceSpec, max_docs: int | None) -> Iterator[str]:
    """Text of every file in order (long text documents in parts); bad records are left out."""
    source = open_source(spec)
    announce(f"reading {source.summary(1)}")
    n = 0
    for piece in source.pieces(1):
        for item in source.read(piece, None):
            if isinstance(item, Unit) and item.value:
                yield item.value
                n += item.eos
                if max_docs is not None and n >= max_docs:
                    return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--files", action="append", help="file, glob or folder (repeatable): txt/md/py, json/jsonl, parquet"
    )
    src.add_argument("--builtin", help="a builtin dataset, e.g. python-stdlib (its train split)")
    parser.add_argument("--text-field", default="text", help="column holding the text (json/parquet)")
    parser.add_argument(
        "--format", choices=["text", "json", "parquet"], help="default: from the file extension"
    )
    parser.add_argument(
        "--separator", help="text files: documents end at this string, or at blank lines with 'blank_lines'"
    )
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument(
        "--char-level",
        action="store_true",
        help="one token per character (lowercased): the vocab-size - 4 most frequent ones, the rest unknown",
    )
    parser.add_argument("--max-docs", type=int, help="train on at most this many documents")
    parser.add_argument("--out", required=True, help="output folder (save_pretrained)")
    args = parser.parse_args(argv)

    spec = (
        SourceSpec(name=args.builtin, split="train")
        if args.builtin
        else SourceSpec(
            files=args.files, format=args.format, text_field=args.text_field, separator=args.separator
        )
    )
    start = time.time()
    try:
        train = train_char_level if args.char_level else train_bpe
        tok = train(texts_of(spec, args.max_docs), args.vocab_size, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    example = "def greet(name):\n    return f'hello {name}'\n"
    ids = tok(example)["input_ids"]
    print(
        f"saved to {args.out} in {time.time() - start:.1f}s: vocab size {len(tok)}; "
        f"bos/eos/pad = {tok.bos_token_id}/{tok.eos_token_id}/{tok.pad_token_id}"
    )
    print(
        f"example: {example!r} -> {len(ids)} tokens {ids[:16]}... -> decodes back: {tok.decode(ids) == example}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
