"""Token files: a corpus tokenized once into flat arrays of token ids (`format: tokens`), read by offset.

A token-file folder (layout version 1) holds

    tokens.json        the header, written last: version, dtype, tokenizer (name, hash, vocabulary size),
                       add_bos, bos_id, eos_id, max_id, totals, and per shard its name, tokens, documents
    shard-00000.bin    token ids (uint16 when the vocabulary fits, else uint32, little-endian), every
                       document framed [BOS] ids EOS and written back to back
    shard-00000.idx    uint64 offsets (in tokens) of each document's start in shard-00000.bin, then the
                       shard's length: documents + 1 values

Both arrays are plain binary, so `np.memmap(path, dtype)` maps them; we read them with `os.pread`, not
a map, so the pages a run touches never count in its resident memory, whatever the corpus size. A
prepare writes into a hidden temporary folder and renames it into place after the header, so an
interrupted one leaves nothing that looks like token files.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lmpretrain.data.readers import Bad, Piece, Unit
from lmpretrain.errors import DataError

HEADER = "tokens.json"
VERSION = 1
PREPARE_PIECES = 64  # a prepare cuts the source into (about) this many shards, whatever the process count


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


# ---- writing ---------------------------------------------------------------------------------------------

_job: dict = {}  # set in each prepare process by _init_job


def _init_job(spec, tokenizer, add_bos: bool | None, dtype: str, folder: str, transforms=None) -> None:
    from lmpretrain.data.encoder import Encoder
    from lmpretrain.data.sources import open_source

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one tokenizer thread per process
    _job.update(
        source=open_source(spec, transforms),
        encoder=Encoder(tokenizer, add_bos),
        dtype=np.dtype(dtype),
        folder=folder,
    )


def _write_piece(job: tuple[int, Piece]) -> dict:
    """Tokenize one piece into shard-<n>.bin/.idx; returns its counts."""
    n, piece = job
    source, encoder, dtype = _job["source"], _job["encoder"], _job["dtype"]
    name = f"shard-{n:05d}"
    path = os.path.join(_job["folder"], name)
    starts, written, skipped, max_id, batch, size = [], 0, 0, -1, [], 0
    with open(path + ".bin", "wb") as out:

        def flush():
            nonlocal written, max_id
            texts = [u.value for u in batch if isinstance(u.value, str)]
            encoded = iter(encoder(texts))
            for u in batch:
                ids = next(encoded) if isinstance(u.value, str) else np.asarray(u.value, dtype=np.int64)
                if u.bos or not starts:
                    starts.append(written)
                framed = encoder.frame(ids, u.bos, u.eos)
                if len(framed):
                    max_id = max(max_id, int(framed.max()))
                out.write(framed.astype(dtype).tobytes())
                written += len(framed)
            batch.clear()

        for item in source.read(piece, None):
            if isinstance(item, Bad):
                skipped += 1
                continue
            batch.append(item)
            size += len(item.value)
            if len(batch) >= 256 or size >= 1 << 20:
                flush()
                size = 0
        flush()
    np.array([*starts, written], dtype="<u8").tofile(path + ".idx")
    return {"name": name, "tokens": written, "documents": len(starts), "skipped": skipped, "max_id": max_id}


def write_token_files(
    spec,
    tokenizer,
    out: str | os.PathLike,
    *,
    add_bos: bool | None = None,
    processes: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
    transforms=None,
) -> dict:
    """Tokenize a source into a token-file folder `out` with `processes` processes; returns the header.
    The folder appears (renamed into place) only when complete; `overwrite` replaces an existing one.
    `transforms`: data.transforms (data/transforms.py) applied to each document before tokenizing."""
    from lmpretrain.data.encoder import Encoder
    from lmpretrain.data.sources import open_source
    from lmpretrain.data.tokenizer import tokenizer_hash
    from lmpretrain.progress import announce, bar

    out = Path(os.path.expanduser(out))
    if out.exists() and not overwrite:
        raise DataError(f"{out} exists; choose another --out or pass --overwrite")
    source = open_source(spec, transforms)
    encoder = Encoder(tokenizer, add_bos)  # checks EOS/BOS before any work
    dtype = token_dtype(len(tokenizer))
    pieces = source.pieces(PREPARE_PIECES)
    processes = max(1, min(processes or os.cpu_count() or 1, len(pieces)))
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    announce(
        f"tokenizing {source.summary(PREPARE_PIECES)} into {out} with {processes} process{'es' * (processes > 1)}"
    )
    args = (spec, tokenizer, encoder.add_bos, dtype.str, str(tmp), transforms)
    try:
        shards: list[dict] = []
        with bar(desc="tokenizing", unit="piece", total=len(pieces), enabled=progress) as shown:
            if processes == 1:
                _init_job(*args)
                results = map(_write_piece, enumerate(pieces))
                shards = _collect(results, shown)
            else:
                ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
                with ctx.Pool(processes, initializer=_init_job, initargs=args) as pool:
                    shards = _collect(pool.imap(_write_piece, enumerate(pieces)), shown)
        _job.clear()
        for s in shards:
            if not s["documents"]:  # nothing usable in that piece
                os.remove(tmp / f"{s['name']}.bin")
                os.remove(tmp / f"{s['name']}.idx")
        shards = [s for s in shards if s["documents"]]
        if not shards:
            raise DataError(f"source {source.label}: no usable document to tokenize")
        header = {
            "version": VERSION,
            "dtype": dtype.str,
            "tokenizer": getattr(tokenizer, "name_or_path", ""),
            "tokenizer_hash": tokenizer_hash(tokenizer),
            "vocab_size": len(tokenizer),
            "add_bos": encoder.add_bos,
            "bos_id": encoder.bos_id,
            "eos_id": encoder.eos_id,
            "max_id": max(s["max_id"] for s in shards),
            "source": source.label,
            "tokens": sum(s["tokens"] for s in shards),
            "documents": sum(s["documents"] for s in shards),
            "skipped": sum(s["skipped"] for s in shards),
            "shards": [{k: s[k] for k in ("name", "tokens", "documents")} for s in shards],
        }
        (tmp / HEADER).write_text(json.dumps(header, indent=2))
        if out.exists():  # overwrite: the old folder goes only once the new one is complete
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        return header
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _collect(results, shown) -> list[dict]:
    shards, tokens = [], 0
    for result in results:
        shards.append(result)
        tokens += result["tokens"]
        shown.update(1)
        shown.set_postfix(tokens=f"{tokens:,}", refresh=False)
    return shards
