"""The streamed data pipeline: packing, sharding, world-size independence, exact resume, bad input."""

from __future__ import annotations

import gzip
import json
import logging
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import write_jsonl_shards
from data_helpers import by_stream, doc_tags, expected_tokens, make, steps, stream_tokens
from transformers import PreTrainedTokenizerFast

from lmpretrain.config import DataConfig
from lmpretrain.data import SourceSpec, heldout_blocks, merge_data_states
from lmpretrain.data.heldout import MIN_DOCUMENTS
from lmpretrain.errors import DataError

# ---- packing -------------------------------------------------------------------------------------------


def test_packing_is_exact_including_a_document_longer_than_many_blocks(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [5, 3])
    with open(paths[0], "a") as f:  # ~60 blocks long
        f.write(json.dumps({"text": "<long> " + "alpha beta gamma " * 300}) + "\n")
    want = expected_tokens(paths, small_tokenizer)
    assert small_tokenizer("x y", add_special_tokens=False)["input_ids"][0] != small_tokenizer.bos_token_id
    ts = make([SourceSpec(files=paths)], small_tokenizer, num_streams=1, blocks_per_step=3, shuffle=False)
    assert want.count(small_tokenizer.bos_token_id) == 9  # BOS before each document (the default here)
    n_steps = len(want) // (3 * 16) + 2  # past the end of the epoch: the next epoch continues the stream
    got = torch.cat([r.input_ids for r in steps(ts, n_steps)[0]]).flatten().tolist()
    assert got[: len(want)] == want
    assert got[len(want) :] == want[: len(got) - len(want)]
    assert want.count(small_tokenizer.eos_token_id) == 9


# ---- sharding: disjoint, complete, independent of world size and workers -------------------------------


@pytest.mark.parametrize(
    "shards", [[5, 9, 3, 7, 4, 6, 8, 2, 5, 7, 3], [20, 13, 17]], ids=["own-shards", "shared"]
)
def test_two_ranks_two_workers_cover_an_epoch_disjointly(tmp_path, small_tokenizer, shards, caplog):
    paths = write_jsonl_shards(tmp_path / "d", shards)
    all_tags = {f"shard{i}.{k}" for i, n in enumerate(shards) for k in range(n)}
    per_stream: dict[int, list[int]] = {}
    with caplog.at_level(logging.WARNING):
        for rank in range(2):
            ts = make(
                [SourceSpec(files=paths)],
                small_tokenizer,
                num_streams=8,
                blocks_per_step=8,
                rank=rank,
                world_size=2,
                num_workers=2,
                shuffle=False,
                seq_len=32,
            )
            for r in steps(ts, 120)[0]:
                for s, rows in by_stream(r.input_ids, ts).items():
                    per_stream.setdefault(s, []).extend(rows.flatten().tolist())
            ts.close()
    assert ("keep every" in caplog.text) == (len(shards) < 8)
    epoch0 = {}
    for s, tokens in per_stream.items():
        tags = doc_tags(tokens, small_tokenizer)
        assert tags[0] in tags[1:], f"stream {s} did not finish an epoch"
        epoch0[s] = tags[: tags.index(tags[0], 1)]
    seen = [t for tags in epoch0.values() for t in tags]
    assert len(seen) == len(set(seen)), "a document was read by two streams (or twice) in one epoch"
    assert set(seen) == all_tags


def test_same_global_blocks_for_one_rank_two_workers_and_two_ranks(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [6, 4, 9, 3, 5])
    one = make([SourceSpec(files=paths)], small_tokenizer, blocks_per_step=6, num_workers=2)
    ref = [by_stream(r.input_ids, one) for r in steps(one, 12)[0]]
    one.close()
    ranks = [
        make([SourceSpec(files=paths)], small_tokenizer, blocks_per_step=6, rank=p, world_size=2)
        for p in range(2)
    ]
    got = [[by_stream(r.input_ids, ts) for r in steps(ts, 12)[0]] for ts in ranks]
    for t in range(12):
        merged = {**got[0][t], **got[1][t]}
        assert sorted(merged) == sorted(ref[t])
        assert all(torch.equal(merged[s], ref[t][s]) for s in ref[t])
        as_rows = lambda d: Counter(tuple(b.tolist()) for blocks in d.values() for b in blocks)  # noqa: E731
        assert as_rows(merged) == as_rows(ref[t])
    assert sum(len(rows) for rows in ref[0].values()) == 6  # c_s = 2,2,1,1


