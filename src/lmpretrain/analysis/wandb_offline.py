"""Read offline W&B runs back from their files: no server, no login, no wandb internals.

An offline run lives in ``<dir>/wandb/offline-run-<YYYYmmdd_HHMMSS>-<id>[-N]/run-<id>.wandb``. A
resumed run (same id) gets one such folder per process that logged to it.

Format of ``run-<id>.wandb`` (checked against wandb 0.31's ``wandb-core`` writer and
``wandb leet inspect --json``):

* a 7-byte file header: ident ``b":W&B"``, magic ``0xBEE1`` (uint16, little-endian), version ``0``;
* then LevelDB's log format (github.com/google/leveldb/blob/main/doc/log_format.md): the file is cut
  into 32 KiB blocks (the file header counts toward the first). Each chunk is ``checksum: uint32,
  length: uint16, type: uint8`` (little-endian) followed by ``length`` bytes; type 1 = FULL record,
  2/3/4 = FIRST/MIDDLE/LAST pieces of a record split across blocks. A chunk never crosses a block
  boundary: fewer than 7 bytes left in a block are zero padding. W&B's checksum is zlib's CRC-32
  of the data, seeded with the CRC-32 of the type byte (LevelDB itself uses masked CRC-32C);
* each reassembled record is a serialized ``wandb.proto.wandb_internal_pb2.Record`` (history,
  summary, config, run, exit, ... records).
"""

from __future__ import annotations

import json
import logging
import re
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE_HEADER = struct.Struct("<4sHB")
FILE_IDENT, FILE_MAGIC, FILE_VERSION = b":W&B", 0xBEE1, 0
CHUNK_HEADER = struct.Struct("<IHB")
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in (FULL, FIRST, MIDDLE, LAST)}


class CorruptRunFile(ValueError):
    """The .wandb file is not a W&B transaction log or a record in it is damaged."""


class _Torn(Exception):
    pass


def _scan(data: bytes, path: Any) -> Iterator[bytes]:
    """Records of a .wandb file's bytes; raises _Torn at an incomplete tail."""
    if len(data) < FILE_HEADER.size:
        raise _Torn("file header")
    ident, magic, version = FILE_HEADER.unpack_from(data, 0)
    if (ident, magic, version) != (FILE_IDENT, FILE_MAGIC, FILE_VERSION):
        raise CorruptRunFile(f"{path}: not a W&B transaction log (header {ident!r} {magic:#x} v{version})")
    pos = FILE_HEADER.size
    pending: bytearray | None = None  # pieces of a record split across blocks
    while pos < len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER.size:
            pos += left_in_block  # zero padding at the end of a block
            continue
        if pos + CHUNK_HEADER.size > len(data):
            raise _Torn(f"chunk header at byte {pos}")
        checksum, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        start, end = pos + CHUNK_HEADER.size, pos + CHUNK_HEADER.size + length
        if end > len(data):
            raise _Torn(f"record at byte {pos}")
        chunk = data[start:end]
        if kind not in _TYPE_CRC or zlib.crc32(chunk, _TYPE_CRC[kind]) != checksum:
            raise CorruptRunFile(f"{path}: bad checksum or chunk type {kind} at byte {pos}")
        pos = end
        if kind == FULL:
            pending = None
            yield chunk
        elif kind == FIRST:
            pending = bytearray(chunk)
        elif pending is None:
            raise CorruptRunFile(f"{path}: chunk type {kind} without a FIRST at byte {start}")
        else:
            pending += chunk
            if kind == LAST:
                yield bytes(pending)
                pending = None
    if pending is not None:
        raise _Torn("record split across blocks")


def iter_record_bytes(path: str | Path) -> Iterator[bytes]:
    """The serialized records of a ``.wandb`` file, in order. A torn tail (a run killed mid-write or
    still being written) ends the stream with a warning; a damaged record before it raises."""
    try:
        yield from _scan(Path(path).read_bytes(), path)
    except _Torn as torn:
        logger.warning("%s: torn %s (run killed or still writing); stopping there", path, torn)


