"""Readers of one piece of a source, from an exact position, yielding units of text (or token ids).

A piece is a byte range of a text or JSON Lines file, a run of row groups of a parquet file, a whole
JSON-array file, or a shard of a 🤗 datasets stream. A unit is one document, or for text files a part of
one (at most `CHUNK` bytes, cut after a newline) that says whether it starts and/or ends its document.
Positions are short lists of ints — a byte offset (plus "inside a document"), a row group and row, a
record index — so a reader restarts anywhere in a piece without reading what lies before the position
(gzip and JSON-array files excepted: they are read from their start). Bad records (malformed JSON, a text
field that is not a non-empty string, bytes that are not UTF-8) are yielded as `Bad`, never raised.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from lmpretrain.config import BLANK_LINES
from lmpretrain.errors import DataError

CHUNK = 1 << 16  # bytes per text unit at most (and per read)
SCAN_LIMIT = 1 << 22  # how far a piece boundary may move forward to reach a line or document start
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
_PARQUET_BATCH = 256


class Unit(NamedTuple):
    """A document or part of one. `after` is the position right after it. `last`: it ends a segment (its
    document, or the piece's part of one), so another source or document may follow it in the stream."""

    value: Any  # str, or a numpy int array for token files
    bos: bool  # starts a document
    eos: bool  # ends a document
    last: bool  # ends a segment: a document, or the piece's part of one
    after: list[int]
    records: int = 1  # records (lines for text) it covers, for the bad-record ratio


class Bad(NamedTuple):
    """A skipped record. `after` is None for a bad line inside a text unit (the unit carries the position)."""

    path: str
    byte: int | None  # byte offset of the record (text, JSON lines)
    row: int | None  # row / record number (parquet, JSON arrays, datasets shards)
    why: str
    after: list[int] | None


@dataclass(frozen=True)
class Piece:
    """Part of a source one stream reads in one go: `file` (or shard) index and a [start, end) range in
    bytes (text, JSON lines) or row groups (parquet); end None = to the end of the file."""

    file: int
    start: int = 0
    end: int | None = None


def is_url(path: str) -> bool:
    """A path of an fsspec filesystem (Hub files are `hf://datasets/<id>@<commit>/<file>`)."""
    return "://" in path


def open_seekable(path: str):
    """A local or remote (fsspec, read by byte ranges) binary file for parquet's footer and row-group reads."""
    if not is_url(path):
        return open(path, "rb")
    import fsspec

    return fsspec.open(path, "rb").open()


def open_bytes(path: str):
    """A binary file object; gzip files are decompressed (and then seek by reading from the start)."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def line_number(path: str, byte: int) -> int:
    """1-based line number of the byte at `byte` (reads the file up to there; used once per report)."""
    count = 1
    with open_bytes(path) as f:
        left = byte
        while left > 0:
            buf = f.read(min(left, 1 << 20))
            if not buf:
                break
            count += buf.count(b"\n")
            left -= len(buf)
    return count


def _char_end(data: bytes, i: int, limit: int) -> int:
    """The largest cut in (i, limit] that does not split a UTF-8 multi-byte character of data[i:]."""
    p = limit - 1
    while p > i and limit - p < 4 and data[p] & 0xC0 == 0x80:  # back to the last character's lead byte
        p -= 1
    lead = data[p]
    need = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return limit if p + need <= limit or p == i else p


def _cut(data: bytes, i: int, limit: int) -> int:
    """How many bytes of data[i:limit] a text unit takes: up to its last newline, else whole characters."""
    nl = data.rfind(b"\n", i, limit)
    return nl + 1 - i if nl >= 0 else _char_end(data, i, limit) - i


# ---- piece boundaries -------------------------------------------------------------------------------


def next_start(path: str, offset: int, end: int, separator: str | None, line_records: bool) -> int | None:
    """The first record (or document) start in [offset, end), looking at most SCAN_LIMIT bytes ahead.

    JSON Lines and plain text pieces start at a line start; text with a separator at a document start,
    so documents are never split between pieces. None when there is none in reach.
    """
    sep = None if line_records else separator
    limit = min(end - offset + 1, SCAN_LIMIT)
    buf = b""
    with open(path, "rb") as f:
        f.seek(offset - 1)  # from the byte before: `offset` may itself be a line start
        while len(buf) < limit:  # read on only as far as the boundary is
            more = f.read(min(CHUNK, limit - len(buf)))
            if not more:
                break
            buf += more
            found = _boundary(buf, sep, line_records)
            if found is not None:
                return offset - 1 + found if offset - 1 + found < end else None
    if line_records or sep is not None or len(buf) < 2:
        return None
    i = 1  # plain text, one line longer than the scan: cut between two characters
    while i < len(buf) and buf[i] & 0xC0 == 0x80:
        i += 1
    return offset - 1 + i if offset - 1 + i < end else None


def _boundary(buf: bytes, sep: str | None, line_records: bool) -> int | None:
    """Index in buf (buf[0] is the byte before the scanned offset) of the first line or document start."""
    if sep is None:
        i = buf.find(b"\n")
        return None if i < 0 else i + 1
    if sep == BLANK_LINES:
        m = _BLANK_LINE.search(buf)
        return None if m is None else m.end()
    pattern = sep.encode()
    i = buf.find(pattern, 1)
    return None if i < 0 else i + len(pattern)


# ---- text files ---------------------------------------------------------------------------------------


class _Buffer:
    """A file's bytes from an offset on, read CHUNK at a time; `data[i:]` is what is not consumed yet."""

    def __init__(self, f, offset: int, end: int | None):
        self.f, self.end = f, end
        self.offset = offset  # file position of data[0]
        self.data, self.i, self.eof = b"", 0, False
        f.seek(offset)

    @property
    def pos(self) -> int:
        return self.offset + self.i

    @property
    def exhausted(self) -> bool:
        return self.eof and self.i >= len(self.data)

    def fill(self) -> None:
        """Hold at least CHUNK unconsumed bytes, or all that is left of the range."""
        have = len(self.data) - self.i
        if have >= CHUNK or self.eof:
            return
        want = CHUNK - have
        if self.end is not None:
            want = min(want, self.end - self.offset - len(self.data))
        new = self.f.read(want) if want > 0 else b""
        self.offset += self.i
        self.data, self.i = self.data[self.i :] + new, 0
        reached_end = self.end is not None and self.offset + len(self.data) >= self.end
        self.eof = reached_end or len(new) < want


def _decode(path: str, start: int, raw: bytes) -> tuple[str, list[Bad]]:
    """`raw` as text; lines that are not UTF-8 are dropped and reported."""
    try:
        return raw.decode("utf-8"), []
    except UnicodeDecodeError:
        pass
    good, bad, at = [], [], start
    for line in raw.splitlines(keepends=True):
        try:
            good.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad.append(
                Bad(path, at, None, f"not valid UTF-8 ({e.reason} at byte {e.start} of the line)", None)
            )
        at += len(line)
    return "".join(good), bad


def _text_unit(path: str, start: int, raw: bytes, bos: bool, eos: bool, last: bool, after: list[int]):
    text, bad = _decode(path, start, raw)
    yield from bad
    if text or bos or eos or last:
        yield Unit(text, bos, eos, last, after, text.count("\n") or 1)


def read_text(
    path: str, piece: Piece, size: int | None, at: list[int] | None, separator: str | None
) -> Iterator[Unit | Bad]:
    """Units of a text file's byte range. separator None: the whole file is one document; BLANK_LINES:
    documents end at whitespace-only lines; any other string: documents end at it (it is dropped).

    The position is [byte offset, inside a document]. Pieces of a separated file start at document starts;
    a piece of an unseparated file may start inside the file's one document (no BOS then).
    """
    offset, in_doc = at if at else (piece.start, int(separator is None and piece.start > 0))
    ends_file = piece.end is None or piece.end == size
    with open_bytes(path) as f:
        buf = _Buffer(f, offset, piece.end)
        while True:
            buf.fill()
            if buf.exhausted:
                if in_doc and (ends_file or separator is not None):  # close the open document
                    yield Unit("", False, True, True, [buf.pos, 0], 0)
                return
            if separator is None:
                in_doc = yield from _file_units(path, buf, in_doc, ends_file)
            elif separator == BLANK_LINES:
                in_doc = yield from _paragraph_units(path, buf, in_doc)
            else:
                in_doc = yield from _separated_units(path, buf, in_doc, separator.encode())


def _file_units(path: str, buf: _Buffer, in_doc: int, ends_file: bool):
    """One unit of the file's single document: the buffer up to its last newline."""
    data, i = buf.data, buf.i
    n = len(data) - i if buf.eof else _cut(data, i, len(data))
    start, at_end = buf.pos, buf.eof and i + n == len(data)
    eos = at_end and ends_file
    buf.i += n
    yield from _text_unit(path, start, data[i : i + n], not in_doc, eos, at_end, [start + n, int(not eos)])
    return int(not eos)


def _separated_units(path: str, buf: _Buffer, in_doc: int, sep: bytes):
    """Every document the buffer completes, or (when it completes none) the first part of one."""
    data, i = buf.data, buf.i
    while i < len(data):
        j = data.find(sep, i)
        if j >= 0:
            n, used, eos = j - i, j - i + len(sep), True
        elif buf.eof:  # pieces end at a document end
            n = used = len(data) - i
            eos = True
        elif i > buf.i:  # documents were taken: read more before cutting the next one
            break
        else:  # the document goes on; keep len(sep) - 1 bytes so a separator cannot straddle the cut
            n = used = _cut(data, i, len(data) - len(sep) + 1)
            eos = False
        start = buf.offset + i
        text = data[i : i + n]
        if not (eos and not in_doc and not text.strip()):  # empty documents are not documents
            last = eos or (buf.eof and i + used == len(data))
            yield from _text_unit(path, start, text, not in_doc, eos, last, [start + used, int(not eos)])
        i, in_doc = i + used, int(not eos)
        buf.i = i
        if not eos:
            break
    return in_doc


def _paragraph_units(path: str, buf: _Buffer, in_doc: int):
    """Units from the buffer's complete lines; a whitespace-only line ends the open document."""
    data, i = buf.data, buf.i
    open_at = None  # where the text of the unit being collected starts
    while i < len(data):
        nl = data.find(b"\n", i)
        if nl < 0 and not buf.eof:
            break  # a partial line: read more first
        end = len(data) if nl < 0 else nl + 1
        if data[i:end].strip():
            if open_at is None:
                open_at = i
        elif open_at is not None or in_doc:  # a blank line ends the open document
            s = i if open_at is None else open_at
            yield from _text_unit(
                path, buf.offset + s, data[s:i], not in_doc, True, True, [buf.offset + end, 0]
            )
            open_at, in_doc = None, 0
        i = end
    at_end = buf.eof and i >= len(data)
    if open_at is None and i == buf.i and not at_end:  # a line longer than CHUNK: take part of it
        open_at, i = i, i + _cut(data, i, len(data))
    if open_at is not None:
        after = [buf.offset + i, int(not at_end)]
        yield from _text_unit(path, buf.offset + open_at, data[open_at:i], not in_doc, at_end, at_end, after)
        in_doc = int(not at_end)
    buf.i = i
    return in_doc


# ---- JSON --------------------------------------------------------------------------------------------------


def _record_text(record: Any, field: str) -> tuple[Any, str | None]:
    """(value, None) for a usable record, or (None, why it is bad)."""
    if not isinstance(record, dict):
        return None, f"not a JSON object ({type(record).__name__})"
    if field not in record:
        return None, f"no field {field!r}"
    value = record[field]
    if not isinstance(value, str):
        return None, f"field {field!r} is {type(value).__name__}, not a string"
    if not value:
        return None, f"field {field!r} is empty"
    return value, None


def read_json_lines(path: str, piece: Piece, at: list[int] | None, field: str) -> Iterator[Unit | Bad]:
    """One record per line from a byte offset; blank lines are ignored."""
    offset = at[0] if at else piece.start
    with open_bytes(path) as f:
        f.seek(offset)
        while piece.end is None or offset < piece.end:
            line = f.readline()
            if not line:
                return
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                value, why = _record_text(json.loads(line), field)
            except UnicodeDecodeError as e:
                value, why = None, f"not valid UTF-8 ({e.reason})"
            except ValueError as e:
                value, why = None, f"malformed JSON ({e})"
            if why:
                yield Bad(path, start, None, why, [offset])
            else:
                yield Unit(value, True, True, True, [offset])


def is_json_array(path: str) -> bool:
    """A .json file holding one array of records (rather than JSON Lines)."""
    with open_bytes(path) as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def read_json_array(path: str, at: list[int] | None, field: str) -> Iterator[Unit | Bad]:
    """Records of a JSON array file (parsed whole: restore cost grows with the file, use JSON Lines for big data)."""
    with open_bytes(path) as f:
        try:
            records = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(
                f"{path}: not valid JSON ({e}); JSON Lines (one object per line) are read record by record"
            ) from e
    if not isinstance(records, list):
        raise DataError(
            f"{path}: holds a JSON {type(records).__name__}, not an array of records or JSON Lines"
        )
    for i in range(at[0] if at else 0, len(records)):
        value, why = _record_text(records[i], field)
        yield Bad(path, None, i, why, [i + 1]) if why else Unit(value, True, True, True, [i + 1])


# ---- parquet ----------------------------------------------------------------------------------------------


def read_parquet(path: str, piece: Piece, at: list[int] | None, field: str) -> Iterator[Unit | Bad]:
    """Rows of row groups [start, end) from (row group, row): only that row group is read to reach the row."""
    import pyarrow.parquet as pq

    with open_seekable(path) as f:
        yield from _read_parquet(pq.ParquetFile(f), path, piece, at, field)


def _read_parquet(pf, path: str, piece: Piece, at: list[int] | None, field: str):
    meta = pf.metadata
    group, row = at if at else (piece.start, 0)
    end = meta.num_row_groups if piece.end is None else piece.end
    first_row = sum(meta.row_group(g).num_rows for g in range(group))  # row number in the file, for reports
    while group < end:
        n_rows = meta.row_group(group).num_rows
        seen = 0
        for batch in pf.iter_batches(
            batch_size=_PARQUET_BATCH, row_groups=[group], columns=[field], use_threads=False
        ):
            lo = max(0, row - seen)
            seen += batch.num_rows
            if lo >= batch.num_rows:
                continue  # rows before the position: decoded by pyarrow, never converted
            values = batch.column(0).slice(lo).to_pylist()
            for k, value in enumerate(values):
                r = seen - batch.num_rows + lo + k + 1  # rows of this group done after this one
                after = [group + 1, 0] if r == n_rows else [group, r]
                if not value or not isinstance(value, str):
                    yield Bad(path, None, first_row + r - 1, f"field {field!r} is null or empty", after)
                    continue
                yield Unit(value, True, True, True, after)
        first_row += n_rows
        group, row = group + 1, 0


# ---- 🤗 datasets streams (Hub) ------------------------------------------------------------------------------


def read_datasets_shard(dataset, n_shards: int, shard: int, at: list[int] | None, field: str, where: str):
    """Records of one shard of a streaming `IterableDataset` from a record index. Exact, but `skip()` re-reads
    (for the Hub: re-downloads) the shard's records before the index."""
    unit = dataset.shard(num_shards=n_shards, index=shard)
    start = at[0] if at else 0
    if start:
        unit = unit.skip(start)
    if dataset.features is not None:
        unit = unit.select_columns([field])  # decode only the column we use
    i = start
    try:
        # `.iter` rather than `for record in unit`: inside a DataLoader worker, `IterableDataset.__iter__`
        # splits the shards among workers itself, but each stream here owns its shards explicitly.
        for batch in unit.iter(batch_size=16):
            if field not in batch:
                raise DataError(
                    f"{where}: records have no field {field!r} (fields: {sorted(batch)}); set `text_field`"
                )
            for value in batch[field]:
                i += 1
                if isinstance(value, str) and value:
                    yield Unit(value, True, True, True, [i])
                else:
                    yield Bad(
                        where,
                        None,
                        i - 1,
                        f"field {field!r} is {type(value).__name__}, not a non-empty string",
                        [i],
                    )
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where}: not valid UTF-8 ({e}); convert it to UTF-8 or remove it from the source"
        ) from e
