"""`BlockStream`: one virtual stream of packed blocks, with an exact, small, restorable state.

Units (documents, or parts of long text documents) are drawn from the sources (mixed by weight, one
document at a time) into *document windows* of up to `doc_window` documents (and at most
`doc_window` x 8 KiB of text). Each window is tokenized in one batch and its documents are permuted with a
generator seeded by (seed, stream, window index) — a document cut by the window's edge keeps its place at
the edge, so no document is reordered internally. The tokens, framed [BOS] ids EOS, are concatenated and cut
into `seq_len` blocks (nothing is dropped), and blocks are emitted in *block windows* of `block_window`
blocks, each permuted with its own seeded generator.

The state points at the start of the current block window — the document window that holds its first token
(source positions and mixing counter at that window's start, its index, the unit and token offset in its
shuffled order) — plus how many blocks of the block window were emitted. A restore seeks the sources there
and re-reads one document window and one block window; nothing before is replayed. The state also holds the
*frontier* (the sources' positions after the last document window read) and the tokens each source gave
to the emitted blocks: when the mixture changes at resume (data/mixture.py), a stream restarts from its
frontier, so each source goes on with the documents it would have read next. The stream's stateful
data.transforms (data/transforms.py) are snapshot with the source positions at each document window's
start and end, so the re-read window is transformed exactly as it was.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import numpy as np

from lmpretrain.data.cursor import TAG_BLOCKS, TAG_DOCS, TAG_MIX, SourceCursor, rng
from lmpretrain.data.encoder import Encoder
from lmpretrain.data.readers import Unit
from lmpretrain.data.sources import Source
from lmpretrain.data.transforms import Transforms
from lmpretrain.errors import DataError

DOC_WINDOW_BYTES_PER_DOC = 8192  # a document window holds at most doc_window x this much text


@dataclass(frozen=True)
class StreamSettings:
    """What every virtual stream of a run shares (the data section, resolved)."""

    num_streams: int
    seq_len: int
    seed: int
    shuffle: bool
    block_window: int  # data.shuffle_window
    doc_window: int  # data.doc_shuffle_window


def uniform(*key: int) -> float:
    """A float in [0, 1) that depends only on `key`; cheaper than building a generator per document."""
    data = b"".join((int(k) & (2**63 - 1)).to_bytes(8, "little") for k in key)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") / 2**64


def frame_units(encoder: Encoder, picked: list[tuple[Source, Unit]]) -> list[np.ndarray]:
    """Token arrays [BOS] ids [EOS] of units, the text ones tokenized in one batch."""
    encoded = iter(encoder([u.value for src, u in picked if not src.tokens]))
    out = []
    for src, u in picked:
        if src.tokens:
            ids = u.value  # token files: an int array
            encoder.check([ids], f"token-file source {src.label}")
        else:
            ids = next(encoded)
        out.append(encoder.frame(ids, u.bos, u.eos))
    return out


class BlockStream:
    """One virtual stream of packed blocks; see the module docstring."""

    def __init__(
        self,
        sources: list[Source],
        encoder: Encoder,
        settings: StreamSettings,
        stream: int,
        state: dict | None = None,
        source_ids: list[int] | None = None,
        transforms: Transforms | None = None,
    ):
        s = settings
        # A source's id seeds its piece order: it stays the same when other sources are added or removed.
        ids = source_ids if source_ids is not None else list(range(len(sources)))
        self.transform = transforms.chain() if transforms else None  # this stream's own instances
        self.cursors = [
            SourceCursor(src, i, stream, s.num_streams, s.seed, s.shuffle, self.transform)
            for i, src in zip(ids, sources, strict=True)
        ]
        weights = np.array([src.spec.weight for src in sources], dtype=np.float64)
        self.cum_weights = np.cumsum(weights / weights.sum())
        self.encoder, self.settings, self.stream = encoder, settings, stream
        self.mix, self.open = 0, -1  # documents drawn (mixing counter); source in the middle of a segment
        self.doc_window = -1  # index of the loaded document window
        self.doc_start: dict | None = None  # source snapshot at its start ...
        self.doc_end: dict | None = None  # ... and after it
        self.units: list[np.ndarray] = []  # its token arrays, in shuffled order
        self.unit_sources: list[int] = []  # the source of each
        self.unit = self.offset = 0  # next token to pack: units[unit][offset]
        self.block_window, self.emitted = 0, 0
        self.blocks: np.ndarray | None = None
        self.block_tokens: np.ndarray | None = None  # [block, source]: tokens each source gave each block
        self.tokens = np.zeros(len(sources), dtype=np.int64)  # tokens each source gave the emitted blocks
        self.block_start: dict | None = None  # position of the block window's first token
        self._start_state = state or self.initial_state(len(sources))

    @staticmethod
    def initial_state(num_sources: int) -> dict:
        start = {
            "mix": 0,
            "open": -1,
            "sources": [SourceCursor.initial_position() for _ in range(num_sources)],
        }
        return {
            "window": 0,
            "emitted": 0,
            "docs": {"start": start, "window": 0, "unit": 0, "offset": 0},
            "frontier": {"start": copy.deepcopy(start), "window": 0},
            "tokens": [0] * num_sources,
        }

    @property
    def records_read(self) -> int:
        return sum(c.records_read for c in self.cursors)

    def progress(self) -> tuple[int, int, list[int], int]:
        """(completed epochs of the first source, bad records skipped, tokens per source emitted, documents
        data.transforms dropped) as read so far: after a step's blocks this depends only on the step (blocks
        are read a whole block window at a time), so a resumed run reports what the uninterrupted one does."""
        skipped, filtered = sum(c.skipped for c in self.cursors), sum(c.filtered for c in self.cursors)
        return self.cursors[0].epoch, skipped, self.tokens.tolist(), filtered

    def take_notes(self) -> list[tuple[str, str]]:
        """Reports of bad records made since the last call."""
        notes = [n for c in self.cursors for n in c.notes]
        for c in self.cursors:
            c.notes.clear()
        return notes

    def close(self) -> None:
        for cursor in self.cursors:
            cursor.close()

    # ---- document windows ----------------------------------------------------------------------------

    def _snapshot(self) -> dict:
        snapshot = {"mix": self.mix, "open": self.open, "sources": [c.position() for c in self.cursors]}
        if self.transform is not None and self.transform.stateful:
            snapshot["transforms"] = self.transform.state_dict()
        return snapshot

    def _choose_source(self) -> int:
        if len(self.cursors) == 1:
            return 0
        u = uniform(self.settings.seed, TAG_MIX, self.stream, self.mix)
        return min(int(np.searchsorted(self.cum_weights, u, side="right")), len(self.cursors) - 1)

    def _load_doc_window(self) -> None:
        s = self.settings
        self.doc_start, self.doc_window = self._snapshot(), self.doc_window + 1
        picked, segments, size, cap = [], 0, 0, s.doc_window * DOC_WINDOW_BYTES_PER_DOC
        while True:
            if self.open < 0:  # a document is drawn whole from one source, however many units it has
                k = self._choose_source()
                self.mix += 1
            else:
                k = self.open
            unit = self.cursors[k].next_unit()
            picked.append((k, unit))
            size += len(unit.value) * (4 if self.cursors[k].source.tokens else 1)
            segments += unit.last
            self.open = -1 if unit.last else k
            if size >= cap or (self.open < 0 and segments >= s.doc_window):
                break
        self.doc_end = self._snapshot()
        arrays = frame_units(self.encoder, [(self.cursors[k].source, u) for k, u in picked])
        groups, current = [], []
        for (k, unit), array in zip(picked, arrays, strict=True):
            current.append((k, array))
            if unit.last:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
        # A segment continued from the previous window stays first, one that goes on into the next stays last.
        lo = int(self.doc_start["open"] >= 0)
        hi = max(lo, len(groups) - int(self.open >= 0))
        if s.shuffle and hi - lo > 1:
            middle = groups[lo:hi]
            order = rng(s.seed, TAG_DOCS, self.stream, self.doc_window).permutation(len(middle))
            groups = groups[:lo] + [middle[i] for i in order] + groups[hi:]
        self.units = [a for group in groups for _, a in group]
        self.unit_sources = [k for group in groups for k, _ in group]
        self.unit = self.offset = 0

    def _position(self) -> dict:
        """Where the next token to pack is: (document window start, its index, unit, token offset)."""
        if self.unit < len(self.units):
            return {
                "start": self.doc_start,
                "window": self.doc_window,
                "unit": self.unit,
                "offset": self.offset,
            }
        return {"start": self.doc_end, "window": self.doc_window + 1, "unit": 0, "offset": 0}

    def _take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next n tokens to pack, and the source of each."""
        out = np.empty(n, dtype=np.int32)
        source = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            if self.unit >= len(self.units):
                self._load_doc_window()
            doc = self.units[self.unit]
            take = min(n - filled, len(doc) - self.offset)
            out[filled : filled + take] = doc[self.offset : self.offset + take]
            source[filled : filled + take] = self.unit_sources[self.unit]
            filled += take
            self.offset += take
            if self.offset == len(doc):
                self.unit, self.offset = self.unit + 1, 0
        return out, source

    # ---- block windows -------------------------------------------------------------------------------

    def _start_block_window(self) -> None:
        s = self.settings
        self.block_start = copy.deepcopy(self._position())
        tokens, source = self._take(s.block_window * s.seq_len)
        blocks = tokens.reshape(s.block_window, s.seq_len)
        n = len(self.cursors)
        counts = np.stack(
            [np.bincount(row, minlength=n) for row in source.reshape(s.block_window, s.seq_len)]
        )
        if s.shuffle:
            order = rng(s.seed, TAG_BLOCKS, self.stream, self.block_window).permutation(s.block_window)
            blocks, counts = blocks[order], counts[order]
        self.blocks, self.block_tokens, self.emitted = blocks, counts, 0

    def _restore(self, state: dict) -> None:
        docs = state["docs"]
        start = docs["start"]
        if len(start["sources"]) != len(self.cursors):
            raise DataError(
                f"data state has {len(start['sources'])} sources but the config has {len(self.cursors)}; "
                "resume with the same data.train sources"
            )
        self.mix, self.open = int(start["mix"]), int(start["open"])
        for cursor, position in zip(self.cursors, start["sources"], strict=True):
            cursor.seek(position)
        if self.transform is not None and self.transform.stateful:
            self.transform.load_state_dict(start.get("transforms", {}))
        self.doc_window = int(docs["window"]) - 1
        self._load_doc_window()
        unit, offset = int(docs["unit"]), int(docs["offset"])
        if (
            unit >= len(self.units)
            or offset > len(self.units[unit])
            or (offset and offset == len(self.units[unit]))
        ):
            raise DataError(
                f"stream {self.stream}: the saved position (unit {unit}, token {offset}) is not in its "
                "document window; the data or tokenizer changed since the checkpoint"
            )
        self.unit, self.offset = unit, offset
        self.block_window = int(state["window"])
        self._start_block_window()
        self.emitted = int(state["emitted"])
        self.tokens = np.array(state.get("tokens", [0] * len(self.cursors)), dtype=np.int64)

    def next_block(self) -> np.ndarray:
        if self.blocks is None:
            self._restore(self._start_state)
        if self.emitted >= self.settings.block_window:
            self.block_window += 1
            self._start_block_window()
        block = self.blocks[self.emitted]
        self.tokens += self.block_tokens[self.emitted]
        self.emitted += 1
        return block

    def next_blocks(self, n: int) -> np.ndarray:
        if n == 0:
            return np.empty((0, self.settings.seq_len), dtype=np.int32)
        return np.stack([self.next_block() for _ in range(n)])

    def state(self) -> dict:
        """Plain-dict position of what was emitted so far (JSON-safe)."""
        if self.blocks is None:
            return copy.deepcopy(self._start_state)
        if self.emitted < self.settings.block_window:
            docs, window, emitted = self.block_start, self.block_window, self.emitted
        else:  # the block window is done: point at the next one so a restore does not re-read this one
            docs, window, emitted = self._position(), self.block_window + 1, 0
        return {
            "window": window,
            "emitted": emitted,
            "docs": copy.deepcopy(docs),
            "frontier": {"start": copy.deepcopy(self.doc_end), "window": self.doc_window + 1},
            "tokens": self.tokens.tolist(),
        }
