"""The token layouts a `format: tokens` source reads, each listed as shards of flat token ids plus where
each shard's document bounds are:

- lmpretrain token files: a folder with `tokens.json` (written by scripts/prepare_data.py), shards
  `shard-*.bin` and `.idx` (uint64 document starts, then the length);
- datatrove's `DocumentTokenizer` output: a folder of `*.ds` (uint16 or uint32 ids), `*.ds.index`
  (uint64 document ends) and `*.ds.metadata` (`tokenizer|token size`, token count);
- a Megatron indexed dataset (as datatrove's `MegatronDocumentTokenizer` and Megatron-LM write it): a
  prefix P with `P.bin` and `P.idx` (`MMIDIDX` header, then int32 lengths, int64 byte pointers and the
  document index), or a folder of such pairs.

Only the listing happens here (headers and file sizes, nothing of the token arrays); `TokenFiles` reads.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmpretrain.errors import DataError

HEADER = "tokens.json"
VERSION = 1
OLD_CACHE_META = "tokens_meta.json"  # the retired parquet token cache of data/prepare.py
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_DTYPES = {8: "<u2", 4: "<i4"}  # Megatron's dtype codes for uint16 and int32 (what datatrove writes)
FORMATS = ("lmpretrain", "datatrove", "megatron")


@dataclass
class Shard:
    bin: str  # the token ids
    tokens: int
    documents: int
    index: str  # the file holding the document bounds
    kind: str  # "starts" (documents + 1 token offsets) | "ends" (one end per document) | "megatron"
    index_offset: int = 0  # bytes before the bounds' values in `index` (megatron: its byte pointers)


@dataclass
class Layout:
    """One path of a source: its format, dtype, shards and what it says about the tokenizer."""

    path: str
    format: str  # one of FORMATS
    dtype: np.dtype
    shards: list[Shard]
    tokenizer: str = ""  # the name it was written with ("" when the layout does not say)
    tokenizer_hash: str | None = None  # lmpretrain token files only
    add_bos: bool | None = None  # None: found from the data (the first document's first token)
    max_id: int | None = None  # None: not recorded, scanned when the source is checked
    header: dict = field(default_factory=dict)


def detect(path: str | os.PathLike) -> str | None:
    """The token layout at `path`, or None when it is not one."""
    p = Path(os.path.expanduser(path))
    if (p / HEADER).is_file():
        return "lmpretrain"
    if p.is_dir() and any(p.glob("*.ds")):
        return "datatrove"
    if _is_megatron_idx(Path(f"{p}.idx")) and Path(f"{p}.bin").is_file():
        return "megatron"
    if p.is_dir() and any(_is_megatron_idx(i) for i in p.glob("*.idx")):
        return "megatron"
    return None


def _is_megatron_idx(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MEGATRON_MAGIC)) == MEGATRON_MAGIC


def not_tokens_message(path: str) -> str | None:
    """Why a path given as `format: tokens` is not token files, and what to do; None when it is."""
    p = Path(os.path.expanduser(path))
    if detect(p):
        return None
    folder = p if p.is_dir() else p.parent  # the folder, or the folder of a file of it
    if (folder / OLD_CACHE_META).is_file() or any(folder.glob("*.parquet")):
        meta = folder / OLD_CACHE_META
        tok = (json.loads(meta.read_text()).get("tokenizer") if meta.is_file() else None) or "<its tokenizer>"
        return (
            f"{path} is a parquet token cache of an older lmpretrain ({OLD_CACHE_META}), which `format: tokens` "
            f"no longer reads; convert it into token files with: python scripts/prepare_data.py --files {path} "
            f"--tokenizer {tok} --out {path.rstrip('/')}-tok (then train on that folder)"
        )
    if p.is_dir() and any(p.glob("*.bin")):
        return (
            f"{path} holds .bin files but no {HEADER} (lmpretrain), *.ds files (datatrove) or Megatron .idx "
            "files: its header or sidecar is missing (an interrupted prepare?); prepare it again with "
            "scripts/prepare_data.py"
        )
    if p.is_dir() and any(p.glob("*.ds.index")):
        return f"{path} holds datatrove .ds.index files but no .ds token files: the folder is incomplete"
    return (
        f"{path} is not token files: no {HEADER} (scripts/prepare_data.py), no *.ds files (datatrove) and no "
        "Megatron PREFIX.bin/PREFIX.idx; give such a folder or prefix, or drop `format: tokens` for text"
    )


def open_layout(path: str) -> Layout:
    """List the shards at `path` (a token layout, see the module docstring), checking every file's size."""
    kind = detect(path)
    if kind is None:
        raise DataError(not_tokens_message(path))
    layout = {"lmpretrain": _lmpretrain, "datatrove": _datatrove, "megatron": _megatron}[kind](path)
    for shard in layout.shards:
        size = os.path.getsize(shard.bin) if os.path.exists(shard.bin) else -1
        if size != shard.tokens * layout.dtype.itemsize:
            raise DataError(
                f"token file {shard.bin} has {size} bytes, its index says {shard.tokens} tokens of "
                f"{layout.dtype}; the file is truncated or damaged: prepare it again"
            )
    if not layout.shards:
        raise DataError(f"{path}: token files with no shard")
    return layout


