"""Token files: a corpus tokenized once into flat arrays of token ids (`format: tokens`), read by offset.

A token-file folder (layout version 1) holds

    tokens.json        the header, written last: version, dtype, tokenizer (name, hash, vocabulary size),
                       add_bos, bos_id, eos_id, max_id, totals, and per shard its name, tokens, documents
    shard-00000.bin    token ids (uint16 when the vocabulary fits, else uint32, little-endian), every
                       document framed [BOS] ids EOS and written back to back
    shard-00000.idx    uint64 offsets (in tokens) of each document's start in shard-00000.bin, then the
                       shard's length: documents + 1 values

`TokenFiles` also reads datatrove's `.ds` folders and Megatron `.bin`/`.idx` prefixes (data/token_layouts.py
lists their shards). A source's shards, back to back, are **one logical stream** of tokens: the global
shuffle cuts blocks from it anywhere (a block may span shards). Both arrays are read with `os.pread`, not
a map, so the pages a run touches never count in its resident memory, whatever the corpus size; at most
`max_open_files` descriptors are open per process, whatever the number of sources (they share one pool; the
least recently used is closed), and document
bounds are read from the index files when needed, never cached whole. They are written by
data/prepare.py (scripts/prepare_data.py), the header last, so an interrupted prepare leaves nothing that
looks like token files.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from lmpretrain.data.readers import Bad, Piece, Unit
from lmpretrain.data.token_layouts import Layout, detect, open_layout
from lmpretrain.errors import DataError

MAX_OPEN_FILES = 64  # data.max_open_files' default
SCAN_MAX_TOKENS = 1 << 28  # sources that record no max id are scanned for it when they are at most this big
_INDEX_CHUNK = 1024  # document bounds read from an index at a time


def is_token_folder(path: str | os.PathLike) -> bool:
    """A token layout: lmpretrain token files, a datatrove folder or a Megatron prefix (or folder)."""
    return detect(path) is not None


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class _Descriptors:
    """This process's token-file descriptors, shared by every TokenFiles (each source, training and held-out):
    at most `limit` open in all, the least recently used closed first. pread takes its own offset, so one
    descriptor serves every reader of a file, and a forked DataLoader worker can use what it inherits."""

    def __init__(self):
        self.open: OrderedDict[str, int] = OrderedDict()

    def get(self, path: str, limit: int) -> int:
        fd = self.open.get(path)
        if fd is not None:
            self.open.move_to_end(path)
            return fd
        while len(self.open) >= limit:
            os.close(self.open.popitem(last=False)[1])
        fd = self.open[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self, paths) -> None:
        for path in paths:
            fd = self.open.pop(path, None)
            if fd is not None:
                os.close(fd)


_DESCRIPTORS = _Descriptors()


def open_token_files() -> int:
    """Token-file descriptors this process holds now, over every source (tests)."""
    return len(_DESCRIPTORS.open)


class TokenFiles:
    """The shards of one or more token layouts (sharing dtype and framing) as one logical token stream,
    read by offset; with every other TokenFiles of the process, at most `max_open_files` descriptors open."""

    def __init__(self, paths: list[str], max_open_files: int = MAX_OPEN_FILES):
        self.layouts: list[Layout] = [open_layout(os.path.expanduser(p)) for p in paths]
        first = self.layouts[0]
        # lmpretrain headers identify the tokenizer by hash; datatrove's only by the name it was given.
        keys = ("format", "dtype", "tokenizer_hash", "add_bos") + ("tokenizer",) * (
            first.format == "datatrove"
        )
        for other in self.layouts[1:]:
            for key in keys:
                if getattr(other, key) != getattr(first, key):
                    raise DataError(
                        f"token files {other.path} and {first.path} differ in {key} ({getattr(other, key)!r} vs "
                        f"{getattr(first, key)!r}); give them as separate sources, or tokenize them alike"
                    )
        self.format, self.dtype, self.add_bos = first.format, first.dtype, first.add_bos
        self.tokenizer_name, self.tokenizer_hash = first.tokenizer, first.tokenizer_hash
        self.shards = [s for layout in self.layouts for s in layout.shards]
        self.shard_tokens = np.array([s.tokens for s in self.shards], dtype=np.int64)
        self.shard_docs = np.array([s.documents for s in self.shards], dtype=np.int64)
        # Where each shard starts in the source's logical stream (the shards back to back).
        self.starts = np.concatenate([[0], np.cumsum(self.shard_tokens)])
        known = [layout.max_id for layout in self.layouts]
        self.max_id = max(known) if None not in known else None
        self.vocab: int | None = (
            None  # ids must stay below it (set by check_tokenizer; checked on every read)
        )
        self.max_open_files = max(1, int(max_open_files))
        self._paths: set[str] = set()  # the files this one has read (its descriptors live in _DESCRIPTORS)

    @property
    def tokens(self) -> int:
        return int(self.starts[-1])

    @property
    def documents(self) -> int:
        return int(self.shard_docs.sum())

    def files(self) -> list[str]:
        return [s.bin for s in self.shards]

    def _fd(self, path: str) -> int:
        # the process's pool closes the least recently used past max_open_files, so a corpus of any number
        # of shards and sources fits `ulimit -n`
        self._paths.add(path)
        return _DESCRIPTORS.get(path, self.max_open_files)

    def open_files(self) -> int:
        """Descriptors this process holds for the source now (tests)."""
        return sum(path in _DESCRIPTORS.open for path in self._paths)

    def _pread(self, path: str, offset: int, out: np.ndarray) -> np.ndarray:
        want = out.nbytes
        got = os.preadv(self._fd(path), [memoryview(out).cast("B")], offset) if want else 0
        if got != want:
            raise DataError(f"token file {path} ended early (read {got} of {want} bytes): it was truncated")
        return out

    def read(self, shard: int, start: int, out: np.ndarray) -> np.ndarray:
        """Fill `out` (of self.dtype) with the shard's tokens from `start`."""
        return self._pread(self.shards[shard].bin, start * self.dtype.itemsize, out)

    def read_span(self, start: int, out: np.ndarray) -> np.ndarray:
        """Fill `out` with the logical stream's tokens from `start` (mod its length): across shard ends,
        and from the stream's end on to its start."""
        total, done, pos = self.tokens, 0, start % self.tokens
        while done < len(out):
            shard = int(np.searchsorted(self.starts, pos, side="right")) - 1
            take = min(len(out) - done, int(self.starts[shard + 1]) - pos)
            self.read(shard, pos - int(self.starts[shard]), out[done : done + take])
            done, pos = done + take, (pos + take) % total
        return out

    def read_blocks(self, starts: np.ndarray, seq_len: int) -> np.ndarray:
        """Blocks of seq_len tokens at `starts` (positions in the logical stream) as an int32 array."""
        starts = np.asarray(starts, dtype=np.int64) % self.tokens
        shards = np.searchsorted(self.starts, starts, side="right") - 1
        inside = starts + seq_len <= self.starts[shards + 1]
        buf = np.empty((len(starts), seq_len), dtype=self.dtype)
        for row, (start, shard, whole) in enumerate(
            zip(starts.tolist(), shards.tolist(), inside.tolist(), strict=True)
        ):
            if whole:  # the common case: one read
                self.read(shard, start - int(self.starts[shard]), buf[row])
            else:
                self.read_span(start, buf[row])
        out = buf.astype(np.int32)
        if self.vocab is not None and len(out) and int(out.max()) >= self.vocab:
            raise self._outside(int(out.max()))
        return out

    def _outside(self, max_id: int) -> DataError:
        return DataError(
            f"source {self.layouts[0].path}: token files hold id {max_id}, outside the tokenizer's vocabulary of "
            f"{self.vocab} (and so the model's embedding rows); they were tokenized with another tokenizer: "
            "tokenize them again with this one (scripts/prepare_data.py)"
        )

    def scan_max_id(self) -> int:
        """The largest id in the files, read through in chunks (for layouts that do not record it)."""
        best, chunk = -1, 1 << 22
        for k, shard in enumerate(self.shards):
            for at in range(0, shard.tokens, chunk):
                part = self.read(k, at, np.empty(min(chunk, shard.tokens - at), dtype=self.dtype))
                best = max(best, int(part.max()))
        return best

    # ---- documents: what the window shuffle and the held-out set read --------------------------------

    def _values(self, path: str, dtype: str, offset: int, count: int) -> np.ndarray:
        return self._pread(path, offset, np.empty(count, dtype=dtype)).astype(np.int64)

    def doc_bounds(self, shard: int, first: int, stop: int) -> np.ndarray:
        """Token offsets in the shard of documents first .. stop (stop - first + 1 values, the last the end
        of document stop - 1), read from its index file."""
        s = self.shards[shard]
        if s.kind == "starts":  # documents + 1 starts
            return self._values(s.index, "<u8", 8 * first, stop - first + 1)
        if s.kind == "ends":  # one end per document: document d spans [end[d - 1], end[d])
            ends = self._values(s.index, "<u8", 8 * max(0, first - 1), stop - max(0, first - 1))
            return np.concatenate([[0], ends]) if first == 0 else ends
        # megatron: byte pointers of each document's start; the last document ends at the shard's end
        size = self.dtype.itemsize
        upto = min(stop + 1, s.documents)
        pointers = self._values(s.index, "<i8", s.index_offset + 8 * first, upto - first) // size
        return np.concatenate([pointers, [s.tokens]]) if upto == s.documents else pointers

    def document(self, shard: int, doc: int) -> np.ndarray:
        """One document as on disk (its framing included)."""
        a, b = self.doc_bounds(shard, doc, doc + 1).tolist()
        return self.read(shard, a, np.empty(b - a, dtype=self.dtype))

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
        end = int(self.shard_docs[piece.file]) if piece.end is None else piece.end
        for lo in range(at[0] if at else piece.start, end, _INDEX_CHUNK):
            hi = min(end, lo + _INDEX_CHUNK)
            bounds = self.doc_bounds(piece.file, lo, hi).tolist()
            for j, doc in enumerate(range(lo, hi)):
                ids = self.read(piece.file, bounds[j], np.empty(bounds[j + 1] - bounds[j], dtype=self.dtype))
                ids = ids[int(self.add_bos) : -1].astype(np.int64)  # the framing is redone by the stream
                yield Unit(ids, True, True, True, [doc + 1])

    def close(self) -> None:
        """Close this source's descriptors (another reader of the same files opens them again)."""
        paths, self._paths = self._paths, set()
        _DESCRIPTORS.close(paths)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _same_tokenizer(name: str, tokenizer) -> bool:
    """Whether `name` (what a datatrove folder records: a local tokenizer.json or folder, or a Hub id) is
    this tokenizer: by vocabulary when it is a local file, else by name."""
    path = Path(os.path.expanduser(name))
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True) == tokenizer.get_vocab()
    return name == getattr(tokenizer, "name_or_path", None)