# ---- exact resume ---------------------------------------------------------------------------------------


def _check_resume(make_ts, n: int, m: int, *, json_roundtrip: bool = True):
    ref_ts = make_ts()
    ref, it = steps(ref_ts, n)
    state = ref_ts.state_dict()
    ref += steps(ref_ts, m, it)[0]
    ref_ts.close()
    if json_roundtrip:
        state = json.loads(json.dumps(state))  # plain data: survives JSON (stream ids become strings)
    fresh = make_ts()
    fresh.load_state_dict(state)
    got = steps(fresh, m)[0]
    fresh.close()
    for a, b in zip(ref[n:], got, strict=True):
        assert torch.equal(a.input_ids, b.input_ids)
        assert (a.epoch, a.skipped_docs) == (b.epoch, b.skipped_docs)
    return ref


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_exact_with_shuffle_uneven_shards_and_epoch_boundary(tmp_path, small_tokenizer, workers):
    paths = write_jsonl_shards(
        tmp_path / "d", [1, 7, 2, 5, 3, 2]
    )  # uneven: streams own 1 or 2 shards of 1-7 docs
    ref = _check_resume(
        lambda: make(
            [SourceSpec(files=paths)],
            small_tokenizer,
            num_workers=workers,
            blocks_per_step=5,
            doc_shuffle_window=3,
        ),
        23,
        40,
    )
    assert ref[0].epoch == 0 and ref[-1].epoch >= 1, "the resumed span must cross an epoch boundary"


def test_resume_is_exact_with_mixing_and_mid_window_positions(tmp_path, small_tokenizer):
    a = write_jsonl_shards(tmp_path / "a", [8, 5, 7], prefix="A")
    b = write_jsonl_shards(tmp_path / "b", [4, 6], prefix="B", seed=1)
    for n in (1, 3, 5, 7):  # window of 5 blocks: resume within it and exactly at its end
        _check_resume(
            lambda: make(
                [SourceSpec(files=a, weight=2.0), SourceSpec(files=b)],
                small_tokenizer,
                blocks_per_step=4,
                shuffle_window=5,
            ),
            n,
            12,
        )


def test_resume_onto_a_different_world_size(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [6, 4, 9, 3, 5, 7])
    src = [SourceSpec(files=paths)]
    single = make(src, small_tokenizer, blocks_per_step=6, num_workers=2)
    ref = [r.input_ids for r in steps(single, 25)[0]]
    single.close()
    states = []
    for p in range(2):
        ts = make(src, small_tokenizer, blocks_per_step=6, rank=p, world_size=2)
        steps(ts, 15)
        states.append(ts.state_dict())
    resumed = make(src, small_tokenizer, blocks_per_step=6, num_workers=2)
    resumed.load_state_dict(merge_data_states(states))
    got = [r.input_ids for r in steps(resumed, 10)[0]]
    resumed.close()
    assert all(torch.equal(a, b) for a, b in zip(ref[15:], got, strict=True))
    with pytest.raises(DataError, match="lacks streams"):
        make(src, small_tokenizer, blocks_per_step=6).load_state_dict(states[0])
    with pytest.raises(DataError, match="num_streams"):
        make(src, small_tokenizer, blocks_per_step=6, num_streams=2).load_state_dict(states[0])


def test_restore_reads_one_window_not_the_consumed_stream(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [600, 600])
    src = [SourceSpec(files=paths)]
    kw = dict(num_streams=1, blocks_per_step=4, shuffle_window=4)
    reads = {}
    for n in (5, 400):
        ts = make(src, small_tokenizer, **kw)
        ref, it = steps(ts, n)
        state = ts.state_dict()
        nxt = next(it)
        read_by_iteration = ts.records_read()
        fresh = make(src, small_tokenizer, **kw)
        fresh.load_state_dict(state)
        assert torch.equal(next(iter(fresh)).input_ids, nxt.input_ids)
        reads[n] = (read_by_iteration, fresh.records_read())
    assert reads[400][0] > 300  # reaching step 400 by iteration reads hundreds of documents...
    assert reads[400][1] <= 2 * 64 and reads[400][1] <= reads[5][1] + 64  # ...restoring it reads ~one window


