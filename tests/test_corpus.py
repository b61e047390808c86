"""The default corpus: the standard library's source, split by file, built once even under concurrency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lmpretrain.corpus import BUILTIN_DATASETS, ensure_stdlib_corpus, is_validation
from lmpretrain.data import SourceSpec, open_source


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
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["splits"]["train"]["files"] == len(train_paths)
    assert open_source(SourceSpec(name="python-stdlib", split="validation")).n_shards == 2


def test_concurrent_builds_happen_once(tmp_path):
    code = (
        "import json, sys; from lmpretrain import corpus; p = corpus.ensure_stdlib_corpus(max_files=150); "
        "print(json.dumps({'path': str(p), 'builds': corpus.BUILDS}))"
    )
    env = {**os.environ, "LMPRETRAIN_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert results[0]["path"] == results[1]["path"]
    assert sum(r["builds"] for r in results) == 1
    folder = Path(results[0]["path"])
    assert (folder / "_COMPLETE").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # no leftover temp folders
