"""Training mixtures that change at resume, and the per-source token counts that show the realised mix."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import write_jsonl_shards
from data_helpers import TAG, by_stream, documents, make, steps

from lmpretrain.data import SourceSpec, merge_data_states
from lmpretrain.errors import CheckpointMismatchError
from lmpretrain.run import check_fingerprint

SETTINGS = dict(num_streams=2, blocks_per_step=8, seq_len=32, shuffle=False)


def sources(tmp_path, weights: dict[str, float], sizes: dict[str, int]) -> list[SourceSpec]:
    """One JSONL file per source; source `a` holds documents tagged a0.0, a0.1, ... in file order."""
    specs = []
    for name, weight in weights.items():
        path = write_jsonl_shards(tmp_path / name, [sizes[name]], prefix=name, seed=ord(name), max_words=20)
        specs.append(SourceSpec(files=path, weight=weight))
    return specs


def stream_docs(results, ts) -> dict[int, list[tuple[str, int]]]:
    """Each stream's complete documents as (source, index in its file), in order."""
    tokens = {s: [] for s in ts.owned}
    for r in results:
        for s, blocks in by_stream(r.input_ids, ts).items():
            tokens[s] += blocks.flatten().tolist()
    out = {}
    for s, toks in tokens.items():
        tags = [TAG.match(text).group(1) for _, text in documents(toks, ts.tokenizer)]
        out[s] = [(tag[0], int(tag.split(".")[1])) for tag in tags]
    return out


def line_at(path: str, offset: int) -> int:
    """Index of the JSON line that starts at byte `offset`."""
    return Path(path).read_bytes()[:offset].count(b"\n")


def test_a_changed_mixture_at_resume_follows_the_new_weights_and_sources_continue(tmp_path, small_tokenizer):
    sizes = {"a": 4000, "b": 4000, "c": 50}
    before = sources(tmp_path, {"a": 1, "b": 1}, sizes)
    ts = make(before, small_tokenizer, **SETTINGS)
    first, _ = steps(ts, 40)
    state = merge_data_states([ts.state_dict()])
    names = ts.source_names
    assert names[0].endswith("_a_a-000.jsonl") and names[1].endswith("_b_b-000.jsonl")
    assert all(len(n) <= 80 and "/" not in n for n in names)
    # The counters are exact: every token of every block is counted for the source it came from.
    assert sum(first[-1].sources.values()) == 40 * 8 * 32

    after = sources(tmp_path, {"a": 3, "b": 1}, sizes)
    resumed = make(after, small_tokenizer, **SETTINGS)
    resumed.load_state_dict(state)
    second, _ = steps(resumed, 120)
    grew = {n: second[-1].sources[n] - first[-1].sources[n] for n in names}
    assert sum(grew.values()) == 120 * 8 * 32  # counting goes on from the checkpoint's counts

    old, new = stream_docs(first, ts), stream_docs(second, resumed)
    drawn = [src for s in new for src, _ in new[s]]
    share, n = drawn.count("a") / len(drawn), len(drawn)
    assert n > 700 and abs(share - 0.75) < 3 * math.sqrt(0.75 * 0.25 / n), (share, n)
    early = [src for s in old for src, _ in old[s]]
    assert abs(early.count("a") / len(early) - 0.5) < 3 * math.sqrt(0.25 / len(early))
    # Tokens follow documents (both sources' documents have the same length distribution).
    assert abs(grew[names[0]] / sum(grew.values()) - 0.75) < 0.05

    # Each source continues where its reader was: the next document of stream s is the one at the saved
    # frontier (each file is two pieces, one per stream, read in order), so nothing is read twice.
    assert [len(src.pieces(2)) for src in resumed.sources] == [2, 2]
    for s in ts.owned:
        frontier = state["streams"][s]["frontier"]["start"]["sources"]
        for k, name in enumerate("ab"):
            was = [i for src, i in old[s] if src == name]
            now = [i for src, i in new[s] if src == name]
            assert now[0] == line_at(after[k].files[0], frontier[k]["at"][0]) > was[-1]
            assert now == list(range(now[0], now[0] + len(now)))  # then on in order

    # Remove b, add c: a still continues; c starts at its beginning.
    swapped = make(sources(tmp_path, {"a": 1, "c": 1}, sizes), small_tokenizer, **SETTINGS)
    swapped.load_state_dict(state)
    third = stream_docs(steps(swapped, 10)[0], swapped)
    for s in ts.owned:
        line = line_at(after[0].files[0], state["streams"][s]["frontier"]["start"]["sources"][0]["at"][0])
        assert [i for src, i in third[s] if src == "a"][0] == line
        assert [i for src, i in third[s] if src == "c"][:3] == [s, s + 2, s + 4]  # one piece, shared
    assert not any(src == "b" for docs in third.values() for src, _ in docs)


