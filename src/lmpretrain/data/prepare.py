"""Pre-tokenize a source into parquet token shards (`format: "tokens"`) that stream like the original.

One output shard per input shard and one row per input record (a bad record becomes an empty row, which
the stream skips and counts exactly as it would the text), so a tokens source gives the same blocks as
the text source it came from, for any seed, stream count and world size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lmpretrain.data.sources import TOKENS_FIELD, TOKENS_META, SourceSpec, open_source
from lmpretrain.data.stream import Encoder


def pretokenize(
    spec: SourceSpec | dict, tokenizer, out_dir: str | os.PathLike, *, batch_docs: int = 256
) -> list[str]:
    """Write `tokens-XXXXX-of-NNNNN.parquet` (column `input_ids`) plus `tokens_meta.json`; returns the shards."""
    from lmpretrain.tokenizer import tokenizer_hash

    source = open_source(spec)
    encoder = Encoder(tokenizer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(TOKENS_FIELD, pa.list_(pa.int32()))])
    paths, total_tokens, total_docs = [], 0, 0
    n = source.n_shards
    for shard in range(n):
        path = out / f"tokens-{shard:05d}-of-{n:05d}.parquet"
        with pq.ParquetWriter(path, schema) as writer:
            batch: list = []
            for value in source.iter_shard(shard):
                batch.append(value)
                if len(batch) >= batch_docs:
                    total_docs, total_tokens = _write(
                        writer, schema, encoder, batch, total_docs, total_tokens
                    )
                    batch = []
            if batch:
                total_docs, total_tokens = _write(writer, schema, encoder, batch, total_docs, total_tokens)
        paths.append(str(path))
    meta = {
        "tokenizer": getattr(tokenizer, "name_or_path", ""),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "source": source.label,
        "shards": n,
        "documents": total_docs,
        "tokens": total_tokens,
        "eos_appended_when_streaming": True,
    }
    (out / TOKENS_META).write_text(json.dumps(meta, indent=2))
    return paths


def _write(
    writer, schema, encoder: Encoder, batch: list, total_docs: int, total_tokens: int
) -> tuple[int, int]:
    """Append one row per record; bad records (None, non-string, empty) become empty rows."""
    good = [i for i, v in enumerate(batch) if isinstance(v, str) and v]
    ids: list[list[int]] = [[] for _ in batch]
    for i, enc in zip(good, encoder([batch[i] for i in good]), strict=True):
        ids[i] = enc
    writer.write_table(pa.table({TOKENS_FIELD: pa.array(ids, type=pa.list_(pa.int32()))}, schema=schema))
    return total_docs + len(good), total_tokens + sum(map(len, ids))
