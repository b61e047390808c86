"""One virtual stream: documents -> tokens + EOS -> packed `seq_len` blocks -> shuffled windows.

Its state is a few integers: where the current shuffle window starts (per source: epoch, slot in the
epoch's shard order, record index in that shard, bad records skipped so far; the mixing counter; the
token offset into the document at the window start) plus how many blocks of the window were emitted.
Restoring seeks to the window start and re-reads one window; nothing before it is replayed.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque

import numpy as np

from lmpretrain.data.sources import Source
from lmpretrain.errors import DataError

logger = logging.getLogger(__name__)

_TAG_SHARD_ORDER, _TAG_WINDOW, _TAG_MIX = 1, 2, 3
_MASK = 2**63 - 1
_READ_DOCS, _READ_CHARS = 64, 1 << 16  # documents tokenized per batch: up to 64 docs or ~64k characters
_END = object()
_warned: set[str] = set()


def rng(*key: int) -> np.random.Generator:
    """A generator that depends only on the integers in `key` (counter-based: reconstructible anywhere)."""
    return np.random.default_rng([int(k) & _MASK for k in key])


def uniform(*key: int) -> float:
    """A float in [0, 1) that depends only on `key`; cheaper than building a generator per document."""
    data = b"".join((int(k) & _MASK).to_bytes(8, "little") for k in key)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") / 2**64


def shard_plan(n_shards: int, num_streams: int, stream: int) -> tuple[list[int], int, int]:
    """(shards, keep_every, phase): the stream reads `shards` and keeps records with index % keep_every == phase.

    With at least as many shards as streams each stream owns whole shards (u % S == s). Otherwise the
    streams sharing shard `s % n` interleave its records, each reading the whole shard.
    """
    if n_shards >= num_streams:
        return list(range(stream, n_shards, num_streams)), 1, 0
    shard = stream % n_shards
    return [shard], len(range(shard, num_streams, n_shards)), stream // n_shards


class Encoder:
    """Batched tokenization without special tokens (the packer appends EOS itself)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        if self.eos_id is None:
            raise DataError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no EOS token; the packer "
                "needs one between documents. Set eos_token or train one with scripts/train_tokenizer.py"
            )
        self.backend = getattr(tokenizer, "backend_tokenizer", None)

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]


def usable(value, tokens: bool) -> bool:
    if tokens:
        return value is not None and not isinstance(value, str) and len(value) > 0
    return isinstance(value, str) and value != ""


class SourceCursor:
    """Position of one stream in one source; endless (epochs cycle through a per-epoch shard order)."""

    def __init__(self, source: Source, index: int, stream: int, num_streams: int, seed: int, shuffle: bool):
        self.source, self.index, self.stream, self.num_streams = source, index, stream, num_streams
        self.shards, self.keep_every, self.phase = shard_plan(source.n_shards, num_streams, stream)
        self.seed, self.shuffle = seed, shuffle
        self.epoch = self.slot = self.record = self.skipped = 0
        self.records_read = 0  # records pulled from the dataset by this cursor (for tests and benchmarks)
        self._records = None
        self._order: tuple[int, list[int]] | None = None

    def position(self) -> tuple[int, int, int, int]:
        return (self.epoch, self.slot, self.record, self.skipped)

    def seek(self, position) -> None:
        self.epoch, self.slot, self.record, self.skipped = (int(x) for x in position)
        self.close()

    def close(self) -> None:
        """Close the open shard reader now (left to interpreter shutdown, datasets' readers print errors)."""
        if self._records is not None:
            self._records.close()
            self._records = None

    def _shard(self) -> int:
        if self._order is None or self._order[0] != self.epoch:
            n = len(self.shards)
            order = list(range(n))
            if self.shuffle and n > 1:
                order = (
                    rng(self.seed, _TAG_SHARD_ORDER, self.index, self.stream, self.epoch)
                    .permutation(n)
                    .tolist()
                )
            self._order = (self.epoch, order)
        return self.shards[self._order[1][self.slot]]

    def next_doc(self):
        """The next usable document (text, or token ids for pre-tokenized sources) of this stream's share."""
        shards_ended = 0
        while True:
            if self._records is None:
                self._records = self.source.iter_shard(self._shard(), self.record)
            value = next(self._records, _END)
            if value is _END:
                self._records, self.record, self.slot = None, 0, self.slot + 1
                if self.slot == len(self.shards):
                    self.slot, self.epoch = 0, self.epoch + 1
                shards_ended += 1
                if shards_ended > len(self.shards):
                    raise DataError(
                        f"source {self.source.label} has too few documents for {self.num_streams} streams: stream "
                        f"{self.stream} found no usable document in a full pass over its share (shards "
                        f"{[self.source.describe_shard(u) for u in self.shards][:3]}, every {self.keep_every}th record; "
                        f"{self.skipped} bad records skipped). Lower data.num_streams or add data (empty corpus?)"
                    )
                continue
            i = self.record
            self.record += 1
            self.records_read += 1
            if i % self.keep_every != self.phase:
                continue
            if not usable(value, self.source.tokens):
                self.skipped += 1
                if self.source.label not in _warned:
                    _warned.add(self.source.label)
                    logger.warning(
                        "source %s: skipping bad records (None, non-string or empty %r), e.g. record %d "
                        "of %s; counted in skipped_docs",
                        self.source.label,
                        self.source.field,
                        i,
                        self.source.describe_shard(self._shard()),
                    )
                continue
            shards_ended = 0
            return value


