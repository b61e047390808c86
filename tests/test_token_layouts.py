"""Token folders others wrote train as sources directly: datatrove's `DocumentTokenizer` (.ds) and
`MegatronDocumentTokenizer` (.bin/.idx), written here by the real datatrove package; and bad input (no
header or sidecar, a truncated shard, ids outside the vocabulary, another tokenizer, the old parquet
token cache) is refused with one message, before the model is built."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_doc, write_jsonl_shards
from data_helpers import make, steps

import recipe_runner as rr
from lmpretrain.data import SourceSpec
from lmpretrain.errors import DataError

SEQ = 16


def datatrove_tokenize(text_folder: Path, out: Path, tokenizer_dir: str, kind: str = "ds", **kw) -> Path:
    """Run datatrove's own tokenizer step (2 tasks) over the JSON Lines in `text_folder`."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer, MegatronDocumentTokenizer

    step = DocumentTokenizer if kind == "ds" else MegatronDocumentTokenizer
    kw.setdefault("eos_token", "<|eos|>")
    writer = step(
        output_folder=str(out), tokenizer_name_or_path=str(Path(tokenizer_dir) / "tokenizer.json"), **kw
    )
    LocalPipelineExecutor(
        pipeline=[JsonlReader(str(text_folder)), writer], tasks=2, workers=1, logging_dir=str(out) + "-logs"
    ).run()
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory, small_tokenizer):
    """JSON Lines documents tokenized by datatrove into a .ds folder and a Megatron folder."""
    root = tmp_path_factory.mktemp("datatrove")
    write_jsonl_shards(root / "text", [60, 45], max_words=40)
    tok_dir = root / "tokenizer"
    small_tokenizer.save_pretrained(tok_dir)
    return {
        "tokenizer": tok_dir,
        "text": root / "text",
        "ds": datatrove_tokenize(root / "text", root / "ds", tok_dir, seed=1),
        "megatron": datatrove_tokenize(root / "text", root / "mg", tok_dir, kind="megatron"),
    }


def stream_of(folder: Path, kind: str) -> np.ndarray:
    """The source's stream read straight from datatrove's files (their names sorted), no lmpretrain code."""
    if kind == "ds":
        return np.concatenate([np.fromfile(p, dtype="<u2") for p in sorted(folder.glob("*.ds"))])
    return np.concatenate([np.fromfile(p, dtype="<u2") for p in sorted(folder.glob("*.bin"))])


def grid(stream: np.ndarray, offset: int) -> Counter:
    n = len(stream) // SEQ
    at = (offset + np.arange(n)[:, None] * SEQ + np.arange(SEQ)) % len(stream)
    return Counter(map(tuple, stream[at].tolist()))


