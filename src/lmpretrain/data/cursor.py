"""`SourceCursor`: one stream's position in one source — endless epochs over the stream's pieces (their
order permuted per epoch with the seed), a position inside the current piece, and counts of the records
it has seen and skipped as bad. Its position is plain data; seeking to it reads nothing before it.

The stream's data.transforms (a `TransformChain`, shared by the stream's cursors) run here, on the documents
of the stream's own share only: after the pieces and the segments of shared pieces are divided among the
streams, so a stateful transform sees exactly its stream's documents.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from lmpretrain.data.readers import Bad, Unit, line_number
from lmpretrain.data.sources import Source
from lmpretrain.data.transforms import TransformChain
from lmpretrain.errors import DataError

logger = logging.getLogger(__name__)

_MASK = 2**63 - 1
TAG_PIECE_ORDER, TAG_DOCS, TAG_BLOCKS, TAG_MIX = 1, 2, 3, 4
MIN_BAD_TO_REFUSE = 32  # a source is refused once it has this many bad records and they are the majority
_reported: set[str] = set()  # sources whose bad records this process has reported (once each)


def rng(*key: int) -> np.random.Generator:
    """A generator that depends only on the integers in `key` (counter-based: reconstructible anywhere)."""
    return np.random.default_rng([int(k) & _MASK for k in key])


def piece_plan(n_pieces: int, num_streams: int, stream: int) -> tuple[list[int], int, int]:
    """(pieces, keep_every, phase): the stream reads `pieces` and keeps the segments (documents, records)
    whose index in their piece is phase modulo keep_every.

    With at least as many pieces as streams each stream owns whole pieces (u % S == s). Otherwise the
    streams sharing piece `s % n` interleave its segments, each reading the whole piece.
    """
    if n_pieces >= num_streams:
        return list(range(stream, n_pieces, num_streams)), 1, 0
    piece = stream % n_pieces
    return [piece], len(range(piece, num_streams, n_pieces)), stream // n_pieces


class SourceCursor:
    """Position of one stream in one source; see the module docstring."""

    def __init__(
        self,
        source: Source,
        index: int,
        stream: int,
        num_streams: int,
        seed: int,
        shuffle: bool,
        transform: TransformChain | None = None,
    ):
        self.source, self.index, self.stream, self.num_streams = source, index, stream, num_streams
        # data.transforms for a text source (token sources were transformed when they were prepared)
        self.transform = transform if transform and not source.tokens else None
        pieces = source.pieces(num_streams)
        owned, self.keep_every, self.phase = piece_plan(len(pieces), num_streams, stream)
        self.pieces = [pieces[u] for u in owned]
        self.seed, self.shuffle = seed, shuffle
        self.epoch = self.slot = self.segment = self.seen = self.skipped = 0
        self.filtered = 0  # documents data.transforms dropped
        self.at: list[int] | None = None  # position in the current piece (None: its start)
        self.records_read = 0  # items pulled from readers, ours or not (tests and benchmarks)
        self.notes: list[tuple[str, str]] = []  # (source label, report) of bad records, once per process
        self._reader = None
        self._order: tuple[int, list[int]] | None = None

    @staticmethod
    def initial_position() -> dict:
        return {"epoch": 0, "slot": 0, "at": None, "segment": 0, "seen": 0, "skipped": 0, "filtered": 0}

    def position(self) -> dict:
        """Plain-data position: epoch, slot in the epoch's piece order, place in the piece, counters."""
        return {
            "epoch": self.epoch,
            "slot": self.slot,
            "at": None if self.at is None else list(self.at),
            "segment": self.segment,
            "seen": self.seen,
            "skipped": self.skipped,
            "filtered": self.filtered,
        }

    def seek(self, position: dict) -> None:
        self.close()
        self.epoch, self.slot = int(position["epoch"]), int(position["slot"])
        self.at = None if position["at"] is None else [int(x) for x in position["at"]]
        self.segment, self.seen = int(position["segment"]), int(position["seen"])
        self.skipped = int(position["skipped"])
        self.filtered = int(position.get("filtered", 0))  # (positions saved before data.transforms)

    def close(self) -> None:
        """Close the open piece reader (its file) now."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _piece(self):
        if self._order is None or self._order[0] != self.epoch:
            order = list(range(len(self.pieces)))
            if self.shuffle and len(order) > 1:
                key = (self.seed, TAG_PIECE_ORDER, self.index, self.stream, self.epoch)
                order = rng(*key).permutation(len(order)).tolist()
            self._order = (self.epoch, order)
        return self.pieces[self._order[1][self.slot]]

    def next_unit(self) -> Unit:
        """The next unit of this stream's share of the source (crossing pieces and epochs as needed)."""
        pieces_ended = 0
        while True:
            if self._reader is None:
                self._reader = self.source.read(self._piece(), self.at)
            item = next(self._reader, None)
            if item is None:
                self._reader, self.at, self.segment = None, None, 0
                self.slot += 1
                if self.slot == len(self.pieces):
                    self.slot, self.epoch = 0, self.epoch + 1
                pieces_ended += 1
                if pieces_ended > len(self.pieces):
                    raise self._too_few()
                continue
            self.records_read += 1
            ours = self.segment % self.keep_every == self.phase
            if isinstance(item, Bad):
                if item.after is not None:  # a whole record (not a line inside a text unit)
                    self.at = item.after
                    self.segment += 1
                if ours:
                    self._skip(item)
                continue
            start, self.at = self.at, item.after
            self.segment += item.last
            if not ours:
                continue
            self.seen += item.records
            if self.transform is None:
                return item
            where = functools.partial(self.source.locate, self._piece(), start)  # said only if it raises
            text = self.transform(item.value, self.source.label, where)
            if text is not None:
                return item._replace(value=text)
            self.filtered += 1  # dropped by a transform: counted in train/filtered_docs, not a bad record

    def _skip(self, bad: Bad) -> None:
        self.seen += 1
        self.skipped += 1
        label = self.source.label
        if self.skipped >= MIN_BAD_TO_REFUSE and 2 * self.skipped > self.seen:
            raise DataError(
                f"source {label}: {self.skipped} of the {self.seen} records stream {self.stream} read are bad, "
                f"e.g. {_where(bad)}: {bad.why}. Fix or remove that file (a few bad records are skipped and "
                "counted in train/skipped_docs; a mostly bad source is refused)"
            )
        if label not in _reported:
            _reported.add(label)
            report = (
                f"[lmpretrain] WARNING: source {label}: skipping a bad record at {_where(bad)}: {bad.why}; "
                "bad records are skipped and counted in train/skipped_docs (reported once per source)"
            )
            self.notes.append((label, report))

    def _too_few(self) -> DataError:
        shown = [self.source.describe(p) for p in self.pieces][:3]
        return DataError(
            f"source {self.source.label} has too few documents for {self.num_streams} streams: stream "
            f"{self.stream} found no usable document in a full pass over its share ({shown}, keeping 1 "
            f"document in {self.keep_every}; {self.skipped} bad records skipped, {self.filtered} documents dropped by "
            "data.transforms). Lower data.num_streams or add data (empty corpus? a transform that drops everything?)"
        )


def _where(bad: Bad) -> str:
    if bad.byte is not None:
        return f"{bad.path} line {line_number(bad.path, bad.byte)}"
    return f"{bad.path} record {bad.row}"