class StreamReader:
    """One virtual stream of packed blocks with an exact, small, restorable state."""

    def __init__(
        self,
        sources: list[Source],
        encoder: Encoder,
        *,
        stream: int,
        num_streams: int,
        seq_len: int,
        seed: int,
        shuffle: bool,
        window: int,
        state: dict | None = None,
    ):
        self.cursors = [
            SourceCursor(src, k, stream, num_streams, seed, shuffle) for k, src in enumerate(sources)
        ]
        weights = np.array([src.spec.weight for src in sources], dtype=np.float64)
        self.cum_weights = np.cumsum(weights / weights.sum())
        self.encoder, self.stream, self.seq_len = encoder, stream, seq_len
        self.seed, self.shuffle, self.window = seed, shuffle, window
        self.mix = 0  # documents drawn so far (the mixing RNG's counter)
        self.docs: deque = (
            deque()
        )  # [snapshot before reading the doc, tokens incl. EOS], not yet fully packed
        self.offset = 0  # tokens of docs[0] already packed
        self.window_index, self.emitted = 0, 0
        self.blocks: np.ndarray | None = None
        self.window_pos = None
        self._start_state = state or self.initial_state(len(sources))

    @staticmethod
    def initial_state(num_sources: int) -> dict:
        return {
            "window": 0,
            "emitted": 0,
            "mix": 0,
            "offset": 0,
            "sources": [[0, 0, 0, 0] for _ in range(num_sources)],
        }

    def close(self) -> None:
        for cursor in self.cursors:
            cursor.close()

    @property
    def records_read(self) -> int:
        return sum(c.records_read for c in self.cursors)

    def _snapshot(self):
        return (self.mix, tuple(c.position() for c in self.cursors))

    def _choose_source(self) -> int:
        if len(self.cursors) == 1:
            return 0
        u = uniform(self.seed, _TAG_MIX, self.stream, self.mix)
        return min(int(np.searchsorted(self.cum_weights, u, side="right")), len(self.cursors) - 1)

    def _read_more(self) -> None:
        snaps, values, chars = [], [], 0
        while len(values) < _READ_DOCS and chars < _READ_CHARS:
            snaps.append(self._snapshot())
            k = self._choose_source()
            value = self.cursors[k].next_doc()
            self.mix += 1
            values.append((k, value))
            chars += len(value) * (4 if self.cursors[k].source.tokens else 1)
        text_idx = [i for i, (k, _) in enumerate(values) if not self.cursors[k].source.tokens]
        encoded = dict(zip(text_idx, self.encoder([values[i][1] for i in text_idx]), strict=True))
        for i, (snap, (_, value)) in enumerate(zip(snaps, values, strict=True)):
            ids = encoded.get(i, value)
            doc = np.empty(len(ids) + 1, dtype=np.int32)
            doc[:-1] = ids
            doc[-1] = self.encoder.eos_id
            self.docs.append((snap, doc))

    def _take(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int32)
        filled = 0
        while filled < n:
            if not self.docs:
                self._read_more()
            doc = self.docs[0][1]
            take = min(n - filled, len(doc) - self.offset)
            out[filled : filled + take] = doc[self.offset : self.offset + take]
            filled += take
            self.offset += take
            if self.offset == len(doc):
                self.docs.popleft()
                self.offset = 0
        return out

    def _position(self):
        """(snapshot, token offset) of the next token to pack."""
        return (self.docs[0][0], self.offset) if self.docs else (self._snapshot(), 0)

    def _start_window(self) -> None:
        self.window_pos = self._position()
        blocks = self._take(self.window * self.seq_len).reshape(self.window, self.seq_len)
        if self.shuffle:
            blocks = blocks[
                rng(self.seed, _TAG_WINDOW, self.stream, self.window_index).permutation(self.window)
            ]
        self.blocks, self.emitted = blocks, 0

    def _restore(self, state: dict) -> None:
        if len(state["sources"]) != len(self.cursors):
            raise DataError(
                f"data state has {len(state['sources'])} sources but the config has {len(self.cursors)}; "
                "resume with the same data.train sources"
            )
        self.mix = int(state["mix"])
        for cursor, position in zip(self.cursors, state["sources"], strict=True):
            cursor.seek(position)
        self.docs.clear()
        self.offset = 0
        if state["offset"]:
            self._read_more()
            if state["offset"] >= len(self.docs[0][1]):
                raise DataError(
                    f"stream {self.stream}: saved token offset {state['offset']} is past the end of its "
                    "document; the data or tokenizer changed since the checkpoint"
                )
            self.offset = int(state["offset"])
        self.window_index = int(state["window"])
        self._start_window()
        self.emitted = int(state["emitted"])

    def next_block(self) -> np.ndarray:
        if self.blocks is None:
            self._restore(self._start_state)
        if self.emitted >= self.window:
            self.window_index += 1
            self._start_window()
        block = self.blocks[self.emitted]
        self.emitted += 1
        return block

    def next_blocks(self, n: int) -> np.ndarray:
        if n == 0:
            return np.empty((0, self.seq_len), dtype=np.int32)
        return np.stack([self.next_block() for _ in range(n)])

    def state(self) -> dict:
        """Plain-dict position of what was emitted so far (JSON-safe)."""
        if self.blocks is None:
            return {k: (list(map(list, v)) if k == "sources" else v) for k, v in self._start_state.items()}
        if self.emitted < self.window:
            (mix, sources), offset = self.window_pos
            window, emitted = self.window_index, self.emitted
        else:  # the window is done: point at the next one so a restore does not re-read this one
            (mix, sources), offset = self._position()
            window, emitted = self.window_index + 1, 0
        return {
            "window": window,
            "emitted": emitted,
            "mix": mix,
            "offset": offset,
            "sources": [list(p) for p in sources],
        }
