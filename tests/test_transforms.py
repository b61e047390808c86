"""data.transforms: a fork's functions over each document's text, applied to training and held-out
sources alike, whole documents at a time, counted when they drop one, resumable, and in the fingerprint."""

import json
import re

import pytest
from data_helpers import documents, make, stream_tokens

from lmpretrain.config import DataConfig, SourceSpec
from lmpretrain.data import heldout_blocks
from lmpretrain.data.cursor import SourceCursor
from lmpretrain.data.readers import CHUNK
from lmpretrain.data.sources import open_source
from lmpretrain.data.transforms import TransformError, load_transforms
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
    transforms = load_transforms(["filters:longest_only"])
    source = open_source(SourceSpec(files=[str(path)], separator="<|sep|>"), transforms)
    assert len(list(source.read(source.pieces(1)[0], None))) == 3  # the long one comes as one unit
    cursor = SourceCursor(source, 0, 0, 1, seed=0, shuffle=False, transform=transforms.chain())
    kept = cursor.next_unit()
    assert len(kept.value) == len(big) and kept.bos and kept.eos and cursor.filtered == 1
    cursor.next_unit()  # the next pass: the short ones dropped again
    assert cursor.filtered == 3 and cursor.epoch == 1


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


# ---- transforms with state, token files, errors ---------------------------------------------------------------

DEDUP = "examples/data_transforms.py:ExactDedup"
RAISING = """
def boom(text, source):
    if "Doc3" in text:
        raise ValueError("cannot handle Doc3")
    return text


class NoState:
    def __call__(self, text, source):
        return text


class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def __call__(self, text, source):
        return text

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
"""


@pytest.fixture
def duplicated(tmp_path):
    """One JSON Lines file (one piece, shared by the streams) of 150 distinct documents, each 3 times in a row."""
    docs = [f"Doc{i} " + "word " * (5 + i % 7) for i in range(150) for _ in range(3)]
    path = tmp_path / "dups.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_a_stateful_dedup_sees_its_streams_share_only_and_keeps_its_state_per_stream(
    tmp_path, small_tokenizer
):
    """Distinct documents: nothing is dropped, whatever the streams (a dedup that ran before the streams
    took their shares dropped each stream's documents as seen by the others)."""
    path = tmp_path / "distinct.jsonl"
    path.write_text("".join(json.dumps({"text": f"Doc{i} " + "word " * 9}) + "\n" for i in range(120)))
    kw = dict(num_streams=3, transforms=[DEDUP], doc_shuffle_window=4)
    ts = make([SourceSpec(files=[str(path)])], small_tokenizer, **kw)
    assert "state kept per stream: examples/data_transforms.py:ExactDedup" in ts.describe()
    steps = [b for b, _ in zip(ts.start(), range(6), strict=False)]
    assert steps[-1].filtered_docs == 0
    state = ts.state_dict()["streams"]
    seen = [set(state[s]["frontier"]["start"]["transforms"][DEDUP]["seen"]) for s in range(3)]  # read so far
    assert all(seen) and not (seen[0] & seen[1] or seen[1] & seen[2] or seen[0] & seen[2])  # per stream
    ts.close()


def test_a_stateful_dedup_drops_copies_and_a_resume_continues_exactly(duplicated, small_tokenizer):
    kw = dict(num_streams=2, transforms=[DEDUP], doc_shuffle_window=8)
    ts = make([SourceSpec(files=[str(duplicated)])], small_tokenizer, **kw)
    it = ts.start()
    while ts.state_dict()["streams"][0]["docs"]["window"] < 2:  # past the first windows: a state that matters
        next(it)
    state = json.loads(json.dumps(ts.state_dict()))  # as a checkpoint holds it: plain data
    assert all(s["docs"]["start"]["transforms"][DEDUP]["seen"] for s in state["streams"].values())
    after = [next(it) for _ in range(12)]
    assert after[-1].filtered_docs > 0  # copies were dropped
    resumed = make([SourceSpec(files=[str(duplicated)])], small_tokenizer, **kw)
    resumed.load_state_dict(state)
    again = [b for b, _ in zip(resumed.start(), range(12), strict=False)]
    for a, b in zip(after, again, strict=True):
        assert a.input_ids.equal(b.input_ids) and a.filtered_docs == b.filtered_docs
    # the same resume without the transforms' state re-reads documents its window had seen: blocks differ
    for s in state["streams"].values():
        s["docs"]["start"].pop("transforms")
    fresh = make([SourceSpec(files=[str(duplicated)])], small_tokenizer, **kw)
    fresh.load_state_dict(state)
    other = [b for b, _ in zip(fresh.start(), range(12), strict=False)]
    assert any(not a.input_ids.equal(b.input_ids) for a, b in zip(after, other, strict=True))
    for stream in (ts, resumed, fresh):
        stream.close()


