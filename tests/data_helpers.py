"""Helpers shared by the data tests: build a TrainStream from a few settings, read steps, split token
streams back into documents."""

from __future__ import annotations

import json
import re

import torch

from lmpretrain.config import DataConfig
from lmpretrain.data import TrainStream

TAG = re.compile(r"<([^>|]+)>")


def make(sources, tok, *, blocks_per_step=4, rank=0, world_size=1, seed=0, **data) -> TrainStream:
    """A TrainStream over `sources` (data section fields as keywords; small defaults)."""
    settings = dict(seq_len=16, num_streams=4, num_workers=0, shuffle_window=4)  # shuffle: the default
    settings.update(data)
    cfg = DataConfig(train=list(sources), **settings)
    return TrainStream(cfg, tok, blocks_per_step=blocks_per_step, rank=rank, world_size=world_size, seed=seed)


def steps(ts: TrainStream, n: int, it=None):
    it = it if it is not None else iter(ts)
    return [next(it) for _ in range(n)], it


def by_stream(ids: torch.Tensor, ts: TrainStream) -> dict[int, torch.Tensor]:
    out, i = {}, 0
    for s in ts.owned:
        out[s] = ids[i : i + ts.counts[s]]
        i += ts.counts[s]
    return out


def stream_tokens(results, ts: TrainStream) -> dict[int, list[int]]:
    """Each stream's tokens in order, over several steps."""
    out = {s: [] for s in ts.owned}
    for r in results:
        for s, blocks in by_stream(r.input_ids, ts).items():
            out[s] += blocks.flatten().tolist()
    return out


def documents(tokens: list[int], tok) -> list[tuple[bool, str]]:
    """The complete documents of a token stream: (began with BOS, decoded text without BOS/EOS)."""
    docs, cur = [], []
    for t in tokens:
        if t == tok.eos_token_id:
            bos = bool(cur) and cur[0] == tok.bos_token_id
            docs.append((bos, tok.decode(cur[1:] if bos else cur)))
            cur = []
        else:
            cur.append(t)
    return docs


def doc_tags(tokens: list[int], tok) -> list[str]:
    """The tag of each complete document of a token stream (documents name themselves: `<tag> ...`)."""
    return [TAG.match(text).group(1) for _, text in documents(tokens, tok)]


def expected_tokens(paths, tok, bos: bool = True, doc_cap: int | None = None) -> list[int]:
    """The token stream of JSONL files read in order: [BOS] ids EOS per record (its first `doc_cap` tokens)."""
    out = []
    for p in paths:
        for line in open(p, encoding="utf-8"):
            ids = tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            out += ([tok.bos_token_id] * bos + ids + [tok.eos_token_id])[:doc_cap]
    return out


def write_token_folder(folder, shards: list[list[int]], tok, ids=(3, None), seed=0):
    """Token files in the documented layout (tokens.json, shard-NNNNN.bin/.idx; docs/data.md), written by
    hand so a test chooses every shard's length: shard i holds documents of lengths shards[i] (framing
    included: BOS, random ids in [ids[0], ids[1]), EOS). Returns the source's stream: the shards back to back."""
    import numpy as np

    from lmpretrain.data.tokenizer import tokenizer_hash

    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    lo, hi = ids[0], ids[1] or len(tok)
    entries, stream = [], []
    for i, lengths in enumerate(shards):
        docs = [
            np.concatenate([[tok.bos_token_id], rng.integers(lo, hi, n - 2), [tok.eos_token_id]])
            for n in lengths
        ]
        ids_ = np.concatenate(docs).astype("<u2")
        name = f"shard-{i:05d}"
        ids_.tofile(folder / f"{name}.bin")
        np.cumsum([0, *lengths], dtype="<u8").tofile(folder / f"{name}.idx")
        entries.append({"name": name, "tokens": len(ids_), "documents": len(lengths)})
        stream.append(ids_)
    stream = np.concatenate(stream)
    header = {
        "version": 1,
        "dtype": "<u2",
        "tokenizer": tok.name_or_path,
        "tokenizer_hash": tokenizer_hash(tok),
        "vocab_size": len(tok),
        "add_bos": True,
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
        "max_id": int(stream.max()),
        "source": "hand-written",
        "tokens": len(stream),
        "documents": sum(map(len, shards)),
        "skipped": 0,
        "shards": entries,
    }
    (folder / "tokens.json").write_text(json.dumps(header))
    return stream
