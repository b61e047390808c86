"""A token source is one stream across its shards: every token position drawn once per epoch (up to the
tail) whatever the ranks and workers, a new grid offset per epoch, exact resume mid-epoch; at most
data.max_open_files descriptors per process (also through the recipe under `ulimit -n 256`); mixtures
that change at resume under the global shuffle, each source going on with its own permutation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import Counter

import numpy as np
import pytest
import torch
from data_helpers import by_stream, make, steps, write_token_folder

import recipe_runner as rr
from lmpretrain.data import SourceSpec, merge_data_states
from lmpretrain.data.token_files import TokenFiles, open_token_files

SEQ = 16


@pytest.fixture(scope="module")
def uneven(tmp_path_factory, small_tokenizer):
    """1,000 shards of 1-3 documents of 3-40 tokens: many shards shorter than a block."""
    rng = np.random.default_rng(7)
    shards = [rng.integers(3, 41, rng.integers(1, 4)).tolist() for _ in range(1000)]
    folder = tmp_path_factory.mktemp("uneven") / "tok"
    stream = write_token_folder(folder, shards, small_tokenizer)
    return folder, stream


def positions(stream: np.ndarray) -> dict[tuple, int]:
    """Where each seq_len window of the (cyclic) stream starts; windows seen twice are left out."""
    at = (np.arange(len(stream))[:, None] + np.arange(SEQ)) % len(stream)
    seen: dict[tuple, int] = {}
    twice = set()
    for start, window in enumerate(map(tuple, stream[at].tolist())):
        if window in seen:
            twice.add(window)
        seen[window] = start
    return {w: s for w, s in seen.items() if w not in twice}


def global_blocks(per_step: list[dict[int, torch.Tensor]], counts: list[int]) -> list[tuple]:
    """The steps' blocks in global order (block j of a step is row j // S of stream j % S)."""
    num = len(counts)
    return [tuple(step[j % num][j // num].tolist()) for step in per_step for j in range(sum(counts))]


def read_steps(
    folder, tok, count, world_size=1, workers=0, state=None, **kw
) -> list[dict[int, torch.Tensor]]:
    """Per step, every stream's blocks, read by `world_size` ranks with `workers` each (from `state`)."""
    per_rank = []
    for rank in range(world_size):
        ts = make(
            [SourceSpec(files=[str(folder)])],
            tok,
            rank=rank,
            world_size=world_size,
            num_workers=workers,
            **kw,
        )
        if state is not None:
            ts.load_state_dict(state)
        per_rank.append((ts, steps(ts, count)[0]))
        ts.close()
    return [
        {s: b for ts, res in per_rank for s, b in by_stream(res[i].input_ids, ts).items()}
        for i in range(count)
    ]


KW = dict(blocks_per_step=40, num_streams=4, seq_len=SEQ)


@pytest.mark.slow
@pytest.mark.parametrize("world_size,workers", [(1, 0), (2, 2)])
def test_an_epoch_draws_every_token_position_once_across_1000_uneven_shards(
    uneven, small_tokenizer, world_size, workers
):
    folder, stream = uneven
    total = len(stream)
    n = total // SEQ
    where = positions(stream)
    ts = make([SourceSpec(files=[str(folder)])], small_tokenizer, **KW)
    assert len(ts.sources[0].token_files.shards) == 1000
    offsets = [ts.order.offset(0, e) for e in (0, 1)]
    assert offsets[0] != offsets[1]
    count = -(-2 * n // 40)
    drawn = global_blocks(read_steps(folder, small_tokenizer, count, world_size, workers, **KW), ts.counts)
    shard_ends = set(ts.sources[0].token_files.starts[1:-1].tolist())
    for epoch in (0, 1):
        # Every block is a window of the stream, found by its tokens.
        starts = [where[b] for b in drawn[epoch * n : (epoch + 1) * n]]
        covered = np.zeros(total, dtype=np.int64)
        np.add.at(covered, (np.array(starts)[:, None] + np.arange(SEQ)) % total, 1)
        # Every token once, except the total % seq_len just before the epoch's offset (the tail).
        tail = (offsets[epoch] - 1 - np.arange(total % SEQ)) % total
        assert covered.max() == 1 and sorted(np.flatnonzero(covered == 0).tolist()) == sorted(tail.tolist())
        assert all((s - offsets[epoch]) % SEQ == 0 for s in starts)  # on the epoch's grid
        spanning = sum(any(s < e < s + SEQ for e in shard_ends) for s in starts)
        assert spanning > 800  # of the 999 shard ends, those not on the grid lie inside a block
    # A grid restarting in every shard would never draw each shard's last partial block: 16% of the tokens.
    per_shard_grid = int(sum((ts.sources[0].token_files.shard_tokens // SEQ) * SEQ))
    assert total - n * SEQ < SEQ and (total - per_shard_grid) / total > 0.15


@pytest.mark.slow
def test_resume_mid_epoch_is_exact_on_two_ranks_with_workers(uneven, small_tokenizer):
    folder, stream = uneven
    n = len(stream) // SEQ
    straight = read_steps(folder, small_tokenizer, 30, **KW)
    assert 12 * 40 < n  # step 12 is mid-epoch
    first = make([SourceSpec(files=[str(folder)])], small_tokenizer, **KW)
    steps(first, 12)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = read_steps(folder, small_tokenizer, 18, world_size=2, workers=2, state=state, **KW)
    for a, b in zip(straight[12:], resumed, strict=True):
        assert sorted(a) == sorted(b) and all(torch.equal(a[s], b[s]) for s in a)


# ---- bounded resources ------------------------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_descriptors_stay_within_max_open_files_over_every_source(tmp_path, small_tokenizer):
    rng = np.random.default_rng(3)
    folder = tmp_path / "tok"
    stream = write_token_folder(folder, [[int(x)] for x in rng.integers(5, 60, 2000)], small_tokenizer)
    other = write_token_folder(
        tmp_path / "tok2", [[int(x)] for x in rng.integers(5, 60, 500)], small_tokenizer
    )
    before = open_fds()
    files = TokenFiles([str(folder)], max_open_files=8)
    blocks = files.read_blocks(np.arange(0, len(stream) - SEQ, 7), SEQ)
    assert files.open_files() == 8 and open_fds() - before == 8
    at = (np.arange(0, len(stream) - SEQ, 7)[:, None] + np.arange(SEQ)) % len(stream)
    assert np.array_equal(blocks, stream[at])  # reads across shards, descriptors closed and reopened
    # A second source in the same process shares the 8 (each source had 8 of its own before).
    second = TokenFiles([str(tmp_path / "tok2")], max_open_files=8)
    assert np.array_equal(second.read_blocks(np.arange(0, len(other) - SEQ, 5), SEQ)[0], other[:SEQ])
    assert (
        open_token_files() == 8 and open_fds() - before == 8 and second.open_files() + files.open_files() == 8
    )
    docs = [u.value for piece in files.pieces(4) for u in files.units(piece, None)]
    assert files.open_files() == 8 and second.open_files() == 0 and len(docs) == 2000
    assert np.array_equal(np.concatenate([[0, *d, 1] for d in docs]), stream)  # documents from the index
    files.close()
    second.close()
    assert open_fds() == before and open_token_files() == 0


def test_a_global_shuffle_fingerprint_names_its_epoch_offset(uneven, small_tokenizer):
    from lmpretrain.run.fingerprint import FINGERPRINT_NAMES

    folder, _ = uneven
    on = make([SourceSpec(files=[str(folder)])], small_tokenizer).fingerprint()
    off = make([SourceSpec(files=[str(folder)])], small_tokenizer, epoch_offset=False).fingerprint()
    assert on["epoch_offset"] is True and off["epoch_offset"] is False and "epoch_offset" in FINGERPRINT_NAMES


def test_max_open_files_must_leave_descriptors_to_the_run():
    import resource

    from lmpretrain.config import DataConfig, data_problems

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no descriptor limit to check against")
    assert data_problems(DataConfig(max_open_files=soft // 4), 1) == []
    [problem] = data_problems(DataConfig(max_open_files=soft), 1)
    assert f"data.max_open_files={soft} leaves too few of this process's {soft} file descriptors" in problem
    assert data_problems(DataConfig(max_open_files=0), 1) == ["data.max_open_files must be >= 1"]


@pytest.mark.slow
def test_2000_shards_train_and_resume_under_ulimit_256_on_two_ranks_with_workers(tmp_path, stdlib_cache):
    from conftest import write_jsonl_shards

    from lmpretrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:python-stdlib")
    rng = np.random.default_rng(5)
    folder = tmp_path / "tok"
    write_token_folder(folder, [rng.integers(20, 200, 2).tolist() for _ in range(2000)], tok, ids=(3, 8000))
    val = write_jsonl_shards(tmp_path / "val", [40], prefix="val", max_words=60)[0]
    args = [
        *rr.QUICK,
        f"--data.train=[{{files: [{folder}]}}]",
        f"--data.eval=[{{files: [{val}]}}]",
        "--data.num_workers=2",
        "--eval.every=0",
        "--eval.batches=1",
        "--checkpoint.every=3",
        "--train.max_steps=8",
        "--logging.wandb_mode=disabled",
    ]

    def under_ulimit(out, *more) -> list[str]:  # ulimit -n 256 for the launcher, the ranks and their workers
        return [
            "bash",
            "-c",
            'ulimit -n 256 && exec "$@"',
            "ulimit",
            *rr.command(out, *args, *more, launch="cpu-ddp"),
        ]

    straight = rr.run_command(under_ulimit(tmp_path / "straight"), tmp_path / "straight")
    assert "tokens, 2000 files" in straight.output
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        under_ulimit(out),
        cwd=rr.ROOT,
        env=rr.env_for_runs(),
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    rr.wait_for_step(proc, out, 4)
    rr.kill_tree(proc, signal.SIGKILL)
    proc.wait(timeout=120)
    assert rr.read_metrics(out)[-1]["step"] < 8
    resumed = rr.run_command(under_ulimit(out), out)
    assert "resum" in resumed.output.lower() and "Too many open files" not in resumed.output
    assert rr.file_sha256(straight.out / "final" / "model.safetensors") == rr.file_sha256(
        out / "final" / "model.safetensors"
    )
    assert resumed.losses() and all(straight.losses()[k] == v for k, v in resumed.losses().items())


# ---- mixtures that change at resume, under the global shuffle ----------------------------------------------


def mix_sources(tmp_path, tok, weights: dict[str, float]) -> list[SourceSpec]:
    """One token folder per source; source a holds ids in [3, 100), b in [100, 200), c in [200, 300)."""
    specs = []
    for name, weight in weights.items():
        folder = tmp_path / name
        if not folder.exists():
            lo = {"a": 3, "b": 100, "c": 200}[name]
            rng = np.random.default_rng(ord(name))
            write_token_folder(
                folder, [rng.integers(10, 60, 3).tolist() for _ in range(40)], tok, (lo, lo + 97)
            )
        specs.append(SourceSpec(files=[str(folder)], weight=weight))
    return specs


def source_of(block: tuple) -> str:
    return "abc"[max(block) // 100]


def own_order(tmp_path, tok, name: str, source_id: int, count: int) -> list[tuple]:
    """A source's blocks in its own permutations (epoch after epoch), as the source with id `source_id`."""
    ts = make(mix_sources(tmp_path, tok, {name: 1}), tok, **MIX)
    ts.order.set_source_ids([source_id])
    draws, _ = ts.order.next_draws(ts.order.initial_state(), count)
    return [tuple(b) for b in ts.order.read(draws).tolist()]


MIX = dict(blocks_per_step=8, num_streams=2, seq_len=SEQ)


def two_ranks(specs, tok, count, state=None) -> tuple[list[tuple], dict]:
    """`count` steps' blocks in global order, read by 2 ranks (from `state`), and their merged state."""
    per_rank = []
    for rank in (0, 1):
        ts = make(specs, tok, rank=rank, world_size=2, **MIX)
        if state is not None:
            ts.load_state_dict(json.loads(json.dumps(state)))
        per_rank.append((ts, steps(ts, count)[0]))
    per_step = [
        {s: b for ts, res in per_rank for s, b in by_stream(res[i].input_ids, ts).items()}
        for i in range(count)
    ]
    merged = merge_data_states([ts.state_dict() for ts, _ in per_rank])
    return global_blocks(per_step, per_rank[0][0].counts), merged


def test_a_mixture_change_at_resume_keeps_each_source_on_its_own_permutation(tmp_path, small_tokenizer):
    tok = small_tokenizer
    first, state = two_ranks(mix_sources(tmp_path, tok, {"a": 1, "b": 1}), tok, 20)
    assert abs(Counter(map(source_of, first))["a"] / len(first) - 0.5) < 0.12

    # Weight change: a 3 : b 1 from step 20; each source goes on where it was in its own order.
    second, _ = two_ranks(mix_sources(tmp_path, tok, {"a": 3, "b": 1}), tok, 40, state)
    share = Counter(map(source_of, second))["a"] / len(second)
    assert abs(share - 0.75) < 0.07, share
    for name, sid in (("a", 0), ("b", 1)):
        seen = [b for b in first + second if source_of(b) == name]
        assert seen == own_order(tmp_path, tok, name, sid, len(seen))  # no block repeated or skipped

    # b removed, c added (after a): a still continues its order; c, a new id, starts at its beginning.
    third, after = two_ranks(mix_sources(tmp_path, tok, {"a": 1, "c": 1}), tok, 20, state)
    assert after["mixture"] == [
        {"source": f"files:{tmp_path}/a", "id": 0, "weight": 1},
        {"source": f"files:{tmp_path}/c", "id": 2, "weight": 1},
    ]
    a_seen = [b for b in first + third if source_of(b) == "a"]
    assert a_seen == own_order(tmp_path, tok, "a", 0, len(a_seen))
    c_seen = [b for b in third if source_of(b) == "c"]
    assert len(c_seen) > 40 and c_seen == own_order(tmp_path, tok, "c", 2, len(c_seen))
    assert not any(source_of(b) == "b" for b in third)
    # The source counters follow their sources, not list positions.
    tokens = dict(zip([m["source"] for m in after["mixture"]], after["streams"][0]["tokens"], strict=True))
    assert tokens[f"files:{tmp_path}/a"] == SEQ * len(a_seen)
