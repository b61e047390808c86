"""Hub datasets, offline: a local folder laid out like a Hub dataset repository goes through the same
listing (🤗 datasets' config/split resolution) and readers as a Hub id does."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import make_doc, write_jsonl_shards
from data_helpers import doc_tags, make, steps, stream_tokens
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
