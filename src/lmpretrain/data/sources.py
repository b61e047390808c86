"""Data sources: a `SourceSpec` (builtin name, local files, or Hub id), opened and divided into pieces.

Local files are read by our own small readers (data/readers.py): text and JSON Lines by byte offset,
parquet by row group, so any position is reached without re-reading what lies before it. A Hub dataset
whose config and split are parquet files (as 🤗 `datasets` resolves them: the repository's `configs:` or its
`data/<split>-*` layout, listed once per job by rank 0, pinned to a commit) is read the same way, by row group through
`hf://` paths; other Hub datasets stay 🤗 `datasets` streams (one piece per shard, restored by `skip()`). A source is divided into pieces for `num_streams` streams:
every file is one piece, except that a file holding more than 1/num_streams of the source's bytes is cut
into byte ranges (row-group runs for parquet) at record or document starts, so one big file feeds every
stream. Pieces depend only on the files and num_streams, never on the world size.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lmpretrain.config import BLANK_LINES, SourceSpec
from lmpretrain.data import readers
from lmpretrain.data.readers import Piece
from lmpretrain.data.token_files import MAX_OPEN_FILES, TokenFiles, is_token_folder
from lmpretrain.data.token_layouts import not_tokens_message
from lmpretrain.data.transforms import check_token_sources, join_segments
from lmpretrain.errors import DataError

OLD_TOKENS_META = "tokens_meta.json"  # marks a parquet token cache of lmpretrain <= 0.x (retired)
MIN_PIECE_BYTES = 1 << 16  # files are not cut into pieces smaller than this
_HUB_COMMIT = re.compile(r"^(hf://datasets/[^/]+/[^/@]+)@[^/]+/")  # hf://datasets/org/name@commit/...
_EXT_FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
}


def as_spec(source: SourceSpec | dict) -> SourceSpec:
    spec = source if isinstance(source, SourceSpec) else SourceSpec(**source)
    try:
        spec.validate()
    except ValueError as err:
        raise DataError(str(err)) from None
    return spec


def expand_files(patterns: list[str]) -> list[str]:
    """Files named by paths, globs and folders (recursively, hidden files skipped), sorted; missing → error."""
    files: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        matches = (
            sorted(glob.glob(pattern, recursive=True))
            if glob.has_magic(pattern)
            else ([pattern] if os.path.exists(pattern) else [])
        )
        if not matches:
            raise DataError(
                f"data file or glob {pattern!r} matches nothing (cwd: {os.getcwd()}); fix the path"
            )
        for match in matches:
            if os.path.isdir(match):
                inside = sorted(
                    str(p) for p in Path(match).rglob("*") if p.is_file() and not p.name.startswith(".")
                )
                if not inside:
                    raise DataError(f"data folder {match!r} contains no files")
                files.extend(inside)
            else:
                files.append(match)
    return list(dict.fromkeys(files))


def infer_format(files: list[str]) -> str:
    formats = set()
    for f in files:
        name = f.lower()
        fmt = next((v for ext, v in _EXT_FORMATS.items() if name.endswith(ext)), "text")
        formats.add(fmt)
    if len(formats) > 1:
        raise DataError(
            f"files of one source must share a format, got {sorted(formats)} in {files[:5]}...; "
            "split them into several sources or set `format`"
        )
    return formats.pop()


_TOKEN_KINDS = {
    "lmpretrain": "token files",
    "datatrove": "datatrove token files (.ds)",
    "megatron": "Megatron indexed dataset (.bin/.idx)",
}


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


class Source:
    """An opened source: its files (or Hub stream), how to cut it into pieces and how to read a piece."""

    def __init__(
        self,
        spec: SourceSpec,
        fmt: str,
        files: list[str] | None = None,
        dataset: Any = None,
        token_files: TokenFiles | None = None,
        sizes: list[int] | None = None,
    ):
        self.spec, self.format, self.dataset = spec, fmt, dataset
        self.token_files = token_files  # token-file folders (data/token_files.py)
        if token_files is not None:
            files = token_files.files()
        self.files = files or []
        self.sizes = sizes if sizes is not None else [_file_size(f) for f in self.files]
        self.tokens = fmt == "tokens"
        self.field = spec.text_field
        self.json_arrays = [
            fmt == "json" and f.endswith(".json") and readers.is_json_array(f) for f in self.files
        ]
        self._row_group_bytes: list[list[int]] = []
        self._pieces: dict[int, list[Piece]] = {}
        self.whole_documents = False  # read documents whole, for data.transforms (set by open_source)

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def is_hub(self) -> bool:
        """Read as a 🤗 datasets stream (a Hub dataset without parquet files)."""
        return self.dataset is not None

    @property
    def hub_parquet(self) -> bool:
        """A Hub dataset's parquet files, read by row group."""
        return self.spec.hub is not None and self.dataset is None

    def splittable(self, f: int) -> bool:
        # A transform sees whole documents: a file that is one document is not cut into pieces for it.
        one_document = self.whole_documents and self.format == "text" and self.spec.separator is None
        return not (self.files[f].endswith(".gz") or self.json_arrays[f] or one_document)

    def pieces(self, num_streams: int) -> list[Piece]:
        """The source's pieces for `num_streams` streams (cached): a function of the files and num_streams only."""
        if num_streams not in self._pieces:
            self._pieces[num_streams] = self._plan(num_streams)
        return self._pieces[num_streams]

    def _plan(self, num_streams: int) -> list[Piece]:
        if self.is_hub:
            return [Piece(i) for i in range(self.dataset.n_shards)]
        if self.token_files is not None:
            return self.token_files.pieces(num_streams)
        total = sum(self.sizes)
        pieces: list[Piece] = []
        for f, size in enumerate(self.sizes):
            if size == 0:
                continue
            k = max(1, min(math.ceil(num_streams * size / total), size // MIN_PIECE_BYTES))
            if k == 1 or not self.splittable(f):
                pieces.append(Piece(f))
                continue
            if self.format == "parquet":
                bounds = self._row_group_bounds(f, k)
            else:
                line_records = self.format == "json"
                cuts = (
                    readers.next_start(self.files[f], size * j // k, size, self.spec.separator, line_records)
                    for j in range(1, k)
                )
                bounds = sorted({0, size, *(c for c in cuts if c is not None)})
            pieces += [Piece(f, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        return pieces

    def _row_group_bounds(self, f: int, k: int) -> list[int]:
        """Row-group indices that cut file f into <= k runs of about equal bytes."""
        sizes = self._row_group_bytes[f]
        total, bounds, acc = sum(sizes), [0], 0
        for g, size in enumerate(sizes[:-1]):
            acc += size
            if acc >= total * len(bounds) / k:
                bounds.append(g + 1)
        return bounds + [len(sizes)]

    def read(self, piece: Piece, at: list[int] | None):
        """Units (and Bad records) of `piece` from position `at` (None: its start); documents whole (one unit
        each) when they are to be transformed."""
        items = self._read(piece, at)
        return join_segments(items) if self.whole_documents else items

    def locate(self, piece: Piece, at: list[int] | None) -> str:
        """Where the document that starts at position `at` of `piece` is, in words: file and line, or record."""
        if self.is_hub:
            return f"record {at[0] if at else 0} of shard {piece.file} of {self.label}"
        path = self.files[piece.file]
        if self.format in ("text", "json") and not self.json_arrays[piece.file]:
            return f"{path} line {readers.line_number(path, at[0] if at else piece.start)}"
        if self.format == "parquet":
            group, row = at if at else (piece.start, 0)
            return f"{path} row group {group} row {row}"
        return f"{path} record {at[0] if at else 0}"

    def _read(self, piece: Piece, at: list[int] | None):
        if self.is_hub:
            n = self.dataset.n_shards
            return readers.read_datasets_shard(
                self.dataset, n, piece.file, at, self.field, self.describe(piece)
            )
        if self.token_files is not None:
            return self.token_files.units(piece, at)
        path = self.files[piece.file]
        if self.format == "parquet":
            return readers.read_parquet(path, piece, at, self.field)
        if self.format == "json":
            if self.json_arrays[piece.file]:
                return readers.read_json_array(path, at, self.field)
            return readers.read_json_lines(path, piece, at, self.field)
        return readers.read_text(path, piece, self.sizes[piece.file], at, self.spec.separator)

    def describe(self, piece: Piece) -> str:
        if self.is_hub:
            return f"shard {piece.file} of {self.label}"
        path = self.files[piece.file]
        if piece.end is None and piece.start == 0:
            return path
        if self.token_files is not None:
            return f"{path} (documents {piece.start}-{piece.end})"
        unit = "row groups" if self.format == "parquet" else "bytes"
        return f"{path} ({unit} {piece.start}-{piece.end})"

    def summary(self, num_streams: int) -> str:
        """What the source is and how it is read, for the start-up log."""
        if self.is_hub:
            return (
                f"{self.label}: 🤗 datasets stream (no parquet files), {self.dataset.n_shards} shards (a "
                "restore re-streams its shard up to the position)"
            )
        if self.token_files is not None:
            kind = (
                f"{_TOKEN_KINDS[self.token_files.format]}, {self.token_files.tokens:,} tokens in "
                f"{self.token_files.documents:,} documents, one stream across its shards"
            )
        else:
            kind = {
                "text": {
                    None: "one document per file",
                    BLANK_LINES: "documents separated by blank lines",
                }.get(self.spec.separator, f"documents separated by {self.spec.separator!r}"),
                "json": f"JSON records, field {self.field!r}",
                "parquet": f"parquet, column {self.field!r}",
            }[self.format]
        n = len(self.files)
        where = (
            " on the Hub, read by row group (a restore seeks to its row group)" if self.hub_parquet else ""
        )
        return (
            f"{self.label}: {self.format}, {n} file{'s' * (n != 1)}{where}, {_mb(sum(self.sizes))}, {kind}; "
            f"{len(self.pieces(num_streams))} pieces"
        )

    def fingerprint(self) -> dict:
        """The spec plus the expanded file list (count, bytes, hash of names and sizes): files added under a glob
        count. Hub files count without their commit: any commit to the repository (a README edit) moves it.
        Token files prepared with data.transforms add the transforms their header records."""
        names = [_HUB_COMMIT.sub(r"\1/", f) for f in self.files]
        listing = json.dumps([[f, s] for f, s in zip(names, self.sizes, strict=True)])
        files = {
            "count": len(self.files),
            "bytes": sum(self.sizes),
            "sha256": hashlib.sha256(listing.encode()).hexdigest()[:16],
        }
        prepared = self.token_files.layouts[0].header.get("transforms") if self.token_files else None
        # (only when there are some: fingerprints of runs on token files without them stay as they were)
        return {**asdict(self.spec), "expanded": files, **({"transforms": prepared} if prepared else {})}


def open_source(spec: SourceSpec | dict, transforms=None, max_open_files: int = MAX_OPEN_FILES) -> Source:
    """Open a source; checks files, format and field before any work. With `transforms` (data.transforms,
    data/transforms.py) a text source is read in whole documents; token sources are read as prepared, with
    at most `max_open_files` descriptors per process."""
    source = _open_source(as_spec(spec), max_open_files)
    source.whole_documents = bool(transforms) and not source.tokens
    return source


def _open_source(spec: SourceSpec, max_open_files: int) -> Source:
    if spec.hub:
        return _open_hub(spec)
    if spec.name:
        from lmpretrain.data.corpus import BUILTIN_DATASETS, BUILTIN_TOKEN_FILES

        if spec.name not in BUILTIN_DATASETS:
            raise DataError(f"unknown builtin dataset {spec.name!r}; available: {sorted(BUILTIN_DATASETS)}")
        if spec.format == "tokens":  # its token files, prepared once with the builtin tokenizer
            folder = BUILTIN_TOKEN_FILES[spec.name](spec.split)
            return Source(spec, "tokens", token_files=TokenFiles([folder], max_open_files))
        files, fmt = BUILTIN_DATASETS[spec.name](spec.split), "json"
    elif spec.format in ("tokens", None) and any(map(is_token_folder, spec.files or [])):
        return _open_token_files(spec, max_open_files)
    elif spec.format == "tokens" or _looks_like_token_files(spec.files or []):
        # A token folder missing its header, the old parquet token cache, or a path that is not token files.
        problems = [m for m in map(not_tokens_message, spec.files or []) if m]
        raise DataError(f"source {spec.label}: " + "; ".join(problems))
    else:
        files = expand_files(spec.files)
        fmt = spec.format or infer_format(files)
    if spec.separator is not None and fmt != "text":
        raise DataError(f"source {spec.label}: separator applies to text files only, these are {fmt}")
    source = Source(spec, fmt, files)
    if not sum(source.sizes):
        raise DataError(f"source {spec.label}: empty corpus, all {len(files)} file(s) are empty")
    if fmt == "parquet":
        _check_parquet(source)
    elif fmt == "json":
        _check_json_field(source)
    return source


def _file_size(path: str) -> int:
    if not readers.is_url(path):
        return os.path.getsize(path)
    import fsspec

    fs, inner = fsspec.core.url_to_fs(path)
    return int(fs.size(inner))


def _looks_like_token_files(paths: list[str]) -> bool:
    """A folder of .bin / .ds.index files that no token layout claims: not to be read as text."""
    folders = [Path(os.path.expanduser(p)) for p in paths if os.path.isdir(os.path.expanduser(p))]
    return any(next(f.glob("*.bin"), None) or next(f.glob("*.ds.index"), None) for f in folders)


def _open_token_files(spec: SourceSpec, max_open_files: int = MAX_OPEN_FILES) -> Source:
    """A source over token layouts (data/token_layouts.py: lmpretrain token files, datatrove folders,
    Megatron prefixes); every path must be one."""
    others = [f for f in spec.files if not is_token_folder(f)]
    if len(others) == len(spec.files):
        raise DataError(
            f"source {spec.label}: format tokens, but {others} hold no tokens.json: not token files (write "
            "them with scripts/prepare_data.py)"
        )
    if others:
        raise DataError(
            f"source {spec.label}: {others} are not token files (no tokens.json, datatrove .ds or Megatron "
            ".idx) while the other paths are; give token files and other files as separate sources"
        )
    if spec.separator is not None:
        raise DataError(f"source {spec.label}: separator applies to text files only, these are token files")
    return Source(spec, "tokens", token_files=TokenFiles(spec.files, max_open_files))


def _open_hub(spec: SourceSpec) -> Source:
    """A Hub dataset: its split's parquet files read by row group when it has them, else a datasets stream."""
    from datasets import load_dataset_builder  # heavy import, only where a Hub dataset is really opened

    from lmpretrain.progress import announce
    from lmpretrain.run.downloads import on_rank_zero  # (lmpretrain.run imports the data package)

    announce(f"opening Hub dataset {spec.hub} (resolving its files over the network)")
    listing = on_rank_zero(lambda: _list_hub_parquet(spec))
    if listing is not None:
        source = Source(spec, "parquet", listing["files"], sizes=listing["sizes"])
        source._row_group_bytes = listing["row_groups"]
        return source
    try:
        ds = load_dataset_builder(spec.hub, spec.hub_config).as_streaming_dataset(split=spec.split)
    except DataError:
        raise
    except Exception as e:
        raise _hub_error(spec, e) from e
    return datasets_source(spec, ds)


def _hub_error(spec: SourceSpec, e: Exception) -> DataError:
    return DataError(
        f"could not open Hub dataset {spec.hub!r} (config {spec.hub_config!r}, split {spec.split!r}): "
        f"{type(e).__name__}: {e}. Check the id and the network, or use local `files`"
    )


def _list_hub_parquet(spec: SourceSpec) -> dict | None:
    """A Hub dataset's parquet files of the split, their sizes and row-group sizes (footers read); None when
    it has none (a 🤗 datasets stream)."""
    from datasets import load_dataset_builder

    try:
        # The same resolution of config and split to files as load_dataset's.
        builder = load_dataset_builder(spec.hub, spec.hub_config)
        files = (builder.config.data_files or {}).get(spec.split)
        if builder.name != "parquet" or not files:
            return None
        source = Source(spec, "parquet", list(files))
        _check_parquet(source)
    except DataError:
        raise
    except Exception as e:
        raise _hub_error(spec, e) from e
    return {"files": source.files, "sizes": source.sizes, "row_groups": source._row_group_bytes}


def datasets_source(spec: SourceSpec, dataset) -> Source:
    """A source over a streaming 🤗 `IterableDataset` (how Hub sources are read)."""
    if dataset.features is not None and spec.text_field not in dataset.features:
        raise DataError(
            f"{spec.label}: no field {spec.text_field!r} (fields: {sorted(dataset.features)}); set `text_field` "
            f"of source {spec.label} to the column holding the text"
        )
    if dataset.n_shards < 1:
        raise DataError(f"source {spec.label} has no shards (empty corpus)")
    return Source(spec, "hub", dataset=dataset)


def _no_field(source: Source, path: str, fields) -> DataError:
    return DataError(
        f"{path}: no field {source.field!r} (fields: {sorted(fields)}); set `text_field` of source "
        f"{source.label} to the column holding the text"
    )


def _check_parquet(source: Source) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in source.files:
        try:
            with readers.open_seekable(path) as f:  # the footer is all that is read
                pf = pq.ParquetFile(f)
                schema, meta = pf.schema_arrow, pf.metadata
        except Exception as e:
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
        if source.field not in schema.names:
            raise _no_field(source, path, schema.names)
        kind = schema.field(source.field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(f"{path}: column {source.field!r} holds {kind}, not strings; set `text_field`")
        source._row_group_bytes.append(
            [max(1, meta.row_group(g).total_byte_size) for g in range(meta.num_row_groups)]
        )


def _check_json_field(source: Source) -> None:
    """The first record of the first non-empty JSON Lines file must have the text field (a config mistake
    then fails at once); later records without it are bad records."""
    for path, array in zip(source.files, source.json_arrays, strict=True):
        if array:
            continue
        with readers.open_bytes(path) as f:
            for line in f:
                if line.strip():
                    try:
                        record = json.loads(line)
                    except ValueError:
                        return  # a bad record: skipped and counted when read
                    if isinstance(record, dict) and source.field not in record:
                        raise _no_field(source, path, record)
                    return


def is_old_token_cache(path: str) -> bool:
    """A folder of the retired parquet token cache (tokens-*.parquet + tokens_meta.json)."""
    return (Path(os.path.expanduser(path)) / OLD_TOKENS_META).is_file()


def open_sources(
    specs: list[SourceSpec | dict],
    tokenizer,
    transforms=None,
    max_open_files: int = MAX_OPEN_FILES,
    tokenizer_name: str = "<data.tokenizer>",
) -> list[Source]:
    """Open every source; token files must come from this tokenizer. `transforms` (data.transforms,
    data/transforms.py) apply to the text sources; token sources must have been prepared with them
    (`check_token_sources`: else refused, naming the prepare command, with `tokenizer_name`)."""
    if not specs:
        raise DataError("no data sources given (data.train or data.eval is empty)")
    opened = [open_source(s, transforms, max_open_files) for s in specs]
    check_token_sources(opened, transforms, tokenizer_name)
    for src in opened:
        if src.token_files is not None:
            from lmpretrain.data.token_files import check_tokenizer

            check_tokenizer(src.token_files, tokenizer, src.label)
    return opened
