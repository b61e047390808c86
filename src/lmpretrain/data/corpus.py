"""The default corpus: the Python standard library's own source, one document per file.

Every machine with Python has it, so the quickstart and the tests need no download. It is written
once into the cache as JSONL shards (train split by file, ~2% validation) and reused after that, in a
seeded random order across and within shards (files sorted by path would make every stream read one
package after another: a curriculum, not i.i.d. data). Building is safe when several processes start at
once (file lock + temp dir + atomic rename + completion marker).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from lmpretrain.errors import DataError
from lmpretrain.progress import announce, bar

logger = logging.getLogger(__name__)

CORPUS_VERSION = 2  # 2: documents in a seeded random order across and within shards
CORPUS_SEED = 0
COMPLETE_MARKER = "_COMPLETE"
NUM_TRAIN_SHARDS = 32
NUM_VALIDATION_SHARDS = 2
VALIDATION_PER_MILLE = 20  # ~2% of files
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}

# Number of builds this process performed (lets a test check that concurrent callers build once).
BUILDS = 0


def cache_root() -> Path:
    """`$LMPRETRAIN_CACHE`, or `~/.cache/lmpretrain`."""
    return Path(os.environ.get("LMPRETRAIN_CACHE") or "~/.cache/lmpretrain").expanduser()


def python_tag() -> str:
    return f"py{sys.version_info.major}.{sys.version_info.minor}"


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """Return `final`, running `build(tmp_dir)` first if no complete copy exists.

    Concurrent callers (threads or processes) serialise on a lock file; the first builds into a
    temporary folder that is renamed into place only once complete, the others wait and reuse it.
    """
    global BUILDS
    final = Path(final)
    if (final / COMPLETE_MARKER).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            announce(f"waiting for another process to finish building {final}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (final / COMPLETE_MARKER).exists():
                return final
            if final.exists():  # left by a build that died before its marker was written
                shutil.rmtree(final)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
            try:
                start = time.time()
                build(tmp)
                (tmp / COMPLETE_MARKER).write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            BUILDS += 1
            logger.info("built %s in %.1fs", final, time.time() - start)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def stdlib_source_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every `.py` file of the standard library, sorted; no site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def is_validation(rel_path: str) -> bool:
    """Stable split by file: a hash of the relative path, never Python's salted `hash`."""
    digest = hashlib.blake2b(rel_path.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1000 < VALIDATION_PER_MILLE


def _shuffled_shards(docs: list[dict], num_shards: int, seed: int) -> list[list[dict]]:
    """Documents in a seeded random order, each put in the shard with the fewest bytes so far (the few
    very large ones first, so shards stay within ~10% of each other in size), then each shard shuffled."""
    rng = random.Random(seed)
    order = sorted(docs, key=lambda d: d["path"])
    rng.shuffle(order)
    limit = sum(len(d["text"]) for d in docs) / num_shards / 8
    large = sorted((d for d in order if len(d["text"]) > limit), key=lambda d: -len(d["text"]))
    shards: list[list[dict]] = [[] for _ in range(num_shards)]
    sizes = [0] * num_shards
    for doc in large + [d for d in order if len(d["text"]) <= limit]:
        i = min(range(num_shards), key=lambda k: (sizes[k], k))
        shards[i].append(doc)
        sizes[i] += len(doc["text"])
    for shard in shards:
        rng.shuffle(shard)
    return shards


def _build_stdlib(out: Path, max_files: int | None = None) -> None:
    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    skipped = {"not_utf8": 0, "empty": 0}
    files = stdlib_source_files()[:max_files]
    announce(f"building the python-stdlib corpus from {len(files)} files (once; cached in {cache_root()})")
    progress = bar(desc="reading the standard library", unit="file", total=len(files))
    for rel, path in files:
        progress.update(1)
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # a few test fixtures use legacy encodings on purpose
            skipped["not_utf8"] += 1
            continue
        if not text.strip():
            skipped["empty"] += 1
            continue
        splits["validation" if is_validation(rel) else "train"].append({"text": text, "path": rel})
    progress.close()
    manifest = {
        "version": CORPUS_VERSION,
        "order_seed": CORPUS_SEED,
        "python": sys.version,
        "stdlib": sysconfig.get_paths()["stdlib"],
        "skipped": skipped,
        "splits": {},
    }
    for split, num_shards in (("train", NUM_TRAIN_SHARDS), ("validation", NUM_VALIDATION_SHARDS)):
        docs = splits[split]
        for i, shard in enumerate(_shuffled_shards(docs, num_shards, CORPUS_SEED)):
            with open(out / f"{split}-{i:05d}-of-{num_shards:05d}.jsonl", "w", encoding="utf-8") as f:
                for doc in shard:
                    f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        manifest["splits"][split] = {
            "files": len(docs),
            "bytes": sum(len(d["text"].encode()) for d in docs),
            "shards": num_shards,
        }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))


def ensure_stdlib_corpus(max_files: int | None = None) -> Path:
    """Folder of the default corpus, built on first use. `max_files` makes a small copy (tests)."""
    name = f"python-stdlib-{python_tag()}-v{CORPUS_VERSION}"
    if max_files is not None:
        name += f"-first{max_files}"
    return build_once(cache_root() / name, lambda tmp: _build_stdlib(tmp, max_files))


def stdlib_split_files(split: str) -> list[str]:
    """The JSONL shards of one split ("train" or "validation") of the default corpus."""
    if split not in ("train", "validation"):
        raise DataError(f"python-stdlib has splits 'train' and 'validation', not {split!r}")
    return [str(p) for p in sorted(ensure_stdlib_corpus().glob(f"{split}-*.jsonl"))]


def stdlib_token_folder(split: str) -> str:
    """The token-file folder of one split of the default corpus with the builtin tokenizer (what
    `{name: python-stdlib, format: tokens}` reads), prepared once into the cache on first use."""
    from lmpretrain.data.prepare import write_token_files
    from lmpretrain.data.tokenizer import BUILTIN_PREFIX, load_tokenizer, tokenizer_hash

    stdlib_split_files(split)  # checks the split name; builds the corpus on first use
    tokenizer = load_tokenizer(f"{BUILTIN_PREFIX}python-stdlib")
    name = f"python-stdlib-{python_tag()}-v{CORPUS_VERSION}-tokens-{tokenizer_hash(tokenizer)}"

    def build(tmp: Path) -> None:
        announce(f"preparing the python-stdlib corpus into token files (once; cached in {cache_root()})")
        for part in ("train", "validation"):
            spec = {"name": "python-stdlib", "split": part}
            write_token_files(spec, tokenizer, tmp / part, tasks=os.cpu_count() or 1)

    return str(build_once(cache_root() / name, build) / split)


# Builtin datasets by name: split name -> list of JSONL files ({"text": ...}), built on first use; and
# split name -> its token-file folder (`format: tokens`).
BUILTIN_DATASETS: dict[str, Callable[[str], list[str]]] = {"python-stdlib": stdlib_split_files}
BUILTIN_TOKEN_FILES: dict[str, Callable[[str], str]] = {"python-stdlib": stdlib_token_folder}
