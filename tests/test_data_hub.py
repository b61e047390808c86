"""Hub datasets, offline: a local folder laid out like a Hub dataset repository goes through the same
listing (🤗 datasets' config/split resolution) and readers as a Hub id does."""

from __future__ import annotations

import os
import random
from collections import Counter

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import make_doc, write_jsonl_shards
from data_helpers import doc_tags, make, steps, stream_tokens
from fsspec.implementations.local import LocalFileSystem
from test_data_files import _restore_reads

from lmpretrain.data import SourceSpec, open_source

README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: validation
    path: data/validation-*
- config_name: small
  data_files:
  - split: train
    path: small/train-*.parquet
---
# a dataset card
"""


def hub_repo(root, n_files: int = 3, rows: int = 1000) -> str:
    """Parquet files as the Hub lays them out: data/<split>-NNNNN-of-NNNNN.parquet, plus a second config."""
    rng = random.Random(0)
    for i in range(n_files):
        (root / "data").mkdir(parents=True, exist_ok=True)
        docs = [make_doc(f"t{i}.{k}", rng) for k in range(rows)]
        pq.write_table(
            pa.table({"text": docs}),
            root / "data" / f"train-{i:05d}-of-{n_files:05d}.parquet",
            row_group_size=100,
        )
    pq.write_table(
        pa.table({"text": ["<v0> held out\n"]}), root / "data" / "validation-00000-of-00001.parquet"
    )
    (root / "small").mkdir()
    pq.write_table(
        pa.table({"text": [make_doc(f"s.{k}", rng) for k in range(20)]}), root / "small" / "train-0.parquet"
    )
    (root / "README.md").write_text(README)
    return str(root)


def test_hub_parquet_is_listed_once_and_read_by_row_group(tmp_path, small_tokenizer):
    repo = hub_repo(tmp_path / "repo")
    source = open_source(SourceSpec(hub=repo, split="train"))
    assert source.format == "parquet" and not source.is_hub and source.hub_parquet
    assert [f.rsplit("/", 1)[1] for f in source.files] == [
        f"train-{i:05d}-of-00003.parquet" for i in range(3)
    ]
    assert "3 files on the Hub, read by row group (a restore seeks to its row group)" in source.summary(4)
    small = open_source(SourceSpec(hub=repo, hub_config="small", split="train"))
    assert [f.rsplit("/", 1)[1] for f in small.files] == ["train-0.parquet"]
    # The documents come in file and row order (no shuffle), each once per epoch.
    ts = make([SourceSpec(hub=repo, hub_config="small")], small_tokenizer, num_streams=1, shuffle=False)
    tags = doc_tags(stream_tokens(steps(ts, 30)[0], ts)[0], small_tokenizer)
    assert tags[:20] == [f"s.{k}" for k in range(20)] and tags[20] == "s.0"


def test_hub_parquet_restores_by_seeking_at_a_cost_flat_in_the_position(tmp_path, small_tokenizer):
    spec = [SourceSpec(hub=hub_repo(tmp_path / "repo"))]
    kw = dict(num_streams=1, blocks_per_step=4, doc_shuffle_window=16, shuffle_window=4)
    early = _restore_reads(spec, small_tokenizer, 3, **kw)
    late = _restore_reads(spec, small_tokenizer, 2500, **kw)
    # Reaching step 2500 reads ~2,000 rows (into the third file); restoring it reads one document window and
    # one block window's rows, plus at most the rest of one row group (100 rows), wherever the position is.
    assert late[0] > 1800 and late[1] <= 16 * 2 + 100 and abs(late[1] - early[1]) <= 66, (early, late)


def test_a_hub_dataset_without_parquet_files_stays_a_datasets_stream(tmp_path, small_tokenizer):
    repo = tmp_path / "jsonrepo"
    write_jsonl_shards(repo / "data", [30, 20], prefix="train")
    source = open_source(SourceSpec(hub=str(repo)))
    assert source.is_hub and not source.hub_parquet
    assert "🤗 datasets stream (no parquet files), 2 shards" in source.summary(2)
    ts = make([SourceSpec(hub=str(repo))], small_tokenizer, num_streams=2, shuffle=False)
    tags = {
        t
        for tokens in stream_tokens(steps(ts, 120)[0], ts).values()
        for t in doc_tags(tokens, small_tokenizer)
    }
    assert tags == {f"train{i}.{k}" for i, n in enumerate([30, 20]) for k in range(n)}


# ---- one listing per job ------------------------------------------------------------------------------------


class CountingFS(LocalFileSystem):
    """The local filesystem under `count://`, logging every request (info, ls, open) to $COUNT_LOG with its pid."""

    protocol = "count"

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("count://"):
            path = path[len("count://") :]
        return super()._strip_protocol(path)

    def _log(self, what):
        with open(os.environ["COUNT_LOG"], "a") as f:
            f.write(f"{os.getpid()} {what}\n")

    def info(self, path, **kw):
        self._log("info")
        return super().info(path, **kw)

    def ls(self, path, detail=False, **kw):
        self._log("ls")
        return super().ls(path, detail=detail, **kw)

    def _open(self, path, mode="rb", **kw):
        self._log("open")
        return super()._open(path, mode, **kw)


def counting_repo(root, n_files: int) -> str:
    """A Hub-style repository whose config points at its parquet files through the counting filesystem."""
    hub_repo(root, n_files=n_files, rows=40)
    (root / "README.md").write_text(
        README.replace("path: data/train-*", f"path: count://{root}/data/train-*")
    )
    fsspec.register_implementation("count", CountingFS, clobber=True)
    return str(root)


def requests(log) -> Counter:
    return Counter(line.split()[0] for line in open(log)) if os.path.exists(log) else Counter()


def _open_on_rank(rank: int, repo: str, log: str, init: str) -> None:
    import torch.distributed as dist

    fsspec.register_implementation("count", CountingFS, clobber=True)
    os.environ["COUNT_LOG"] = log
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        source = open_source(SourceSpec(hub=repo))
        with open(f"{log}.{rank}", "w") as f:  # what each rank holds: the same listing
            f.write(repr((source.files, source.sizes, source._row_group_bytes)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_hub_listing_and_footers_are_read_once_per_job(tmp_path, monkeypatch, small_tokenizer):
    """2 ranks make the requests 1 rank makes (all on rank 0), and a prepare's requests do not grow with its
    tasks: O(files), not O(ranks x files)."""
    import torch.multiprocessing as mp

    from lmpretrain.data.prepare import write_token_files

    repo = counting_repo(tmp_path / "repo", n_files=4)
    log = str(tmp_path / "one.log")
    monkeypatch.setenv("COUNT_LOG", log)
    one = open_source(SourceSpec(hub=repo))
    alone = sum(requests(log).values())
    assert len(one.files) == 4 and one.files[0].startswith("count://") and alone >= 8
    two = str(tmp_path / "two.log")
    mp.spawn(_open_on_rank, args=(repo, two, f"file://{tmp_path / 'rdv'}"), nprocs=2)
    per_process = requests(two)
    assert sum(per_process.values()) == alone and len(per_process) == 1  # rank 0 alone, as many as 1 rank
    assert (
        open(f"{two}.0").read()
        == open(f"{two}.1").read()
        == repr((one.files, one.sizes, one._row_group_bytes))
    )
    counts = []
    for tasks in (1, 3):
        log = str(tmp_path / f"prepare-{tasks}.log")
        monkeypatch.setenv("COUNT_LOG", log)
        write_token_files(
            SourceSpec(hub=repo), small_tokenizer, tmp_path / f"tok-{tasks}", tasks=tasks, workers=1
        )
        counts.append(sum(requests(log).values()))
    assert counts[0] == counts[1] <= alone + 3 * 4, counts  # the listing, then each file read by one task