# ---- shuffling and mixing -------------------------------------------------------------------------------


def test_epochs_reshuffle_the_piece_order(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [2] * 16)
    ts = make(
        [SourceSpec(files=paths)],
        small_tokenizer,
        num_streams=2,
        blocks_per_step=2,
        shuffle_window=1,
        doc_shuffle_window=1,  # no document shuffle: what changes between epochs is the piece order
        seq_len=32,
    )
    tokens = {0: [], 1: []}
    for r in steps(ts, 120)[0]:
        for s, rows in by_stream(r.input_ids, ts).items():
            tokens[s] += rows.flatten().tolist()
    for s in (0, 1):
        tags = doc_tags(tokens[s], small_tokenizer)
        assert len(tags) >= 32
        e0, e1 = tags[:16], tags[16:32]
        assert sorted(e0) == sorted(e1) and e0 != e1


def test_window_shuffle_permutes_blocks_within_windows_and_is_seeded(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [60])  # one shard: no shard-order shuffle, only windows

    def rows(**kw):
        ts = make(
            [SourceSpec(files=paths)],
            small_tokenizer,
            num_streams=1,
            blocks_per_step=8,
            shuffle_window=8,
            doc_shuffle_window=1,  # documents in file order: only blocks move
            **kw,
        )
        return torch.cat([r.input_ids for r in steps(ts, 4)[0]])  # 4 complete windows

    plain, shuffled = rows(shuffle=False), rows(seed=3)
    assert not torch.equal(plain, shuffled)
    assert torch.equal(rows(seed=3), shuffled) and not torch.equal(rows(seed=4), shuffled)
    for w in range(4):  # the same blocks, in another order, window by window
        window = slice(8 * w, 8 * w + 8)
        assert Counter(map(tuple, plain[window].tolist())) == Counter(map(tuple, shuffled[window].tolist()))


def test_mixing_is_deterministic_and_follows_weights(tmp_path, small_tokenizer):
    a = write_jsonl_shards(tmp_path / "a", [150, 150], prefix="A")
    b = write_jsonl_shards(tmp_path / "b", [150, 150], prefix="B", seed=1)
    src = [SourceSpec(files=a, weight=3.0), SourceSpec(files=b, weight=1.0)]
    runs = []
    for _ in range(2):
        ts = make(src, small_tokenizer, num_streams=2, blocks_per_step=8, shuffle=False, seq_len=64)
        runs.append(steps(ts, 40)[0])
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(*runs, strict=True))
    tags = [t for tokens in stream_tokens(runs[0], ts).values() for t in doc_tags(tokens, small_tokenizer)]
    share_a = sum(t.startswith("A") for t in tags) / len(tags)
    assert len(tags) > 200 and 0.65 < share_a < 0.85


# ---- source formats ---------------------------------------------------------------------------------------


def test_text_files_are_one_document_per_file(tmp_path, small_tokenizer):
    folder = tmp_path / "code"
    folder.mkdir()
    texts = [f"<file{i}> def f{i}():\n    return {i}\n\n\n# end\n" for i in range(3)]
    for i, t in enumerate(texts):
        (folder / f"m{i}.py").write_text(t)
    ts = make(
        [SourceSpec(files=[str(folder)])], small_tokenizer, num_streams=1, blocks_per_step=1, shuffle=False
    )
    tokens = torch.cat([r.input_ids for r in steps(ts, 12)[0]]).flatten().tolist()
    bos, eos = small_tokenizer.bos_token_id, small_tokenizer.eos_token_id
    want = [
        t for x in texts for t in [bos] + small_tokenizer(x, add_special_tokens=False)["input_ids"] + [eos]
    ]
    assert tokens[: len(want)] == want


