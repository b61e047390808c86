"""Token files: a corpus tokenized once into flat arrays of token ids (`format: tokens`), read by offset.

A token-file folder (layout version 1) holds

    tokens.json        the header, written last: version, dtype, tokenizer (name, hash, vocabulary size),
                       add_bos, bos_id, eos_id, max_id, totals, and per shard its name, tokens, documents
    shard-00000.bin    token ids (uint16 when the vocabulary fits, else uint32, little-endian), every
                       document framed [BOS] ids EOS and written back to back
    shard-00000.idx    uint64 offsets (in tokens) of each document's start in shard-00000.bin, then the
                       shard's length: documents + 1 values

Both arrays are plain binary, so `np.memmap(path, dtype)` maps them; we read them with `os.pread`, not
a map, so the pages a run touches never count in its resident memory, whatever the corpus size. They
are written by data/prepare.py (scripts/prepare_data.py), the header last, so an interrupted prepare
leaves nothing that looks like token files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lmpretrain.data.readers import Bad, Piece, Unit
from lmpretrain.errors import DataError

HEADER = "tokens.json"
VERSION = 1


def is_token_folder(path: str | os.PathLike) -> bool:
    return (Path(os.path.expanduser(path)) / HEADER).is_file()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class TokenFiles:
    """The shards of one or more token-file folders (sharing tokenizer, dtype and framing), read by offset."""

    def __init__(self, folders: list[str]):
        self.folders = [os.path.expanduser(f) for f in folders]
        headers = [_read_header(f) for f in self.folders]
        first = headers[0]
        for folder, header in zip(self.folders[1:], headers[1:], strict=True):
            for key in ("tokenizer_hash", "dtype", "add_bos"):
                if header[key] != first[key]:
                    raise DataError(
                        f"token files {folder} and {self.folders[0]} differ in {key} ({header[key]!r} vs "
                        f"{first[key]!r}); prepare them with the same tokenizer and settings"
                    )
        self.header = first
        self.dtype = np.dtype(first["dtype"])
        self.add_bos = bool(first["add_bos"])
        self.max_id = max(h["max_id"] for h in headers)
        self.paths = [
            os.path.join(f, s["name"])
            for f, h in zip(self.folders, headers, strict=True)
            for s in h["shards"]
        ]
        self.shard_tokens = np.array([s["tokens"] for h in headers for s in h["shards"]], dtype=np.int64)
        self.shard_docs = np.array([s["documents"] for h in headers for s in h["shards"]], dtype=np.int64)
        for path, n in zip(self.paths, self.shard_tokens, strict=True):
            size = os.path.getsize(path + ".bin") if os.path.exists(path + ".bin") else -1
            if size != n * self.dtype.itemsize:
                raise DataError(
                    f"token file {path}.bin has {size} bytes, its header says {n} tokens of {self.dtype}; "
                    "the folder is damaged: prepare it again"
                )
        self._fds: dict[int, int] = {}
        self._index: dict[int, np.ndarray] = {}
        self._blocks: tuple[int, np.ndarray] | None = None

    @property
    def tokens(self) -> int:
        return int(self.shard_tokens.sum())

    @property
    def documents(self) -> int:
        return int(self.shard_docs.sum())

    def files(self) -> list[str]:
        return [p + ".bin" for p in self.paths]

    def _fd(self, shard: int) -> int:
        # pread takes its own offset, so one descriptor serves every thread and forked worker.
        if shard not in self._fds:
            self._fds[shard] = os.open(self.paths[shard] + ".bin", os.O_RDONLY)
        return self._fds[shard]

    def read(self, shard: int, start: int, out: np.ndarray) -> np.ndarray:
        """Fill `out` (of self.dtype) with the shard's tokens from `start`."""
        want = out.nbytes
        got = os.preadv(self._fd(shard), [memoryview(out).cast("B")], start * self.dtype.itemsize)
        if got != want:
            raise DataError(f"token file {self.paths[shard]}.bin ended early (read {got} of {want} bytes)")
        return out

    def doc_index(self, shard: int) -> np.ndarray:
        if shard not in self._index:
            self._index[shard] = np.fromfile(self.paths[shard] + ".idx", dtype="<u8").astype(np.int64)
        return self._index[shard]

    # ---- blocks: what the global shuffle draws ----------------------------------------------------------

    def block_offsets(self, seq_len: int) -> np.ndarray:
        """Cumulative block counts per shard ([0, b0, b0+b1, ...]): a shard's last partial block is dropped."""
        if self._blocks is None or self._blocks[0] != seq_len:
            self._blocks = (seq_len, np.concatenate([[0], np.cumsum(self.shard_tokens // seq_len)]))
        return self._blocks[1]

    def read_blocks(self, blocks: np.ndarray, seq_len: int) -> np.ndarray:
        """Blocks (numbered over all shards) as an int32 [len(blocks), seq_len] array."""
        offsets = self.block_offsets(seq_len)
        shards = np.searchsorted(offsets, blocks, side="right") - 1
        buf = np.empty((len(blocks), seq_len), dtype=self.dtype)
        for row, (block, shard) in enumerate(zip(blocks.tolist(), shards.tolist(), strict=True)):
            self.read(shard, (block - int(offsets[shard])) * seq_len, buf[row])
        return buf.astype(np.int32)

    # ---- documents: what the window shuffle and the held-out set read --------------------------------

    def pieces(self, num_streams: int) -> list[Piece]:
        """Shards, a shard holding more than 1/num_streams of the tokens cut into document ranges."""
        total = max(1, self.tokens)
        out = []
        for shard, docs in enumerate(self.shard_docs.tolist()):
            k = max(1, min(docs, -(-num_streams * int(self.shard_tokens[shard]) // total)))
            bounds = [docs * j // k for j in range(k + 1)]
            out += [Piece(shard, a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
        return out

    def units(self, piece: Piece, at: list[int] | None) -> Iterator[Unit | Bad]:
        """Documents of a piece from document `at[0]`, as token ids without their BOS/EOS framing."""
        index = self.doc_index(piece.file)
        end = len(index) - 1 if piece.end is None else piece.end
        for doc in range(at[0] if at else piece.start, end):
            a, b = int(index[doc]), int(index[doc + 1])
            ids = self.read(piece.file, a, np.empty(b - a, dtype=self.dtype))
            ids = ids[int(self.add_bos) : -1].astype(np.int64)  # the framing is redone by the stream
            yield Unit(ids, True, True, True, [doc + 1])

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __getstate__(self):  # descriptors are per process
        return {**self.__dict__, "_fds": {}}

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _read_header(folder: str) -> dict:
    path = Path(folder) / HEADER
    if not path.is_file():
        raise DataError(
            f"{folder} holds no {HEADER}: not token files (write them with scripts/prepare_data.py)"
        )
    header = json.loads(path.read_text())
    if header.get("version") != VERSION:
        raise DataError(
            f"{path}: token files of layout version {header.get('version')}, this lmpretrain reads version "
            f"{VERSION}; prepare them again with scripts/prepare_data.py"
        )
    return header


def check_tokenizer(files: TokenFiles, tokenizer, label: str) -> None:
    """Token files must come from this tokenizer, and hold no id outside its vocabulary (which the
    start-up checks keep within the model's)."""
    from lmpretrain.data.tokenizer import tokenizer_hash

    vocab = len(tokenizer)
    if files.max_id >= vocab:
        raise DataError(
            f"source {label}: token files hold id {files.max_id}, outside the tokenizer's vocabulary of "
            f"{vocab} (and so the model's embedding rows); they were prepared with another tokenizer: run "
            "scripts/prepare_data.py again with this one"
        )
    if files.header["tokenizer_hash"] != tokenizer_hash(tokenizer):
        raise DataError(
            f"source {label} was prepared with another tokenizer ({files.header.get('tokenizer')!r}, hash "
            f"{files.header['tokenizer_hash']}); run scripts/prepare_data.py again with this one"
        )