def check_tokenizer(files: TokenFiles, tokenizer, label: str) -> None:
    """Token files must come from this tokenizer, hold no id outside its vocabulary (which the start-up
    checks keep within the model's), and end every document with its EOS; a layout that does not record
    whether documents start with BOS is read from its first document."""
    from lmpretrain.data.tokenizer import tokenizer_hash

    vocab = len(tokenizer)
    files.vocab = vocab
    fix = "tokenize them again with this one (scripts/prepare_data.py), or set data.tokenizer to theirs"
    if files.max_id is None and files.tokens <= SCAN_MAX_TOKENS:
        files.max_id = files.scan_max_id()
    if files.max_id is not None and files.max_id >= vocab:
        raise files._outside(files.max_id)
    if files.tokenizer_hash is not None and files.tokenizer_hash != tokenizer_hash(tokenizer):
        raise DataError(
            f"source {label} was tokenized with another tokenizer ({files.tokenizer_name!r}, hash "
            f"{files.tokenizer_hash}) than the run's ({getattr(tokenizer, 'name_or_path', '')!r}, hash "
            f"{tokenizer_hash(tokenizer)}); {fix}"
        )
    if files.format == "datatrove" and not _same_tokenizer(files.tokenizer_name, tokenizer):
        raise DataError(
            f"source {label} was tokenized with another tokenizer ({files.tokenizer_name!r}, datatrove's "
            f".ds.metadata) than the run's ({getattr(tokenizer, 'name_or_path', '')!r}); {fix}"
        )
    first = files.document(0, 0)
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    if not len(first) or int(first[-1]) != eos:
        raise DataError(
            f"source {label}: its first document does not end with the tokenizer's EOS (id {eos}); documents "
            "must be framed [BOS] ids EOS (datatrove: set eos_token on the tokenizer step)"
        )
    if files.add_bos is None:
        files.add_bos = bos is not None and bos != eos and len(first) > 1 and int(first[0]) == bos