def test_parquet_source_with_a_custom_text_field(tmp_path, small_tokenizer):
    for i in range(2):
        pq.write_table(
            pa.table({"content": [f"<p{i}.{k}> alpha beta" for k in range(5)], "n": list(range(5))}),
            tmp_path / f"p{i}.parquet",
        )
    ts = make(
        [SourceSpec(files=[str(tmp_path / "*.parquet")], text_field="content")],
        small_tokenizer,
        num_streams=2,
        blocks_per_step=2,
        shuffle=False,
    )
    tokens = stream_tokens(steps(ts, 8)[0], ts)
    assert doc_tags(tokens[0], small_tokenizer)[:2] == ["p0.0", "p0.1"]
    assert doc_tags(tokens[1], small_tokenizer)[:2] == ["p1.0", "p1.1"]


def test_json_arrays_and_gzipped_json_lines_stream_the_same_documents(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [7])
    records = [json.loads(line) for line in open(paths[0], encoding="utf-8")]
    (tmp_path / "a.json").write_text(json.dumps(records[:3] + [{"text": None}] + records[3:]))
    with gzip.open(tmp_path / "g.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    got = {}
    for name in ("a.json", "g.jsonl.gz", paths[0]):
        ts = make([SourceSpec(files=[str(tmp_path / name)])], small_tokenizer, num_streams=1, shuffle=False)
        result = steps(ts, 12)[0]
        got[name] = doc_tags(stream_tokens(result, ts)[0], small_tokenizer)[:7]
        epoch, skipped = result[-1].epoch, result[-1].skipped_docs  # one bad record per pass in a.json
        assert skipped in ((epoch, epoch + 1) if name == "a.json" else (0,))
    assert got["a.json"] == got["g.jsonl.gz"] == got[paths[0]] == [f"shard0.{k}" for k in range(7)]


# ---- held-out blocks -------------------------------------------------------------------------------------------


def test_heldout_blocks_are_the_first_blocks_in_order(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "v", [16, 16])
    data = DataConfig(eval=[SourceSpec(files=paths)], seq_len=8)
    blocks = heldout_blocks(data, small_tokenizer, num_blocks=32)  # 256 tokens: documents capped at 16
    assert blocks.shape == (32, 8) and blocks.dtype == torch.long
    cap = 256 // MIN_DOCUMENTS
    assert blocks.flatten().tolist() == expected_tokens(paths, small_tokenizer, doc_cap=cap)[:256]
    assert heldout_blocks(data, small_tokenizer, num_blocks=32).equal(blocks)
    no_bos = DataConfig(eval=[SourceSpec(files=paths)], seq_len=8, add_bos=False)
    assert (
        heldout_blocks(no_bos, small_tokenizer, num_blocks=32).flatten().tolist()
        == expected_tokens(paths, small_tokenizer, bos=False, doc_cap=cap)[:256]
    )
    # However long the documents, none fills more than 1/MIN_DOCUMENTS of the set.
    long = write_jsonl_shards(tmp_path / "long", [24], max_words=2000)
    capped = heldout_blocks(
        DataConfig(eval=[SourceSpec(files=long)], seq_len=8), small_tokenizer, num_blocks=32
    )
    starts = (capped.flatten() == small_tokenizer.bos_token_id).nonzero().flatten().tolist()
    assert starts[:MIN_DOCUMENTS] == [cap * i for i in range(MIN_DOCUMENTS)]
    with pytest.raises(DataError, match="lower eval.batches"):
        heldout_blocks(data, small_tokenizer, num_blocks=10_000)


# ---- bad input ---------------------------------------------------------------------------------------------------


def test_missing_files_and_globs_fail_before_any_work(tmp_path, small_tokenizer):
    with pytest.raises(DataError, match="nope.jsonl"):
        make([SourceSpec(files=[str(tmp_path / "nope.jsonl")])], small_tokenizer)
    with pytest.raises(DataError, match=r"\*.parquet.*matches nothing"):
        make([SourceSpec(files=[str(tmp_path / "*.parquet")])], small_tokenizer)
    with pytest.raises(DataError, match="exactly one of name/files/hub"):
        make([SourceSpec(name="python-stdlib", files=["x"])], small_tokenizer)
    with pytest.raises(DataError, match="unknown builtin dataset"):
        make([SourceSpec(name="nope")], small_tokenizer)


def test_empty_corpus_and_too_few_documents(tmp_path, small_tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty corpus"):
        make([SourceSpec(files=[str(tmp_path / "empty.jsonl")])], small_tokenizer)
    paths = write_jsonl_shards(tmp_path / "d", [2])
    ts = make([SourceSpec(files=paths)], small_tokenizer, num_streams=4)
    with pytest.raises(DataError, match="too few documents for 4 streams"):
        next(iter(ts))


def test_missing_text_field(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [3], field="body")
    with pytest.raises(DataError, match=r"no field 'text'.*body.*text_field"):
        make([SourceSpec(files=paths)], small_tokenizer)


def test_tokenizer_without_eos_is_refused(tmp_path, small_tokenizer):
    no_eos = PreTrainedTokenizerFast(tokenizer_object=small_tokenizer.backend_tokenizer)
    paths = write_jsonl_shards(tmp_path / "d", [3])
    with pytest.raises(DataError, match="no EOS token"):
        make([SourceSpec(files=paths)], no_eos)


def test_bad_records_are_skipped_counted_and_logged_once(tmp_path, small_tokenizer, caplog):
    path = tmp_path / "mixed.jsonl"
    lines = [
        {"text": "<g0> alpha"},
        {"text": None},
        {"text": ""},
        {"text": "<g1> beta"},
        {"text": 5},
        {"text": "<g2> gamma"},
        {"text": "<g3> delta"},
        {"text": "<g4> epsilon"},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ts = make(
        [SourceSpec(files=[str(path)])],
        small_tokenizer,
        num_streams=1,
        blocks_per_step=1,
        shuffle=False,
        seq_len=4,
    )
    with caplog.at_level(logging.WARNING):
        rows = steps(ts, 12)[0]
    tokens = torch.cat([r.input_ids for r in rows]).flatten().tolist()
    assert doc_tags(tokens, small_tokenizer)[:6] == ["g0", "g1", "g2", "g3", "g4", "g0"]
    assert rows[-1].skipped_docs >= 3 and caplog.text.count("skipping a bad record") == 1
    assert f"{path} line 2: field 'text' is NoneType, not a string" in caplog.text


def test_invalid_stream_layout_is_reported_with_the_config_names(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [3])
    with pytest.raises(DataError, match=r"data.num_streams=6 must be a multiple of the world size 4"):
        make([SourceSpec(files=paths)], small_tokenizer, num_streams=6, world_size=4, blocks_per_step=8)
    with pytest.raises(DataError, match=r"data.num_workers=3 exceeds the 2 streams"):
        make(
            [SourceSpec(files=paths)],
            small_tokenizer,
            num_streams=4,
            world_size=2,
            num_workers=3,
            blocks_per_step=2,
        )
    with pytest.raises(DataError, match="data.train needs at least one source"):
        make([], small_tokenizer)


def test_fingerprint_and_state_are_plain_data(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [3, 3])
    ts = make([SourceSpec(files=paths)], small_tokenizer)
    fp = ts.fingerprint()
    assert {"sources", "tokenizer", "add_bos", "seq_len", "num_streams", "world_size", "num_workers"} <= set(
        fp
    )
    assert fp["add_bos"] is True and fp["sources"][0]["expanded"]["count"] == 2
    json.dumps(fp)
    steps(ts, 3)
    state = ts.state_dict()
    assert json.loads(json.dumps(state)) == {
        **state,
        "streams": {str(k): v for k, v in state["streams"].items()},
    }
    stream = state["streams"][0]
    assert {"window", "emitted", "docs", "frontier", "tokens"} == set(stream)
    assert len(stream["docs"]["start"]["sources"]) == 1 and len(stream["tokens"]) == 1
    position = stream["docs"]["start"]["sources"][0]
    assert set(position) == {"epoch", "slot", "at", "segment", "seen", "skipped"}


def test_bad_held_out_records_are_skipped_and_reported(tmp_path, small_tokenizer, caplog):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"text": "<e0> alpha"}\n{"text": "<e1\n{"text": "<e2> beta"}\n')
    with caplog.at_level(logging.WARNING):
        blocks = heldout_blocks(
            DataConfig(eval=[SourceSpec(files=[str(path)])], seq_len=8), small_tokenizer, num_blocks=1
        )
    assert doc_tags(blocks.flatten().tolist(), small_tokenizer) == ["e0"]
    assert f"skipping a bad record at {path} line 2: malformed JSON" in caplog.text
