"""Pre-tokenize a source into parquet token shards (`format: "tokens"`) that stream like the original.

One output file per input file (or Hub shard) and one row per unit the readers produce — a record, or for
text files a part of a document, with `doc_start`/`doc_end` flags; a bad record or line becomes an empty
row, which the stream skips and counts as it would the text. So a tokens source gives the same blocks as
the text source it came from, for any seed and world size, as long as both are cut into the same pieces:
always when the source has at least data.num_streams files (otherwise big text/JSON Lines files are cut
by byte ranges and their token files by row groups).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lmpretrain.data.encoder import Encoder
from lmpretrain.data.readers import Bad
from lmpretrain.data.sources import TOKENS_FIELD, TOKENS_META, SourceSpec, open_source
from lmpretrain.progress import announce, bar

_SCHEMA = pa.schema(
    [(TOKENS_FIELD, pa.list_(pa.int32())), ("doc_start", pa.bool_()), ("doc_end", pa.bool_())]
)


def pretokenize(
    spec: SourceSpec | dict, tokenizer, out_dir: str | os.PathLike, *, batch_rows: int = 256
) -> list[str]:
    """Write `tokens-XXXXX-of-NNNNN.parquet` (columns input_ids, doc_start, doc_end) plus `tokens_meta.json`;
    returns the shards. Draws a progress bar (main process, not under CI)."""
    from lmpretrain.data.tokenizer import tokenizer_hash

    source = open_source(spec)
    encoder = Encoder(tokenizer, add_bos=False)  # BOS/EOS are added when streaming
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pieces = source.pieces(1)  # one stream: every file (shard) is one piece, read in order
    announce(f"pre-tokenizing {source.summary(1)} into {out}")
    paths, totals = [], {"documents": 0, "tokens": 0, "bad": 0}
    with bar(desc="pre-tokenizing", unit="doc") as shown:
        for n, piece in enumerate(pieces):
            path = out / f"tokens-{n:05d}-of-{len(pieces):05d}.parquet"
            with pq.ParquetWriter(path, _SCHEMA) as writer:
                rows: list = []
                for item in source.read(piece, None):
                    rows.append(item)
                    if len(rows) >= batch_rows:
                        _write(writer, encoder, rows, totals, shown)
                        rows = []
                if rows:
                    _write(writer, encoder, rows, totals, shown)
            paths.append(str(path))
            shown.set_postfix(file=f"{n + 1}/{len(pieces)}", tokens=f"{totals['tokens']:,}", refresh=False)
    meta = {
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "source": source.label,
        "shards": len(pieces),
        **totals,
        "bos_eos_added_when_streaming": True,
    }
    (out / TOKENS_META).write_text(json.dumps(meta, indent=2))
    return paths


def _write(writer, encoder: Encoder, rows: list, totals: dict, shown) -> None:
    """Append one row per unit; bad records become empty rows (flags set, so they are skipped, not joined)."""
    text = [i for i, r in enumerate(rows) if not isinstance(r, Bad) and isinstance(r.value, str)]
    ids: list = [[] for _ in rows]
    for i, enc in zip(text, encoder([rows[i].value for i in text]), strict=True):
        ids[i] = enc
    for i, r in enumerate(rows):
        if not isinstance(r, Bad) and not isinstance(r.value, str):  # a tokens source re-prepared
            ids[i] = r.value
    starts = [True if isinstance(r, Bad) else r.bos for r in rows]
    ends = [True if isinstance(r, Bad) else r.eos for r in rows]
    table = pa.table(
        {
            TOKENS_FIELD: pa.array([list(map(int, x)) for x in ids], type=pa.list_(pa.int32())),
            "doc_start": starts,
            "doc_end": ends,
        },
        schema=_SCHEMA,
    )
    writer.write_table(table)
    docs = sum(1 for r in rows if not isinstance(r, Bad) and r.eos)
    totals["documents"] += docs
    totals["tokens"] += sum(map(len, ids))
    totals["bad"] += sum(isinstance(r, Bad) for r in rows)
    shown.update(docs)
