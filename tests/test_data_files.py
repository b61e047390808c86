"""Local files as users bring them: one big text file split among streams, separators, bad records, BOS,
restore cost independent of the position, the document shuffle, and the file list in the fingerprint."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import make_doc, write_jsonl_shards
from data_helpers import doc_tags, documents, make, steps, stream_tokens
from transformers import PreTrainedTokenizerFast

from lmpretrain.config import DataConfig
from lmpretrain.data import SourceSpec, open_source
from lmpretrain.data.block_stream import BlockStream, StreamSettings
from lmpretrain.data.encoder import Encoder
from lmpretrain.data.readers import CHUNK, Bad
from lmpretrain.data.sources import datasets_source
from lmpretrain.errors import DataError


def write_text(path, n_lines: int, seed: int = 0) -> str:
    """A plain ASCII text file of numbered lines; returns its text."""
    rng = random.Random(seed)
    text = "".join(f"line {i}: {make_doc(f'l{i}', rng, 12)}" for i in range(n_lines))
    path.write_text(text)
    return text


def read_piece(source, piece):
    return [u for u in source.read(piece, None) if not isinstance(u, Bad)]


# ---- one big text file ------------------------------------------------------------------------------------


def test_a_big_text_file_is_cut_at_line_starts_into_pieces_that_cover_it(tmp_path):
    path = tmp_path / "corpus.txt"
    text = write_text(path, 11_000)  # ~575 KB: 8 pieces of >= 64 KiB
    data = text.encode()
    source = open_source(SourceSpec(files=[str(path)]))
    for streams in (8, 3):
        pieces = source.pieces(streams)
        assert len(pieces) == streams
        assert pieces[0].start == 0 and pieces[-1].end == len(data)
        assert all(
            a.end == b.start and data[b.start - 1 : b.start] == b"\n"
            for a, b in zip(pieces, pieces[1:], strict=False)
        )
        units = [read_piece(source, p) for p in pieces]
        assert "".join(u.value for us in units for u in us) == text  # every byte once, in order
        flat = [u for us in units for u in us]
        assert [u.bos for u in flat].count(True) == 1 and flat[0].bos  # one document: the file
        assert [u.eos for u in flat].count(True) == 1 and flat[-1].eos
        assert all(us[-1].last for us in units) and max(len(u.value) for u in flat) <= CHUNK


def test_every_stream_reads_its_own_part_of_one_text_file(tmp_path, small_tokenizer):
    path = tmp_path / "corpus.txt"
    text = write_text(path, 11_000)
    ts = make(
        [SourceSpec(files=[str(path)])], small_tokenizer, num_streams=8, blocks_per_step=8, shuffle=False
    )
    pieces = ts.sources[0].pieces(8)
    tokens = stream_tokens(steps(ts, 3)[0], ts)
    for s in range(8):
        assert len(tokens[s]) == 3 * 16
        decoded = small_tokenizer.decode(tokens[s], skip_special_tokens=True)
        where = text.find(decoded)
        assert pieces[s].start <= where < pieces[s].end, f"stream {s} read outside its piece"
    assert tokens[0][0] == small_tokenizer.bos_token_id  # the file's start
    assert all(tokens[s][0] != small_tokenizer.bos_token_id for s in range(1, 8))  # pieces inside it


# ---- separators -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("separator", ["blank_lines", "<|endoftext|>"])
def test_separated_documents_come_back_whole_with_bos_and_eos(tmp_path, small_tokenizer, separator):
    rng = random.Random(1)
    docs = [f"<d{i}> " + make_doc(f"x{i}", rng, 40) * rng.choice([1, 3]) for i in range(300)]
    docs[7] = "<d7> " + "".join(make_doc(f"y{k}", rng, 30) for k in range(1200))  # ~110 KB: two units
    docs = [d.rstrip("\n") + "\n" for d in docs]
    joiner = "\n  \n\n" if separator == "blank_lines" else "<|endoftext|>"
    path = tmp_path / "docs.txt"
    path.write_text(("\n\n" if separator == "blank_lines" else "<|endoftext|>") + joiner.join(docs) + joiner)
    spec = SourceSpec(files=[str(path)], separator=separator)
    source = open_source(spec)
    assert len(source.pieces(2)) == 2  # cut at a document start
    ts = make([spec], small_tokenizer, num_streams=2, blocks_per_step=8, seq_len=64, shuffle=False)
    tokens = stream_tokens(steps(ts, 300)[0], ts)
    got = [d for s in (0, 1) for d in documents(tokens[s], small_tokenizer)]
    texts = {t for _, t in got}
    assert all(bos for bos, _ in got)
    assert set(docs) <= texts and texts <= set(docs), "documents must come back exactly, none merged or split"


def test_a_separator_typo_and_a_separator_on_json_are_refused(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [3])
    with pytest.raises(DataError, match="write 'blank_lines'"):
        make([SourceSpec(files=[str(tmp_path / "x.txt")], separator="blank_line")], small_tokenizer)
    with pytest.raises(DataError, match="separator applies to text files only"):
        make([SourceSpec(files=paths, separator="\n")], small_tokenizer)


def test_resume_is_exact_inside_a_long_separated_document(tmp_path, small_tokenizer):
    rng = random.Random(2)
    docs = ["<a> " + "".join(make_doc(f"a{k}", rng, 30) for k in range(1500))] + [
        make_doc(f"b{i}", rng) for i in range(40)
    ]
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(docs))
    spec = [SourceSpec(files=[str(path)], separator="blank_lines")]
    kw = dict(num_streams=1, blocks_per_step=4, seq_len=32, doc_shuffle_window=4, shuffle_window=3)
    ref_ts = make(spec, small_tokenizer, **kw)
    it = iter(ref_ts)
    for _ in range(600):  # to a position whose document window starts inside the long first document
        next(it)
        state = json.loads(json.dumps(ref_ts.state_dict()))
        if state["streams"]["0"]["docs"]["start"]["open"] == 0:
            break
    assert state["streams"]["0"]["docs"]["window"] > 0 and state["streams"]["0"]["docs"]["start"]["open"] == 0
    ref = steps(ref_ts, 300, it)[0]
    fresh = make(spec, small_tokenizer, **kw)
    fresh.load_state_dict(state)
    got = steps(fresh, 300)[0]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(ref, got, strict=True))


# ---- bad records ------------------------------------------------------------------------------------------


def test_bad_json_lines_and_undecodable_text_are_skipped_and_reported_once(tmp_path, small_tokenizer, caplog):
    path = tmp_path / "crawl.jsonl"
    good = [json.dumps({"text": f"<g{i}> alpha beta"}).encode() for i in range(12)]
    bad = [b'{"text": 5}', b"not json at all", b'{"text": "caf\xe9 latin-1"}', b'{"text": "<trunc']
    lines = good[:3] + bad[:2] + good[3:8] + bad[2:3] + good[8:] + bad[3:]  # the last line is truncated
    path.write_bytes(b"\n".join(lines))
    text = tmp_path / "notes.txt"
    text.write_bytes(b"<t0> fine line\n<t0> caf\xe9 latin-1 line\n<t0> another fine line\n")
    with caplog.at_level(logging.WARNING):
        ts = make(
            [SourceSpec(files=[str(path)])], small_tokenizer, num_streams=1, blocks_per_step=2, shuffle=False
        )
        result = steps(ts, 40)[0]
        tt = make(
            [SourceSpec(files=[str(text)])], small_tokenizer, num_streams=1, blocks_per_step=1, shuffle=False
        )
        text_steps = steps(tt, 6)[0]
    tags = doc_tags(stream_tokens(result, ts)[0], small_tokenizer)
    assert tags[:13] == [f"g{i}" for i in range(12)] + ["g0"]
    assert result[-1].skipped_docs >= 8  # 4 bad records per pass over the file
    assert caplog.text.count(f"source files:{path}: skipping a bad record at {path} line 4") == 1
    assert "field 'text' is int, not a string" in caplog.text
    docs = documents(stream_tokens(text_steps, tt)[0], small_tokenizer)
    assert docs[0] == (True, "<t0> fine line\n<t0> another fine line\n") and text_steps[-1].skipped_docs >= 1
    assert f"{text} line 2: not valid UTF-8" in caplog.text


@pytest.mark.parametrize("workers", [0, 1])
def test_a_mostly_bad_source_is_refused_naming_the_file(tmp_path, small_tokenizer, workers):
    path = tmp_path / "broken.jsonl"
    lines = [json.dumps({"text": f"<g{i}> ok"}) if i % 3 == 0 else '{"text": "trunc' for i in range(90)]
    path.write_text("\n".join(lines) + "\n")
    ts = make(
        [SourceSpec(files=[str(path)])],
        small_tokenizer,
        num_streams=1,
        blocks_per_step=1,
        num_workers=workers,
    )
    with pytest.raises(DataError) as err:
        steps(ts, 3)
    ts.close()
    message = str(err.value)
    assert re.search(
        r"32 of the \d+ records stream 0 read are bad, e\.g\. .*broken\.jsonl line \d+: malformed", message
    )
    assert "Fix or remove that file" in message
    assert "Traceback" not in message and "DataLoader worker" not in message


# ---- the document-boundary contract and BOS -------------------------------------------------------------------


def test_special_token_strings_in_text_never_become_boundary_ids(tmp_path, small_tokenizer):
    path = tmp_path / "tricky.jsonl"
    docs = [f"<s{i}> x = '<|eos|>' if y else \"<|bos|>\" <|pad|>\n" for i in range(20)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ts = make(
        [SourceSpec(files=[str(path)])], small_tokenizer, num_streams=1, blocks_per_step=4, shuffle=False
    )
    tokens = stream_tokens(steps(ts, 20)[0], ts)[0]
    n_docs = tokens.count(small_tokenizer.eos_token_id)
    assert n_docs > 20 and tokens.count(small_tokenizer.bos_token_id) - n_docs in (
        0,
        1,
    )  # the last may be cut
    assert [t for _, t in documents(tokens, small_tokenizer)][:20] == docs  # the strings are text


def test_add_bos_follows_the_tokenizer_unless_set(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [5])
    src = [SourceSpec(files=paths)]
    first = lambda ts: next(iter(ts)).input_ids[0].tolist()  # noqa: E731
    on = make(src, small_tokenizer, num_streams=1, blocks_per_step=1, shuffle=False)
    off = make(src, small_tokenizer, num_streams=1, blocks_per_step=1, shuffle=False, add_bos=False)
    assert on.fingerprint()["add_bos"] is True and off.fingerprint()["add_bos"] is False
    with_bos, without = first(on), first(off)
    assert with_bos[0] == small_tokenizer.bos_token_id and without[:15] == with_bos[1:]
    assert "BOS (id 0) before and EOS (id 1) after each document" in on.describe()
    same = PreTrainedTokenizerFast(
        tokenizer_object=small_tokenizer.backend_tokenizer, bos_token="<|eos|>", eos_token="<|eos|>"
    )
    assert make(src, same, num_streams=1, blocks_per_step=1).fingerprint()["add_bos"] is False
    with pytest.raises(DataError, match=r"data.add_bos=true but .* BOS = EOS"):
        make(src, same, num_streams=1, blocks_per_step=1, add_bos=True)
    assert Encoder(small_tokenizer).frame(torch.tensor([7, 8]).numpy(), True, True).tolist() == [0, 7, 8, 1]


# ---- restore cost does not grow with the position ------------------------------------------------------------


def _restore_reads(src, tok, n: int, **kw) -> tuple[int, int]:
    """(records read to reach step n by iterating, records read to restore step n and produce it)."""
    ts = make(src, tok, **kw)
    _, it = steps(ts, n)
    state = ts.state_dict()
    want = next(it)
    fresh = make(src, tok, **kw)
    fresh.load_state_dict(state)
    assert torch.equal(next(iter(fresh)).input_ids, want.input_ids)
    return ts.records_read(), fresh.records_read()


def test_restore_reads_a_bounded_amount_wherever_the_position_is(tmp_path, small_tokenizer):
    rng = random.Random(0)
    rows = [make_doc(f"p{i}", rng) for i in range(3000)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "big.parquet", row_group_size=100)
    big_text = tmp_path / "big.txt"
    write_text(big_text, 20_000)
    jsonl = write_jsonl_shards(tmp_path / "j", [3000])
    records = dict(num_streams=1, blocks_per_step=4, doc_shuffle_window=16, shuffle_window=4)
    for src, deep, kw, bound in (
        # one document window (16 records) + the block window's few, + rows of one row group for parquet
        ([SourceSpec(files=[str(tmp_path / "big.parquet")])], 900, records, 16 * 2 + 100),
        ([SourceSpec(files=jsonl)], 900, records, 16 * 2 + 4),
        # text: 64 KiB units; a document window holds <= 8 x 8 KiB of text
        (
            [SourceSpec(files=[str(big_text)])],
            400,
            {**records, "blocks_per_step": 16, "seq_len": 64, "doc_shuffle_window": 8},
            3,
        ),
    ):
        early = _restore_reads(src, small_tokenizer, 3, **kw)
        late = _restore_reads(src, small_tokenizer, deep, **kw)
        assert late[0] > 4 * late[1], (
            f"{src[0].files}: reaching the position must read far more than restoring it"
        )
        assert late[1] <= bound and abs(late[1] - early[1]) <= bound // 2, (early, late)


# ---- shuffling -------------------------------------------------------------------------------------------------


def test_documents_are_shuffled_within_seeded_windows(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "d", [200])
    order = {}
    for name, kw in {
        "plain": dict(shuffle=False),
        "s3": dict(seed=3),
        "again": dict(seed=3),
        "s4": dict(seed=4),
    }.items():
        ts = make(
            [SourceSpec(files=paths)],
            small_tokenizer,
            num_streams=1,
            doc_shuffle_window=10,
            shuffle_window=1,  # blocks in order: only documents move
            seq_len=64,
            **kw,
        )
        order[name] = doc_tags(stream_tokens(steps(ts, 40)[0], ts)[0], small_tokenizer)[:100]
    assert order["plain"] == [f"shard0.{k}" for k in range(100)]
    assert order["s3"] == order["again"] != order["s4"]
    for w in range(10):  # the same 10 documents in each window, in another order
        window = slice(10 * w, 10 * w + 10)
        assert (
            sorted(order["s3"][window]) == sorted(order["plain"][window])
            and order["s3"][window] != order["plain"][window]
        )


def test_a_datasets_stream_resumes_exactly(tmp_path, small_tokenizer):
    """Hub sources are 🤗 datasets streams: the same reader on a local JSON stream (the Hub path offline)."""
    from datasets import load_dataset

    paths = write_jsonl_shards(tmp_path / "d", [40, 30, 50])
    spec = SourceSpec(hub="local/test")
    settings = StreamSettings(num_streams=2, seq_len=16, seed=0, shuffle=True, block_window=4, doc_window=8)
    encoder = Encoder(small_tokenizer)

    def stream(state=None):
        ds = load_dataset("json", data_files=paths, split="train", streaming=True)
        return BlockStream([datasets_source(spec, ds)], encoder, settings, 1, state)

    ref = stream()
    first = ref.next_blocks(30)
    state = json.loads(json.dumps(ref.state()))
    want = ref.next_blocks(40)
    got = stream(state).next_blocks(40)
    assert (want == got).all() and not (first[:10] == want[:10]).all()


# ---- the fingerprint covers the expanded file list -----------------------------------------------------------


def test_fingerprint_notices_files_added_under_a_glob(tmp_path, small_tokenizer):
    write_jsonl_shards(tmp_path / "d", [3, 3])
    src = [SourceSpec(files=[str(tmp_path / "d" / "*.jsonl")])]
    before = make(src, small_tokenizer).fingerprint()["sources"][0]
    write_jsonl_shards(tmp_path / "d", [3, 3, 4])  # a third file appears; the others are rewritten equal
    after = make(src, small_tokenizer).fingerprint()["sources"][0]
    assert (before["expanded"]["count"], after["expanded"]["count"]) == (2, 3)
    assert before["expanded"]["sha256"] != after["expanded"]["sha256"] and before["files"] == after["files"]
    data = DataConfig(train=src)
    assert data.train[0].files == src[0].files


# ---- pre-tokenizing -------------------------------------------------------------------------------------------

PREPARE = Path(__file__).resolve().parents[1] / "scripts" / "prepare_data.py"


def test_prepare_data_writes_token_files_that_stream_like_the_text(tmp_path, small_tokenizer):
    rng = random.Random(3)
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text("\n\n".join(make_doc(f"{name}{i}", rng) for i in range(30)))
    small_tokenizer.save_pretrained(tmp_path / "tok")
    command = [sys.executable, str(PREPARE), "--files", str(tmp_path / "*.txt"), "--separator", "blank_lines"]
    command += ["--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "tokens"), "--tasks", "1"]
    out = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "CI": "true"}
    )
    assert out.returncode == 0, out.stderr
    assert f"[lmpretrain] prepare: files:{tmp_path / '*.txt'}: text, 2 files" in out.stdout
    assert "wrote 2 shards" in out.stdout and "60 documents" in out.stdout
    # Read with the window shuffle, one stream: the same pieces (one per file), so the same blocks.
    kw = dict(num_streams=1, shuffle="windows")
    text = make([SourceSpec(files=[str(tmp_path / "*.txt")], separator="blank_lines")], small_tokenizer, **kw)
    tokens = make([SourceSpec(files=[str(tmp_path / "tokens")], format="tokens")], small_tokenizer, **kw)
    assert all(
        torch.equal(a.input_ids, b.input_ids)
        for a, b in zip(steps(text, 30)[0], steps(tokens, 30)[0], strict=True)
    )