def test_transform_classes_need_state_methods_and_a_plain_constructor(tmp_path, monkeypatch):
    (tmp_path / "raising.py").write_text(RAISING)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_transforms(["raising:NoState", "raising:NeedsArgs"])
    assert "raising:NoState is a class without state_dict, load_state_dict" in err.value.problems[0]
    assert (
        "raising:NeedsArgs is a class that cannot be built with no arguments (TypeError"
        in err.value.problems[1]
    )
    assert load_transforms([DEDUP]).stateful == [DEDUP]


def test_a_transform_that_raises_is_named_with_the_source_and_the_document(corpus, small_tokenizer, tmp_path):
    path, long, _ = corpus
    (tmp_path / "raising.py").write_text(RAISING)
    ts = make([SourceSpec(files=[str(path)])], small_tokenizer, num_streams=1, transforms=["raising:boom"])
    with pytest.raises(TransformError) as err:
        next(ts.start())
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "Doc3" in text)
    assert str(err.value) == (
        f"data.transforms: raising:boom raised ValueError: cannot handle Doc3 on the document at {path} line "
        f"{line} (source files:{path}); fix the transform, or have it return None to drop such a document"
    )
    ts.close()


def test_prepare_records_the_transforms_and_a_token_source_given_others_is_refused(
    corpus, small_tokenizer, tmp_path
):
    from lmpretrain.data.prepare import write_token_files

    path, long, _ = corpus
    transforms = load_transforms(["filters:keep_long_lowercased"])
    header = write_token_files(
        SourceSpec(files=[str(path)]), small_tokenizer, tmp_path / "tok", transforms=transforms
    )
    assert header["transforms"] == transforms.fingerprint() and header["filtered"] == 4
    assert len(header["transforms"][0]["sha256"]) == 64
    plain = write_token_files(SourceSpec(files=[str(path)]), small_tokenizer, tmp_path / "plain")
    assert plain["transforms"] == [] and plain["filtered"] == 0
    data = DataConfig(train=[SourceSpec(files=[str(tmp_path / "tok")])], tokenizer="small", seq_len=16)
    # prepared with these transforms: accepted (not applied again), and in the fingerprint
    ts = make(data.train, small_tokenizer, transforms=["filters:keep_long_lowercased"], tokenizer="small")
    assert ts.fingerprint()["sources"][0]["transforms"] == transforms.fingerprint()
    ts.close()
    refused = (
        f"source files:{tmp_path / 'plain'} is token files, which data.transforms (filters:longest_only)"
    )
    with pytest.raises(DataError, match=re.escape(refused)) as err:
        make([SourceSpec(files=[str(tmp_path / "plain")])], small_tokenizer, transforms=["filters:longest_only"],
             tokenizer="small")  # fmt: skip
    assert "they were prepared without them" in str(err.value)
    assert (
        f"python scripts/prepare_data.py --files {path} --tokenizer small --transform filters:longest_only "
        f"--out {tmp_path / 'plain'}-transformed" in str(err.value)
    )
    with pytest.raises(DataError, match=r"they were prepared with \['filters:keep_long_lowercased'\]"):
        make(
            [SourceSpec(files=[str(tmp_path / "tok")])], small_tokenizer, transforms=["filters:longest_only"]
        )
    with pytest.raises(DataError, match="stateful examples/data_transforms.py:ExactDedup cannot run there"):
        make([SourceSpec(files=[str(tmp_path / "tok")])], small_tokenizer,
             transforms=["filters:keep_long_lowercased", DEDUP])  # fmt: skip
    with pytest.raises(DataError, match="keeps state"):
        write_token_files(
            SourceSpec(files=[str(path)]),
            small_tokenizer,
            tmp_path / "x",
            transforms=load_transforms([DEDUP]),
        )