def test_an_unchanged_mixture_resumes_exactly_with_its_counts(tmp_path, small_tokenizer):
    specs = sources(tmp_path, {"a": 1, "b": 2}, {"a": 300, "b": 300})
    ts = make(specs, small_tokenizer, **{**SETTINGS, "shuffle": True})
    _, it = steps(ts, 12)
    state = ts.state_dict()
    more, _ = steps(ts, 6, it)
    resumed = make(specs, small_tokenizer, **{**SETTINGS, "shuffle": True})
    resumed.load_state_dict(state)
    again, _ = steps(resumed, 6)
    for a, b in zip(more, again, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and a.sources == b.sources
    assert sum(again[-1].sources.values()) == 18 * 8 * 32


def fingerprint_of(specs, tok) -> dict:
    return {**make(specs, tok, **SETTINGS).fingerprint(), "world_size": 1, "global_batch": 8}


def test_a_mixture_change_is_refused_without_the_flag_and_said_in_one_line(tmp_path, small_tokenizer):
    from lmpretrain.data import mixture_change

    sizes = {"a": 20, "b": 20, "c": 20}
    saved = fingerprint_of(sources(tmp_path, {"a": 1, "b": 1}, sizes), small_tokenizer)
    new_mix = sources(tmp_path, {"a": 3, "c": 1}, sizes)
    current = fingerprint_of(new_mix, small_tokenizer)
    with pytest.raises(CheckpointMismatchError) as err:
        check_fingerprint(saved, current)
    assert "--run.allow_data_change=true" in str(err.value)
    assert check_fingerprint(saved, current, allow_data_change=True) == []
    line = mixture_change(saved, current, step=40)
    a, b, c = (f"files:{tmp_path}/{x}/{x}-000.jsonl" for x in "abc")
    assert line.startswith(
        f"resumed with a new data mixture from step 40: {a} weight 1 -> 3 (50% -> 75%); {c} added "
        f"(weight 1, 25%); {b} removed"
    )
    assert mixture_change(saved, saved, step=40) is None
    # A source whose files changed is not a mixture change: that still needs run.allow_mismatch.
    with open(f"{tmp_path}/a/a-000.jsonl", "a") as f:
        f.write('{"text": "<a0.x> more"}\n')
    grown = fingerprint_of(new_mix, small_tokenizer)
    with pytest.raises(CheckpointMismatchError, match=rf"sources\[{a}\].expanded.bytes"):
        check_fingerprint(saved, grown, allow_data_change=True)


# ---- the recipe on two ranks: global counters, a refused and an allowed change of mix -------------------------


def bad_jsonl(folder: Path, prefix: str, n: int) -> str:
    """JSON Lines with `n` documents and a malformed record after every 10th (skipped, counted)."""
    path = write_jsonl_shards(folder, [n], prefix=prefix, seed=ord(prefix), max_words=20)[0]
    lines = Path(path).read_text().splitlines(keepends=True)
    Path(path).write_text(
        "".join(line + ('{"text": \n' if i % 10 == 9 else "") for i, line in enumerate(lines))
    )
    return path


@pytest.mark.slow
def test_two_ranks_log_global_counters_and_resume_onto_a_new_mix(tmp_path, stdlib_cache):
    import recipe_runner as rr
    from lmpretrain.config import load_config
    from lmpretrain.data import TrainStream, load_tokenizer

    a, b = bad_jsonl(tmp_path / "a", "a", 150), bad_jsonl(tmp_path / "b", "b", 400)
    mix = "--data.train=[{{files: [{}], weight: {}}}, {{files: [{}], weight: {}}}]"
    quick = [*rr.QUICK, "--eval.batches=1", "--eval.every=0", "--checkpoint.every=10"]
    out = tmp_path / "run"
    first = rr.run(out, *quick, mix.format(a, 1, b, 1), "--train.max_steps=10", launch="cpu-ddp")
    row = first.metrics()[-1]
    assert row["step"] == 10

    # What every stream together did by step 10, from one process owning all of them; and rank 0's own.
    cfg = load_config([str(rr.SMOKE), mix.format(a, 1, b, 1)])
    tok = load_tokenizer(cfg.data.tokenizer)
    whole, rank0 = (
        steps(TrainStream(cfg.data, tok, blocks_per_step=16, rank=0, world_size=w, seed=cfg.run.seed), 10)[0][
            -1
        ]
        for w in (1, 2)
    )
    names = [f"data/{n}/tokens" for n in whole.sources]
    assert row["train/skipped_docs"] == whole.skipped_docs > rank0.skipped_docs > 0
    assert row["train/epoch"] == whole.epoch
    assert [row[n] for n in names] == list(whole.sources.values())
    assert sum(row[n] for n in names) == row["train/tokens_seen"] == 10 * 16 * 64

    refused = rr.run(
        out, *quick, mix.format(a, 3, b, 1), "--train.max_steps=40", launch="cpu-ddp", check=False
    )
    assert refused.returncode != 0 and "--run.allow_data_change=true" in refused.output
    assert "weight 1 -> 3 (50% -> 75%)" in refused.output

    second = rr.run(
        out,
        *quick,
        mix.format(a, 3, b, 1),
        "--train.max_steps=40",
        "--run.allow_data_change=true",
        launch="cpu-ddp",
    )
    assert (
        f"resumed with a new data mixture from step 10: files:{a} weight 1 -> 3 (50% -> 75%)" in second.output
    )
    last = second.metrics()[-1]
    grew = [last[n] - row[n] for n in names]
    assert sum(grew) == 30 * 16 * 64
    assert abs(grew[0] / sum(grew) - 0.75) < 0.06, grew
