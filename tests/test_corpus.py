"""The default corpus: the standard library's source, split by file, in a seeded random order, built once
even under concurrency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lmpretrain.data import SourceSpec, open_source
from lmpretrain.data.corpus import BUILTIN_DATASETS, ensure_stdlib_corpus, is_validation


def _paths(files) -> list[str]:
    return [json.loads(line)["path"] for f in files for line in open(f, encoding="utf-8")]


def test_split_is_by_file_without_overlap(stdlib_cache):
    folder = ensure_stdlib_corpus()
    train, val = BUILTIN_DATASETS["python-stdlib"]("train"), BUILTIN_DATASETS["python-stdlib"]("validation")
    assert len(train) == 32 and len(val) == 2
    assert Path(train[0]).name == "train-00000-of-00032.jsonl"
    train_paths, val_paths = _paths(train), _paths(val)
    assert len(train_paths) == len(set(train_paths)) > 1000
    assert not set(train_paths) & set(val_paths)
    assert all(is_validation(p) for p in val_paths) and not any(is_validation(p) for p in train_paths)
    assert 0.01 < len(val_paths) / (len(train_paths) + len(val_paths)) < 0.04
    assert not any("site-packages" in p for p in train_paths + val_paths)
    sizes = [os.path.getsize(f) for f in train]
    assert max(sizes) < 1.2 * min(sizes)  # balanced by size
    # Seeded random order across and within shards: neighbours rarely come from the same package (in path
    # order nearly all would), and every shard holds many packages.
    package = lambda p: p.split("/")[0]  # noqa: E731
    shards = [_paths([f]) for f in train]
    pairs = [(a, b) for paths in shards for a, b in zip(paths, paths[1:], strict=False)]
    assert sum(package(a) == package(b) for a, b in pairs) / len(pairs) < 0.3
    assert all(len({package(p) for p in paths}) >= 5 for paths in shards)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["splits"]["train"]["files"] == len(train_paths)
    assert len(open_source(SourceSpec(name="python-stdlib", split="validation")).pieces(1)) == 2


def test_concurrent_builds_happen_once(tmp_path):
    code = (
        "import json, sys; from lmpretrain.data import corpus; p = corpus.ensure_stdlib_corpus(max_files=150); "
        "print(json.dumps({'path': str(p), 'builds': corpus.BUILDS}))"
    )
    env = {**os.environ, "LMPRETRAIN_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    results = [json.loads(out) for out, _ in outputs]
    assert all(p.returncode == 0 for p in procs)
    assert (
        sum("[lmpretrain] building the python-stdlib corpus from 150 files" in err for _, err in outputs) == 1
    )
    assert results[0]["path"] == results[1]["path"]
    assert sum(r["builds"] for r in results) == 1
    folder = Path(results[0]["path"])
    assert (folder / "_COMPLETE").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # no leftover temp folders
    other = tmp_path / "again"  # the order is seeded: another build writes the same bytes
    subprocess.run(
        [sys.executable, "-c", code], env={**env, "LMPRETRAIN_CACHE": str(other)}, check=True, timeout=120
    )
    for shard in sorted(folder.glob("*.jsonl")):
        assert (other / folder.name / shard.name).read_bytes() == shard.read_bytes()
    assert _paths(sorted(folder.glob("train-*.jsonl"))) != sorted(
        _paths(sorted(folder.glob("train-*.jsonl")))
    )