@pytest.mark.parametrize("kind", ["ds", "megatron", "megatron-prefix"])
def test_datatrove_folders_train_with_the_global_shuffle_and_resume_exactly(written, small_tokenizer, kind):
    folder = written["megatron" if kind.startswith("megatron") else kind]
    path = str(folder / "00000_tokens") if kind == "megatron-prefix" else str(folder)
    source = [SourceSpec(files=[path])]  # no format: inferred
    # data.add_bos unset: the folder's framing (no BOS), although this tokenizer has a distinct BOS.
    kw = dict(blocks_per_step=4, num_streams=4, seq_len=SEQ)
    ts = make(source, small_tokenizer, **kw)
    label = {"ds": "datatrove token files (.ds)"}.get(kind, "Megatron indexed dataset (.bin/.idx)")
    assert ts.shuffle == "global" and label in ts.describe() and ts.add_bos is False
    stream = stream_of(folder, "ds" if kind == "ds" else "megatron")
    if kind == "megatron-prefix":
        stream = np.fromfile(f"{path}.bin", dtype="<u2")
    n = len(stream) // SEQ
    results, _ = steps(ts, -(-n // 4) + 6)
    drawn = [tuple(b) for r in results for b in r.input_ids.tolist()]
    assert Counter(drawn[:n]) == grid(stream, ts.order.offset(0, 0))  # every block of the epoch once
    resumed = make(source, small_tokenizer, **kw)
    first = make(source, small_tokenizer, **kw)
    steps(first, 9)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    again, _ = steps(resumed, 6)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(again, results[9:15], strict=True))


def test_datatrove_documents_read_back_as_the_texts(written, small_tokenizer):
    """Read as documents (windows shuffle, held-out sets), a datatrove folder gives back every text once."""
    texts = Counter(json.loads(line)["text"] for p in sorted(written["text"].iterdir()) for line in open(p))
    from lmpretrain.data.sources import open_sources

    for kind in ("ds", "megatron"):
        [src] = open_sources([SourceSpec(files=[str(written[kind])])], small_tokenizer)
        docs = [small_tokenizer.decode(u.value) for p in src.pieces(4) for u in src.read(p, None)]
        assert Counter(docs) == texts and src.token_files.add_bos is False


def test_token_sources_framed_differently_need_add_bos_stated(written, small_tokenizer, tmp_path):
    """Unset, data.add_bos follows the token files; when they disagree the run cannot pick one."""
    from test_token_files import prepare

    ours = prepare(tmp_path, small_tokenizer)  # BOS before each document
    mixed = [SourceSpec(files=[str(written["ds"])]), SourceSpec(files=[str(ours)])]
    with pytest.raises(
        DataError, match=r"different add_bos \(.*add_bos=False, .*add_bos=True\); set data.add_bos"
    ):
        make(mixed, small_tokenizer, seq_len=SEQ)
    assert make([mixed[1]], small_tokenizer, seq_len=SEQ).add_bos is True


def test_refusals_name_the_fix(written, small_tokenizer, tmp_path):
    from lmpretrain.data.tokenizer import train_bpe

    def refused(path, match, **kw):
        with pytest.raises(DataError, match=match):
            make([SourceSpec(files=[str(path)], **kw)], small_tokenizer, add_bos=False)

    # Another tokenizer: ids outside this vocabulary (Megatron records no tokenizer), or datatrove's name.
    rng = random.Random(5)
    train_bpe([make_doc(f"d{i}", rng) for i in range(400)], vocab_size=600, out_dir=tmp_path / "big")
    other = tmp_path / "other"
    write_jsonl_shards(other, [30], max_words=60)
    refused(
        datatrove_tokenize(other, tmp_path / "mg-big", tmp_path / "big", kind="megatron"),
        r"token files hold id \d+, outside the tokenizer's vocabulary of 320",
    )
    train_bpe([make_doc(f"e{i}", rng) for i in range(400)], vocab_size=320, out_dir=tmp_path / "alt")
    refused(
        datatrove_tokenize(other, tmp_path / "ds-alt", tmp_path / "alt"),
        r"was tokenized with another tokenizer \('.*alt/tokenizer.json', datatrove's .ds.metadata\)",
    )
    # No EOS after each document (datatrove's step without eos_token): blocks would have no boundaries.
    refused(
        datatrove_tokenize(other, tmp_path / "ds-no-eos", written["tokenizer"], eos_token=None),
        "does not end with the tokenizer's EOS",
    )
    # A truncated shard, a missing sidecar, a folder of shards without its header.
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(written["ds"], cut)
    first = sorted(cut.glob("*.ds"))[0]
    first.write_bytes(first.read_bytes()[:-6])
    refused(cut, "is truncated or damaged: prepare it again")
    (cut / f"{first.name}.metadata").unlink()
    refused(cut, r"has no .*\.ds\.metadata \(tokenizer and token size\)")
    headless = tmp_path / "headless"
    headless.mkdir()
    (headless / "shard-00000.bin").write_bytes(b"\0\0" * 10)
    (headless / "shard-00000.idx").write_bytes(b"\0" * 16)
    refused(headless, "holds .bin files but no tokens.json .* its header or sidecar is missing")
    # The old parquet token cache of data/prepare.py, given as format: tokens, names the conversion.
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tokens_meta.json").write_text(json.dumps({"tokenizer": "gpt2"}))
    (cache / "tokens-00000-of-00001.parquet").write_bytes(b"PAR1")
    refused(
        cache,
        r"parquet token cache of an older lmpretrain .* python scripts/prepare_data.py --files \S+ --tokenizer "
        r"gpt2 --out \S+-tok",
        format="tokens",
    )


@pytest.mark.slow
def test_bad_token_folder_stops_the_recipe_with_one_message_before_the_model(written, tmp_path, stdlib_cache):
    cut = tmp_path / "cut"
    import shutil

    shutil.copytree(written["megatron"], cut)
    bin_ = sorted(cut.glob("*.bin"))[0]
    bin_.write_bytes(bin_.read_bytes()[:-2])
    run = rr.run(tmp_path / "run", *rr.QUICK, f"--data.train=[{{files: [{cut}]}}]", launch=None, check=False)
    assert run.returncode == 2, run.output[-3000:]
    assert "Traceback" not in run.output and "is truncated or damaged: prepare it again" in run.output
    assert "[lmpretrain] data:" not in run.output and " parameters; optimizer groups" not in run.output