def test_token_files_whose_transform_file_was_edited_are_refused_and_the_command_keeps_their_dedup(
    corpus, small_tokenizer, tmp_path
):
    """The header records each transform's file sha256: an edit of that file since the prepare refuses the
    run (the run would otherwise claim a filter the tokens never saw), and the prepare command it names
    applies the dedup the header records too."""
    from lmpretrain.data.prepare import write_token_files

    path, _, _ = corpus
    mine = tmp_path / "mine.py"
    mine.write_text("def keep_long(text, source):\n    return text if len(text) >= 200 else None\n")
    transform = f"{mine}:keep_long"
    header = write_token_files(
        SourceSpec(files=[str(path)]), small_tokenizer, tmp_path / "tok", transforms=load_transforms([transform]),
        dedup="exact",
    )  # fmt: skip
    assert header["transforms"][0]["name"] == transform and header["dedup"]["method"] == "exact"
    assert header["filtered"] == 4 and header["documents"] == 6  # the 4 short documents; no copies
    ts = make([SourceSpec(files=[str(tmp_path / "tok")])], small_tokenizer, transforms=[transform])
    ts.close()  # accepted as prepared
    mine.write_text(mine.read_text() + "# edited\n")
    with pytest.raises(DataError) as err:
        make(
            [SourceSpec(files=[str(tmp_path / "tok")])],
            small_tokenizer,
            transforms=[transform],
            tokenizer="small",
        )
    assert str(err.value) == (
        f"source files:{tmp_path / 'tok'} is token files, which data.transforms ({transform}) cannot change (they "
        "hold tokens, not text), and the files defining them changed since the token files were prepared (sha256 "
        "differs). Prepare them with the transforms, then train on that folder with the same data.transforms (or "
        f"none): python scripts/prepare_data.py --files {path} --tokenizer small --transform {transform} --dedup "
        f"exact --out {tmp_path / 'tok'}-transformed; or train on the text source (without `format: tokens`)"
    )


def test_the_prepare_command_for_token_files_of_a_builtin_names_the_builtin(
    stdlib_cache, corpus, small_tokenizer, tmp_path
):
    from lmpretrain.data.prepare import write_token_files

    header = write_token_files(
        SourceSpec(name="python-stdlib", split="validation"), small_tokenizer, tmp_path / "v"
    )
    assert header["source"] == "python-stdlib:validation" and header["transforms"] == []
    with pytest.raises(DataError, match="they were prepared without them") as err:
        make([SourceSpec(files=[str(tmp_path / "v")])], small_tokenizer, transforms=[DEDUP, "filters:longest_only"],
             tokenizer="small")  # fmt: skip
    assert (
        "python scripts/prepare_data.py --builtin python-stdlib --split validation --tokenizer small --transform "
        "filters:longest_only --out data/python-stdlib-validation-transformed (the stateful "
        f"{DEDUP} cannot run there: deduplicate with --dedup exact or --dedup minhash)" in str(err.value)
    )


def test_docs_forking_shows_the_tested_dedup_class_as_it_is():
    """docs/forking.md's stateful dedup is examples/data_transforms.py:ExactDedup (the class the kill -9
    resume test runs), its docstring left out."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    source = (root / "examples" / "data_transforms.py").read_text()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "ExactDedup")
    lines, docstring = source.splitlines(), cls.body[0]
    shown = lines[cls.lineno - 1 : docstring.lineno - 1] + lines[docstring.end_lineno + 1 : cls.end_lineno]
    blocks = re.findall(r"```python\n(.*?)```", (root / "docs" / "forking.md").read_text(), flags=re.S)
    assert "\n".join(shown) + "\n" in blocks, "docs/forking.md: not examples/data_transforms.py:ExactDedup"
