"""Data sources: a `SourceSpec` (builtin name, local files, or Hub id) opened as a 🤗 `datasets` stream.

Local files and Hub datasets take the same path: `load_dataset(..., streaming=True)` gives an
`IterableDataset` with `n_shards`; one shard (`ds.shard(num_shards=n_shards, index=i)`) is the unit
the virtual streams divide among themselves.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmpretrain.errors import DataError

logger = logging.getLogger(__name__)

TOKENS_FIELD = "input_ids"  # column of pre-tokenized parquet shards (scripts/prepare_data.py)
TOKENS_META = "tokens_meta.json"
_FORMATS = ("text", "json", "parquet", "tokens")
_EXT_FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
}


@dataclass
class SourceSpec:
    name: str | None = None  # builtin registry entry, e.g. "python-stdlib"
    files: list[str] | None = None  # local files/globs/dirs (text: .txt/.md/.py..., json/jsonl, parquet)
    hub: str | None = None  # Hub dataset id (real path; unreachable offline)
    hub_config: str | None = None
    split: str = "train"
    format: str | None = None  # "text" | "json" | "parquet" | "tokens"; inferred from extension when None
    text_field: str = "text"
    weight: float = 1.0  # mixing weight among train sources

    @property
    def label(self) -> str:
        if self.name:
            return f"{self.name}:{self.split}"
        if self.hub:
            return f"hub:{self.hub}" + (f"/{self.hub_config}" if self.hub_config else "") + f":{self.split}"
        return "files:" + ",".join(self.files or [])

    def validate(self) -> None:
        given = [k for k in ("name", "files", "hub") if getattr(self, k)]
        if len(given) != 1:
            raise DataError(
                f"a data source needs exactly one of name/files/hub, got {given or 'none'}: {self}"
            )
        if self.format is not None and self.format not in _FORMATS:
            raise DataError(f"source {self.label}: format {self.format!r} is not one of {_FORMATS}")
        if not self.weight > 0:
            raise DataError(f"source {self.label}: weight must be > 0, got {self.weight}")
        if isinstance(self.files, str):
            raise DataError(f"source files must be a list of paths/globs, got the string {self.files!r}")


def as_spec(source: SourceSpec | dict) -> SourceSpec:
    spec = source if isinstance(source, SourceSpec) else SourceSpec(**source)
    spec.validate()
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
                    str(p)
                    for p in Path(match).rglob("*")
                    if p.is_file() and not p.name.startswith(".") and p.name != TOKENS_META
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


@dataclass
class Source:
    """An opened source: the streaming dataset plus what is needed to read and describe its shards."""

    spec: SourceSpec
    dataset: Any  # datasets.IterableDataset
    field: str
    files: list[str] | None  # one file per shard when known (local files)
    tokens: bool = False  # documents are token id lists (pre-tokenized), not text

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def n_shards(self) -> int:
        return self.dataset.n_shards

    def describe_shard(self, index: int) -> str:
        if self.files and len(self.files) == self.n_shards:
            return self.files[index]
        return f"shard {index} of {self.label}"

    def iter_shard(self, index: int, start: int = 0) -> Iterator[Any]:
        """Values of the text (or token) field of shard `index`, from its `start`-th record on."""
        unit = self.dataset.shard(num_shards=self.n_shards, index=index)
        if start:
            unit = unit.skip(start)
        if self.dataset.features is not None:
            unit = unit.select_columns([self.field])  # decode only the column we use
        where = self.describe_shard(index)
        try:
            # `.iter` rather than `for record in unit`: inside a DataLoader worker, `IterableDataset.__iter__`
            # splits the shards among workers itself, but each stream here owns its shards explicitly.
            for batch in unit.iter(batch_size=16):
                if self.field not in batch:
                    raise DataError(
                        f"{where}: records have no field {self.field!r} (fields: {sorted(batch)}); "
                        f"set `text_field` of source {self.label}"
                    )
                yield from batch[self.field]
        except UnicodeDecodeError as e:
            raise DataError(
                f"{where}: not valid UTF-8 ({e}); convert it to UTF-8 or remove it from the source"
            ) from e


def open_source(spec: SourceSpec | dict) -> Source:
    """Open a source as a streaming `IterableDataset`; checks files, format and field before any work."""
    from datasets import load_dataset  # heavy import, only where data is really opened

    spec = as_spec(spec)
    files: list[str] | None = None
    if spec.hub:
        try:
            ds = load_dataset(spec.hub, spec.hub_config, split=spec.split, streaming=True)
        except Exception as e:
            raise DataError(
                f"could not open Hub dataset {spec.hub!r} (config {spec.hub_config!r}, split "
                f"{spec.split!r}): {type(e).__name__}: {e}. Check the id and the network, or use "
                "local `files`"
            ) from e
        return _checked(Source(spec, ds, spec.text_field, None))

    if spec.name:
        from lmpretrain.corpus import BUILTIN_DATASETS

        if spec.name not in BUILTIN_DATASETS:
            raise DataError(f"unknown builtin dataset {spec.name!r}; available: {sorted(BUILTIN_DATASETS)}")
        files = BUILTIN_DATASETS[spec.name](spec.split)
        fmt = "json"
    else:
        files = expand_files(spec.files)
        fmt = spec.format or infer_format(files)
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"source {spec.label}: empty corpus, all {len(files)} file(s) are empty")

    field = spec.text_field
    kwargs: dict[str, Any] = {}
    builder = fmt
    if fmt == "text":
        kwargs["sample_by"] = "document"  # one document per file, not one per line
        field = "text"
    elif fmt == "json":
        kwargs["chunksize"] = 1 << 20  # bytes read per step; each open stream holds one chunk (flat memory)
    elif fmt == "tokens":
        builder, field = "parquet", TOKENS_FIELD
    try:
        ds = load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)
    except UnicodeDecodeError as e:
        raise DataError(f"source {spec.label}: a file is not valid UTF-8 ({e}); files: {files[:5]}") from e
    except Exception as e:
        raise DataError(
            f"source {spec.label}: could not read {files[:3]} as {fmt}: {type(e).__name__}: {e}"
        ) from e
    return _checked(Source(spec, ds, field, files, tokens=fmt == "tokens"))


def _checked(source: Source) -> Source:
    features = source.dataset.features
    if features is not None and source.field not in features:
        where = source.files[0] if source.files else source.label
        raise DataError(
            f"{where}: no field {source.field!r} (fields: {sorted(features)}); set `text_field` "
            f"of source {source.label} to the column holding the text"
        )
    if source.n_shards < 1:
        raise DataError(f"source {source.label} has no shards (empty corpus)")
    return source


def read_tokens_meta(source: Source) -> dict | None:
    """Metadata written next to pre-tokenized shards (tokenizer hash), if any."""
    if not source.files:
        return None
    meta = Path(source.files[0]).parent / TOKENS_META
    return json.loads(meta.read_text()) if meta.exists() else None


def spec_dict(spec: SourceSpec) -> dict:
    return asdict(spec)