def _lmpretrain(path: str) -> Layout:
    folder = os.path.expanduser(path)
    header = json.loads((Path(folder) / HEADER).read_text())
    if header.get("version") != VERSION:
        raise DataError(
            f"{folder}/{HEADER}: token files of layout version {header.get('version')}, this lmpretrain reads "
            f"version {VERSION}; prepare them again with scripts/prepare_data.py"
        )
    shards = []
    for s in header["shards"]:
        base = os.path.join(folder, s["name"])
        idx = base + ".idx"
        want = 8 * (s["documents"] + 1)
        if not os.path.exists(idx) or os.path.getsize(idx) != want:
            raise DataError(
                f"token index {idx} is missing or truncated (want {want} bytes): prepare it again"
            )
        shards.append(Shard(base + ".bin", int(s["tokens"]), int(s["documents"]), idx, "starts"))
    return Layout(
        path,
        "lmpretrain",
        np.dtype(header["dtype"]),
        shards,
        tokenizer=header.get("tokenizer", ""),
        tokenizer_hash=header["tokenizer_hash"],
        add_bos=bool(header["add_bos"]),
        max_id=int(header["max_id"]),
        header=header,
    )


def _datatrove(path: str) -> Layout:
    folder = Path(os.path.expanduser(path))
    shards, names, sizes = [], set(), set()
    for ds in sorted(folder.glob("*.ds")):
        index, meta = Path(f"{ds}.index"), Path(f"{ds}.metadata")
        if not index.is_file():
            raise DataError(
                f"datatrove token file {ds} has no {index.name} (document ends): tokenize with save_index=True"
            )
        if not meta.is_file():
            raise DataError(
                f"datatrove token file {ds} has no {meta.name} (tokenizer and token size): tokenize with "
                "save_final_metadata=True (the default)"
            )
        name, _, size = meta.read_text().splitlines()[0].rpartition("|")
        names.add(name)
        sizes.add(int(size))
        docs = os.path.getsize(index) // 8
        ends = np.fromfile(index, dtype="<u8", count=1, offset=8 * (docs - 1)) if docs else [0]
        shards.append(Shard(str(ds), int(ends[0]), docs, str(index), "ends"))
    if len(names) > 1 or len(sizes) > 1:
        raise DataError(
            f"{path}: datatrove files of several tokenizers or token sizes ({sorted(names)}, {sizes})"
        )
    size = sizes.pop()
    if size not in (2, 4):
        raise DataError(f"{path}: datatrove token size {size} bytes; lmpretrain reads 2 and 4")
    dtype = np.dtype("<u2" if size == 2 else "<u4")
    return Layout(path, "datatrove", dtype, [s for s in shards if s.documents], tokenizer=names.pop())


def _megatron(path: str) -> Layout:
    p = Path(os.path.expanduser(path))
    prefixes = [p] if Path(f"{p}.idx").is_file() else sorted(i.with_suffix("") for i in p.glob("*.idx"))
    shards, dtypes = [], set()
    for prefix in prefixes:
        idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
        with open(idx, "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != MEGATRON_MAGIC:
            raise DataError(f"{idx}: not a Megatron index (no MMIDIDX header)")
        (version,) = struct.unpack("<Q", head[9:17])
        code = head[17]
        sequences, doc_entries = struct.unpack("<QQ", head[18:34])
        if version != 1 or code not in _MEGATRON_DTYPES:
            raise DataError(
                f"{idx}: Megatron index version {version}, dtype code {code}; lmpretrain reads version 1 "
                "with uint16 (8) or int32 (4) tokens"
            )
        dtype = np.dtype(_MEGATRON_DTYPES[code])
        dtypes.add(dtype.str)
        want = 34 + 4 * sequences + 8 * sequences + 8 * doc_entries
        if os.path.getsize(idx) != want:
            raise DataError(f"Megatron index {idx} has {os.path.getsize(idx)} bytes, want {want}: truncated")
        lengths = np.fromfile(idx, dtype="<i4", count=sequences, offset=34)
        tokens = int(lengths.sum(dtype=np.int64))
        if not Path(bin_).is_file():
            raise DataError(f"Megatron prefix {prefix}: {bin_} is missing")
        # The byte pointers of the sequences (one per document, as datatrove writes them) bound the documents.
        shards.append(Shard(bin_, tokens, int(sequences), idx, "megatron", 34 + 4 * sequences))
    if len(dtypes) > 1:
        raise DataError(f"{path}: Megatron files of several dtypes {sorted(dtypes)}")
    return Layout(path, "megatron", np.dtype(dtypes.pop()), [s for s in shards if s.documents])
