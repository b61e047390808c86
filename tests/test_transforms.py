"""data.transforms: a fork's functions over each document's text, applied to training and held-out
sources alike, whole documents at a time, counted when they drop one, resumable, and in the fingerprint."""

import json

import pytest
from data_helpers import documents, make, stream_tokens

from lmpretrain.config import DataConfig, SourceSpec
from lmpretrain.data import heldout_blocks
from lmpretrain.data.readers import CHUNK
from lmpretrain.data.sources import open_source
from lmpretrain.data.transforms import load_transforms
from lmpretrain.errors import CheckpointMismatchError, ConfigError, DataError
from lmpretrain.run.fingerprint import check_fingerprint

FILTERS = """
def keep_long_lowercased(text, source):
    return text.lower() if len(text) >= 200 else None


def longest_only(text):
    return text if len(text) > 100_000 else None


def not_text(text, source):
    return 3
"""


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A JSON Lines source of 6 long (mixed case) and 4 short documents, and a module of transforms."""
    (tmp_path / "filters.py").write_text(FILTERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    long = [f"Doc{i} " + "Alpha Beta " * (25 + i) for i in range(6)]
    short = [f"Short{i} Gamma" for i in range(4)]
    docs = [d for pair in zip(long, short + ["", ""], strict=True) for d in pair if d]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, long, short


def test_a_transform_keeps_and_rewrites_documents_and_counts_the_dropped_ones(corpus, small_tokenizer):
    path, long, short = corpus
    ts = make(
        [SourceSpec(files=[str(path)])],
        small_tokenizer,
        num_streams=1,
        shuffle="none",
        transforms=["filters:keep_long_lowercased"],
    )
    assert "transforms: filters:keep_long_lowercased" in ts.describe()
    it = ts.start()
    steps = [next(it) for _ in range(30)]
    texts = [text for began, text in documents(stream_tokens(steps, ts)[0], small_tokenizer) if began]
    assert texts[: len(long)] == [d.lower() for d in long]  # in order, lower-cased, no short document
    assert set(texts) == {d.lower() for d in long}
    # Counted as read: the first document window holds 64 kept documents, 10 passes of the 6 long ones and
    # the first 4 of the 11th, so 10 x 4 short ones and the 3 among those 4 were dropped.
    assert steps[0].filtered_docs == 43
    assert steps[-1].skipped_docs == 0  # dropped documents are not bad records
    fp = ts.fingerprint()["transforms"]
    assert fp[0]["name"] == "filters:keep_long_lowercased" and len(fp[0]["sha256"]) == 64
    ts.close()


def test_a_resumed_stream_continues_with_the_same_blocks_and_counts(corpus, small_tokenizer):
    path, _, _ = corpus
    kw = dict(num_streams=2, transforms=["filters:keep_long_lowercased"])
    ts = make([SourceSpec(files=[str(path)])], small_tokenizer, **kw)
    it = ts.start()
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(ts.state_dict()))  # as a checkpoint holds it
    after = [next(it) for _ in range(6)]
    resumed = make([SourceSpec(files=[str(path)])], small_tokenizer, **kw)
    resumed.load_state_dict(state)
    again = [b for b, _ in zip(resumed.start(), range(6), strict=False)]
    for a, b in zip(after, again, strict=True):
        assert a.input_ids.equal(b.input_ids) and a.filtered_docs == b.filtered_docs
    ts.close()
    resumed.close()


def test_a_transform_sees_a_long_document_whole(tmp_path, small_tokenizer, monkeypatch):
    """A text document of several 64 KiB reader units reaches the transform as one text."""
    (tmp_path / "filters.py").write_text(FILTERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    big = "Line of a long document\n" * (3 * CHUNK // 24)
    path = tmp_path / "corpus.txt"
    path.write_text("a short one\n<|sep|>" + big + "<|sep|>another short one\n")
    source = open_source(
        SourceSpec(files=[str(path)], separator="<|sep|>"), load_transforms(["filters:longest_only"])
    )
    items = list(source.read(source.pieces(1)[0], None))
    kept = [i for i in items if type(i).__name__ == "Unit"]
    assert [len(u.value) for u in kept] == [len(big)] and kept[0].bos and kept[0].eos
    assert [type(i).__name__ for i in items].count("Dropped") == 2


def test_the_held_out_set_is_transformed_like_training(corpus, small_tokenizer):
    path, long, _ = corpus
    data = DataConfig(
        eval=[SourceSpec(files=[str(path)])], seq_len=16, transforms=["filters:keep_long_lowercased"]
    )
    blocks = heldout_blocks(data, small_tokenizer, num_blocks=4)
    text = small_tokenizer.decode(blocks.flatten().tolist())
    assert "doc0 alpha beta" in text and "Doc0" not in text and "short" not in text.lower()


def test_bad_transforms_are_named_together_and_a_non_text_result_is_refused(corpus, small_tokenizer):
    with pytest.raises(ConfigError) as err:
        load_transforms(["no_colon", "no_such_module_xyz:f", "filters:missing"])
    assert len(err.value.problems) == 3
    assert "'no_colon' is not module:function" in err.value.problems[0]
    assert "cannot import 'no_such_module_xyz'" in err.value.problems[1]
    assert "'filters' has no function 'missing'" in err.value.problems[2]
    path, _, _ = corpus
    ts = make(
        [SourceSpec(files=[str(path)])], small_tokenizer, num_streams=1, transforms=["filters:not_text"]
    )
    with pytest.raises(DataError, match="filters:not_text returned int"):
        next(ts.start())
    ts.close()


def test_a_resume_with_other_transforms_is_refused_unless_the_data_may_change():
    saved = {"seq_len": 8, "transforms": [{"name": "m:a", "sha256": "1"}]}
    with pytest.raises(CheckpointMismatchError) as err:
        check_fingerprint(saved, {"seq_len": 8, "transforms": [{"name": "m:b", "sha256": "1"}]})
    assert "data.transforms: ['m:a'] -> ['m:b']" in str(err.value)
    assert "--run.allow_data_change=true" in str(err.value)
    with pytest.raises(CheckpointMismatchError, match="the file defining m:a changed"):
        check_fingerprint(saved, {"seq_len": 8, "transforms": [{"name": "m:a", "sha256": "2"}]})
    with pytest.raises(CheckpointMismatchError, match=r"\['m:a'\] -> none"):
        check_fingerprint(saved, {"seq_len": 8})
    lines = check_fingerprint(saved, {"seq_len": 8}, allow_data_change=True)
    assert lines == ["WARNING: resuming with other data.transforms (run.allow_data_change): ['m:a'] -> none"]


def test_prepare_data_applies_the_transform_before_tokenizing(corpus, small_tokenizer, tmp_path):
    from lmpretrain.data.prepare import write_token_files

    path, long, _ = corpus
    out = tmp_path / "tok"
    spec = SourceSpec(files=[str(path)])
    header = write_token_files(
        spec,
        small_tokenizer,
        out,
        transforms=load_transforms(["filters:keep_long_lowercased"]),
    )
    assert header["documents"] == len(long)  # the short ones were dropped

    def framed(docs):  # [BOS] ids EOS of each document
        return sum(len(small_tokenizer(d, add_special_tokens=False)["input_ids"]) + 2 for d in docs)

    assert header["tokens"] == framed([d.lower() for d in long]) != framed(long)


def test_a_forked_recipe_passes_functions_which_the_config_names_before_its_own(corpus):
    import filters

    from lmpretrain.config import load_config
    from recipe_runner import SMOKE

    cfg = load_config(
        [str(SMOKE), "--data.transforms=[filters:longest_only]"], transforms=[filters.keep_long_lowercased]
    )
    assert cfg.data.transforms == ["filters:keep_long_lowercased", "filters:longest_only"]
    assert [t.function for t in load_transforms(cfg.data.transforms).transforms] == [
        filters.keep_long_lowercased,
        filters.longest_only,
    ]


def test_with_other_transforms_a_restored_stream_goes_on_from_its_frontier(corpus, small_tokenizer):
    """run.allow_data_change: the documents read past the trained blocks were transformed the old way,
    so each stream goes on from the documents it would have read next, transformed the new way."""
    path, long, _ = corpus
    old = make([SourceSpec(files=[str(path)])], small_tokenizer, num_streams=1, shuffle="none",
               transforms=["filters:keep_long_lowercased"])  # fmt: skip
    it = old.start()
    for _ in range(3):
        next(it)
    state = old.state_dict()
    new = make([SourceSpec(files=[str(path)])], small_tokenizer, num_streams=1, shuffle="none")
    new.load_state_dict(state)
    frontier = state["streams"][0]["frontier"]["start"]
    assert new._states[0]["docs"]["start"] == frontier and new._states[0]["emitted"] == 0
    texts = [
        t for began, t in documents(stream_tokens([next(new.start())], new)[0], small_tokenizer) if began
    ]
    originals = set(long) | {f"Short{i} Gamma" for i in range(4)}
    assert texts and all(t in originals for t in texts)  # read on, no longer lower-cased nor filtered
    old.close()
    new.close()