def wait_until_complete(path: str | Path, timeout: float = 30.0) -> bool:
    """Wait until a ``.wandb`` file holds its exit record and no torn tail; False on timeout.

    wandb 0.31's ``run.finish()`` in offline mode can return while ``wandb-core`` is still writing
    the last block of the file (observed here: reads right after finish saw ~85% of the records), so
    readers wait here rather than the training process at its exit.
    """
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout
    last_size = -1
    while True:
        size = Path(path).stat().st_size if Path(path).exists() else -1
        if size != last_size and size > 0:
            last_size = size
            try:
                for raw in _scan(Path(path).read_bytes(), path):
                    record = wandb_internal_pb2.Record()
                    record.ParseFromString(raw)
                    if record.WhichOneof("record_type") == "exit":
                        return True
            except _Torn:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def iter_records(path: str | Path) -> Iterator[Any]:
    """``wandb_internal_pb2.Record`` messages of a ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2

    for raw in iter_record_bytes(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        yield record


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def _json(text: str) -> Any:
    return json.loads(text) if text else None


def _history_value(item: Any) -> Any:
    kind = item.WhichOneof("value")
    if kind is None:
        return _json(item.value_json)
    if kind == "none":
        return None
    if kind == "json":
        return _json(item.json)
    return getattr(item, kind)


def _apply(target: dict, record: Any) -> None:
    """Apply a config/summary update-remove record to a nested dict."""
    for item in record.update:
        if item.key:
            target[item.key] = _json(item.value_json)
        else:
            node = target
            for part in item.nested_key[:-1]:
                node = node.setdefault(part, {})
            node[item.nested_key[-1]] = _json(item.value_json)
    for item in record.remove:
        keys = [item.key] if item.key else list(item.nested_key)
        node = target
        for part in keys[:-1]:
            node = node.get(part, {})
        node.pop(keys[-1], None)


def run_file(run_dir: str | Path) -> Path:
    """The ``run-<id>.wandb`` file of a run folder (or the file itself)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return run_dir
    files = sorted(run_dir.glob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one run-*.wandb file in {run_dir}, found {len(files)}")
    return files[0]


def read_offline_run(run_dir: str | Path) -> dict:
    """One offline run folder as ``{"id", "name", "project", "group", "start_time", "config",
    "history": [{"_step": ..., key: value, ...}, ...], "summary", "exit_code", "dir"}``.

    Config: values as logged (nested dicts stay nested; W&B's internal ``_wandb`` key dropped).
    History: one dict per logged step, nested values flattened to ``"a.b"`` keys (a Table appears as
    ``"<key>._type": "table-file"``, ``"<key>.path"``, ... -- see :func:`load_table`).
    A file W&B is still writing (its exit record not yet there) is waited for, up to 30 s.
    """
    path = run_file(run_dir)
    if not wait_until_complete(path):
        logger.warning("%s has no exit record after 30 s; reading what is there", path)
    run: dict[str, Any] = {
        "id": None,
        "name": None,
        "project": None,
        "group": None,
        "start_time": None,
        "config": {},
        "history": [],
        "summary": {},
        "exit_code": None,
        "dir": str(path.parent),
    }
    for record in iter_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(
                id=r.run_id,
                name=r.display_name or None,
                project=r.project or None,
                group=r.run_group or None,
                start_time=r.start_time.seconds + r.start_time.nanos / 1e9
                if r.HasField("start_time")
                else None,
            )
            _apply(run["config"], r.config)
        elif kind == "config":
            _apply(run["config"], record.config)
        elif kind == "history":
            row = {_key(item): _history_value(item) for item in record.history.item}
            if "_step" not in row and record.history.HasField("step"):
                row["_step"] = record.history.step.num
            run["history"].append(row)
        elif kind == "summary":
            _apply(run["summary"], record.summary)
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    run["config"].pop("_wandb", None)
    return run


def find_offline_runs(directory: str | Path) -> list[Path]:
    """Offline run folders under ``<directory>/wandb/`` (or ``directory`` itself when it is the
    ``wandb`` folder), oldest first."""
    directory = Path(directory)
    base = directory if directory.name == "wandb" else directory / "wandb"

    def order(p: Path) -> tuple[str, int]:
        # offline-run-20260101_120000-<id>[-N]: timestamp first, then wandb's collision suffix N
        m = re.match(r"offline-run-(\d{8}_\d{6})-.*?(?:-(\d+))?$", p.name)
        return (m.group(1), int(m.group(2) or 0)) if m else (p.name, 0)

    return sorted((p for p in base.glob("offline-run-*") if p.is_dir()), key=order)


def read_offline_history(directory: str | Path, run_id: str | None = None) -> dict:
    """A run's segments merged (one per process that resumed it), as :func:`read_offline_run`.

    ``run_id`` defaults to the id of the newest segment. History rows are concatenated in segment
    order; a step that an earlier segment already has is dropped (as the W&B server does), and
    counted in ``"duplicate_steps"``. Config and summary: later segments update earlier ones.
    """
    folders = find_offline_runs(directory)
    if not folders:
        raise FileNotFoundError(f"no offline W&B runs under {Path(directory) / 'wandb'}")
    segments = [read_offline_run(f) for f in folders]
    run_id = run_id or segments[-1]["id"]
    segments = sorted((s for s in segments if s["id"] == run_id), key=lambda s: s["start_time"] or 0)
    if not segments:
        raise FileNotFoundError(f"no offline W&B run with id {run_id!r} under {directory}")
    merged = {
        **segments[-1],
        "config": {},
        "summary": {},
        "history": [],
        "duplicate_steps": 0,
        "segments": [s["dir"] for s in segments],
    }
    seen: set[int] = set()
    for seg in segments:
        merged["config"].update(seg["config"])
        merged["summary"].update(seg["summary"])
        for row in seg["history"]:
            if row.get("_step") in seen:
                merged["duplicate_steps"] += 1
                continue
            seen.add(row.get("_step"))
            merged["history"].append(row)
    return merged


def load_table(run: dict, row: dict, key: str) -> dict | None:
    """The ``{"columns": [...], "data": [[...], ...]}`` of a Table logged under ``key`` in a history
    ``row`` of ``run`` (from :func:`read_offline_run`), or None when the row has none."""
    rel = row.get(f"{key}.path")
    if rel is None:
        return None
    segments = run.get("segments", [run["dir"]])
    for seg in segments:
        path = Path(seg) / "files" / rel
        if path.exists():
            return json.loads(path.read_text(encoding="utf-8"))
    raise FileNotFoundError(f"table file {rel} not found in {segments}")
