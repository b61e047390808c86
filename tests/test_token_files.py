"""Token files (`format: tokens`) and the global shuffle: the on-disk layout, an atomic multi-process
prepare, every block of an epoch drawn exactly once whatever the ranks and workers, exact resume (also
kill -9 through the recipe), and the refusals (foreign ids, framing mismatch)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_doc, write_jsonl_shards
from data_helpers import by_stream, make, steps

import recipe_runner as rr
from lmpretrain.data import SourceSpec, merge_data_states
from lmpretrain.data.global_shuffle import permute
from lmpretrain.data.prepare import build_executors, plan_prepare, write_token_files
from lmpretrain.data.token_layouts import HEADER
from lmpretrain.errors import DataError

PREPARE = Path(__file__).resolve().parents[1] / "scripts" / "prepare_data.py"


def prepare(tmp_path, tok, docs=(30, 20, 45), name="tok", **kw) -> Path:
    paths = write_jsonl_shards(tmp_path / f"{name}-text", list(docs), max_words=40)
    out = tmp_path / name
    write_token_files(SourceSpec(files=paths), tok, out, **kw)
    return out


def corpus_stream(folder: Path) -> np.ndarray:
    """The source's one logical stream, read straight from the .bin files: the shards back to back."""
    header = json.loads((folder / HEADER).read_text())
    return np.concatenate(
        [np.fromfile(folder / f"{s['name']}.bin", dtype=header["dtype"]) for s in header["shards"]]
    )


def corpus_blocks(folder: Path, seq_len: int, offset: int = 0) -> list[tuple[int, ...]]:
    """An epoch's blocks: seq_len tokens at offset + i * seq_len of the stream (i < T // seq_len), the last
    one running on from the stream's end to its start when the offset needs it."""
    ids = corpus_stream(folder)
    n = len(ids) // seq_len
    at = (offset + np.arange(n)[:, None] * seq_len + np.arange(seq_len)) % len(ids)
    return [tuple(b) for b in ids[at].tolist()]


def rows(results) -> list[tuple[int, ...]]:
    return [tuple(b) for r in results for b in r.input_ids.tolist()]


def test_layout_holds_every_document_framed_with_an_index(tmp_path, small_tokenizer):
    folder = prepare(tmp_path, small_tokenizer)
    header = json.loads((folder / HEADER).read_text())
    assert header["version"] == 1 and header["dtype"] == "<u2" and header["documents"] == 95
    assert header["add_bos"] is True and header["vocab_size"] == len(small_tokenizer)
    bos, eos = small_tokenizer.bos_token_id, small_tokenizer.eos_token_id
    texts = [json.loads(line)["text"] for p in sorted((tmp_path / "tok-text").iterdir()) for line in open(p)]
    decoded = []
    for shard in header["shards"]:
        ids = np.fromfile(folder / f"{shard['name']}.bin", dtype="<u2")
        index = np.fromfile(folder / f"{shard['name']}.idx", dtype="<u8")
        assert len(ids) == shard["tokens"] == index[-1] and len(index) == shard["documents"] + 1
        for a, b in zip(index[:-1], index[1:], strict=True):
            doc = ids[a:b].tolist()
            assert doc[0] == bos and doc[-1] == eos and bos not in doc[1:-1] and eos not in doc[1:-1]
            decoded.append(small_tokenizer.decode(doc[1:-1]))
    assert decoded == texts
    assert header["max_id"] == max(
        int(np.fromfile(folder / f"{s['name']}.bin", dtype="<u2").max()) for s in header["shards"]
    )


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.slow
def test_any_task_count_writes_the_same_bytes(tmp_path, small_tokenizer):
    """1, 2 and 3 datatrove tasks (2 of them at once) write byte-identical folders, header included, through
    datatrove's JsonlReader (a shard per file) and through our reader (a shard per piece of text files)."""
    jsonl = write_jsonl_shards(tmp_path / "jsonl", [120, 10, 200, 45, 80], max_words=40)
    rng = random.Random(3)
    for i in range(3):
        (tmp_path / "txt" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "txt" / f"{i}.txt").write_text(
            "\n\n".join(make_doc(f"{i}.{k}", rng) for k in range(60 * i + 5))
        )
    text = SourceSpec(files=[str(tmp_path / "txt")], separator="blank_lines")
    for spec, shards in ((SourceSpec(files=jsonl), 5), (text, 3)):
        got = []
        for tasks, workers in ((1, 1), (2, 2), (3, 1)):
            out = tmp_path / f"out-{len(got)}-{shards}"
            write_token_files(spec, small_tokenizer, out, tasks=tasks, workers=workers)
            got.append(folder_bytes(out))
            assert not list(tmp_path.glob(".*.prepare"))  # the work folder goes once the folder is complete
        assert got[0] == got[1] == got[2]
        header = json.loads(got[0][HEADER])
        assert len(header["shards"]) == shards and header["documents"] == (455 if shards == 5 else 195)
        stream = b"".join(got[0][f"{s['name']}.bin"] for s in header["shards"])
        assert len(stream) == 2 * header["tokens"]


def test_pipelines_are_datatrove_readers_our_writer_and_a_dependent_final_task(tmp_path, small_tokenizer):
    """What each executor gets (slurm and ray cannot run here: their pipelines are checked as built)."""
    from datatrove.executor import LocalPipelineExecutor, RayPipelineExecutor, SlurmPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader, ParquetReader

    from lmpretrain.data.prepare import FinishFolder, ShardWriter, SourceReader

    jsonl = write_jsonl_shards(tmp_path / "j", [3, 4])
    prep = plan_prepare(SourceSpec(files=jsonl), small_tokenizer, tmp_path / "out", tasks=8)
    assert (prep.work / "files.txt").read_text().split() == ["shard-000.jsonl", "shard-001.jsonl"]
    assert "read by datatrove's JsonlReader (one shard per file)" in prep.summary
    cluster = dict(partition="cpu", time="2:00:00", cpus_per_task=2, mem_per_cpu_gb=4)
    for kind, cls, kw in (
        ("local", LocalPipelineExecutor, {}),
        ("slurm", SlurmPipelineExecutor, cluster),
        ("ray", RayPipelineExecutor, dict(cpus_per_task=2)),
    ):
        tokenize, finish = build_executors(prep, kind, 8, 4, **kw)
        assert type(tokenize) is cls and type(finish) is cls and finish.depends is tokenize
        assert (tokenize.world_size, tokenize.workers, finish.world_size) == (8, 4, 1)
        assert [type(s) for s in tokenize.pipeline] == [JsonlReader, ShardWriter]
        assert [type(s) for s in finish.pipeline] == [FinishFolder]
        assert tokenize.logging_dir.path == str(prep.work / "logs" / "tokenize")
        assert finish.pipeline[0].out == str(tmp_path / "out")
    assert (tokenize.cpus_per_task, finish.cpus_per_task) == (2, 1)
    slurm = build_executors(prep, "slurm", 8, 4, **cluster)[0]
    assert (slurm.partition, slurm.time, slurm.mem_per_cpu_gb) == ("cpu", "2:00:00", 4)
    # parquet goes to datatrove's ParquetReader; text files (which it has no reader for) to ours.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b", "c d"]}), tmp_path / "p.parquet")
    parquet = plan_prepare(SourceSpec(files=[str(tmp_path / "p.parquet")]), small_tokenizer, tmp_path / "o2")
    assert type(parquet.stages[0].pipeline[0]) is ParquetReader
    (tmp_path / "t.txt").write_text("some text\n")
    text = plan_prepare(SourceSpec(files=[str(tmp_path / "t.txt")]), small_tokenizer, tmp_path / "o3")
    assert type(text.stages[0].pipeline[0]) is SourceReader and "read by lmpretrain's readers" in text.summary


def test_old_parquet_token_cache_gets_one_message_and_converts(tmp_path, small_tokenizer, capsys):
    """The retired `format: tokens` parquet cache: refused when trained on, with the command that converts
    it; that command writes the token files a prepare of the original text writes."""
    import importlib.util

    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmpretrain.data.encoder import Encoder
    from lmpretrain.data.tokenizer import tokenizer_hash

    paths = write_jsonl_shards(tmp_path / "text", [6, 9], max_words=30)
    old = tmp_path / "old-cache"
    old.mkdir()
    encoder = Encoder(small_tokenizer, add_bos=False)
    for n, path in enumerate(paths):  # as data/prepare.py's pretokenize wrote it: ids without BOS/EOS
        ids = encoder([json.loads(line)["text"] for line in open(path)])
        rows = {"input_ids": [x.tolist() for x in ids] + [[]], "doc_start": [True] * (len(ids) + 1)}
        rows["doc_end"] = rows["doc_start"]  # the empty row: a bad record, skipped
        pq.write_table(pa.table(rows), old / f"tokens-{n:05d}-of-00002.parquet")
    meta = {"tokenizer": "small", "tokenizer_hash": tokenizer_hash(small_tokenizer), "shards": 2}
    (old / "tokens_meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError) as err:
        make([SourceSpec(files=[str(old)], format="tokens")], small_tokenizer)
    command = f"python scripts/prepare_data.py --files {old} --tokenizer small --out {old}-tok"
    assert "parquet token cache of an older lmpretrain" in str(err.value) and command in str(err.value)
    spec = importlib.util.spec_from_file_location("prepare_data", PREPARE)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    small_tokenizer.save_pretrained(tmp_path / "tok")
    argv = ["--files", str(old), "--tokenizer", str(tmp_path / "tok"), "--tasks", "2", "--workers", "1"]
    assert script.main([*argv, "--out", f"{old}-tok"]) == 0
    assert "the retired parquet token cache, 2 files, converted" in capsys.readouterr().out
    write_token_files(SourceSpec(files=paths), small_tokenizer, tmp_path / "fresh")
    converted, fresh = folder_bytes(Path(f"{old}-tok")), folder_bytes(tmp_path / "fresh")
    assert {k: v for k, v in converted.items() if k != HEADER} == {
        k: v for k, v in fresh.items() if k != HEADER
    }
    # Bad input to the script: one message, exit 2, nothing written.
    capsys.readouterr()
    assert (
        script.main([*argv[2:], "--files", str(tmp_path / "none-*.jsonl"), "--out", str(tmp_path / "x")]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: data file or glob") and "matches nothing" in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.prepare"))


def test_permutation_is_a_bijection_that_changes_with_the_key():
    for n in (1, 2, 3, 7, 1000, 4097):
        order = permute(np.arange(n), n, 0, 1, 0, 0)
        assert sorted(order.tolist()) == list(range(n))
    a, b = permute(np.arange(1000), 1000, 0, 1, 0, 0), permute(np.arange(1000), 1000, 0, 1, 0, 1)
    assert not np.array_equal(a, b)
    # Uniform-looking: consecutive draws land far apart, not in windows.
    assert np.abs(np.diff(a)).mean() > 250 and abs(np.corrcoef(np.arange(1000), a)[0, 1]) < 0.1


def test_every_block_of_an_epoch_is_drawn_once_and_epochs_reshuffle(tmp_path, small_tokenizer):
    folder = prepare(tmp_path, small_tokenizer)
    n = len(corpus_stream(folder)) // 16
    assert n > 100
    ts = make([SourceSpec(files=[str(folder)])], small_tokenizer, blocks_per_step=4, num_streams=4)
    assert ts.shuffle == "global" and "shuffle: global" in ts.describe()
    offsets = [ts.order.offset(0, e) for e in (0, 1)]
    assert offsets[0] != offsets[1] and all(0 <= o < 16 for o in offsets)  # a new grid each epoch
    results, _ = steps(ts, (2 * n) // 4 + 1)
    drawn = rows(results)
    first, second = drawn[:n], drawn[n : 2 * n]
    blocks = corpus_blocks(folder, 16, offsets[0])
    assert Counter(first) == Counter(blocks) and Counter(second) == Counter(
        corpus_blocks(folder, 16, offsets[1])
    )
    assert first != blocks  # a new order each epoch, not the file order
    assert [r.epoch for r in results] == [4 * (i + 1) // n for i in range(len(results))]
    # Without epoch offsets every epoch cuts the same grid, at multiples of seq_len of the stream.
    fixed = make([SourceSpec(files=[str(folder)])], small_tokenizer, num_streams=4, epoch_offset=False)
    fixed_rows = rows(steps(fixed, -(-2 * n // 4))[0])
    assert Counter(fixed_rows[:n]) == Counter(fixed_rows[n : 2 * n]) == Counter(corpus_blocks(folder, 16))


def two_rank_steps(folder, tok, count, **kw) -> list[dict[int, torch.Tensor]]:
    """Per step, every stream's blocks, read by 2 ranks (each with kw's workers)."""
    per_rank = []
    for rank in (0, 1):
        ts = make([SourceSpec(files=[str(folder)])], tok, rank=rank, world_size=2, **kw)
        per_rank.append((ts, steps(ts, count)[0]))
        ts.close()
    return [
        {
            **by_stream(per_rank[0][1][i].input_ids, per_rank[0][0]),
            **by_stream(per_rank[1][1][i].input_ids, per_rank[1][0]),
        }
        for i in range(count)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_two_ranks_with_workers_draw_the_blocks_one_rank_draws(tmp_path, small_tokenizer, workers):
    folder = prepare(tmp_path, small_tokenizer)
    n = len(corpus_stream(folder)) // 16
    kw = dict(blocks_per_step=6, num_streams=4)  # uneven: streams give 2, 2, 1, 1 blocks per step
    count = n // 6 + 2
    ts = make([SourceSpec(files=[str(folder)])], small_tokenizer, **kw)
    one = [by_stream(r.input_ids, ts) for r in steps(ts, count)[0]]
    two = two_rank_steps(folder, small_tokenizer, count, num_workers=workers, **kw)
    for a, b in zip(one, two, strict=True):
        assert sorted(a) == sorted(b) == [0, 1, 2, 3]
        assert all(torch.equal(a[s], b[s]) for s in a)
    # And the 2-rank epoch holds every block exactly once.
    drawn = [tuple(x) for step in two for s in range(4) for x in step[s].tolist()]
    global_order = [tuple(x) for step in one for j in range(6) for x in [step[j % 4][j // 4].tolist()]]
    assert Counter(global_order[:n]) == Counter(corpus_blocks(folder, 16, ts.order.offset(0, 0)))
    assert Counter(drawn) == Counter(global_order)


def test_resume_is_exact_across_epochs_world_sizes_and_sources(tmp_path, small_tokenizer):
    a = prepare(tmp_path, small_tokenizer, name="a")
    b = prepare(tmp_path, small_tokenizer, docs=(10, 12), name="b")
    sources = [SourceSpec(files=[str(a)], weight=3.0), SourceSpec(files=[str(b)], weight=1.0)]
    kw = dict(blocks_per_step=8, num_streams=4, seq_len=16)
    ts = make(sources, small_tokenizer, **kw)
    straight = [r.input_ids for r in steps(ts, 60)[0]]
    first = make(sources, small_tokenizer, **kw)
    steps(first, 37)
    state = first.state_dict()
    resumed = make(sources, small_tokenizer, **kw)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # plain data, as checkpoints store it
    assert all(torch.equal(x.input_ids, y) for x, y in zip(steps(resumed, 23)[0], straight[37:], strict=True))
    # Two ranks resume from the one-rank state: together they give the same next steps.
    halves = []
    for rank in (0, 1):
        r = make(sources, small_tokenizer, rank=rank, world_size=2, **kw)
        r.load_state_dict(state)
        halves.append((r, steps(r, 3)[0]))
    for i in range(3):
        merged = {
            **by_stream(halves[0][1][i].input_ids, halves[0][0]),
            **by_stream(halves[1][1][i].input_ids, halves[1][0]),
        }
        assert torch.equal(
            torch.cat([merged[s] for s in range(4)]),
            torch.cat(list(by_stream(straight[37 + i], ts).values())),
        )
    merge_data_states([halves[0][0].state_dict(), halves[1][0].state_dict()])  # consistent across ranks
    # The mix follows the weights (3:1 of the draws), each source read through its own permutations.
    after = ts.order.next_draws(ts.order.initial_state(), 4000)[1]
    per_source = [epoch * ts.order.blocks[k] + index for k, (epoch, index) in enumerate(after["sources"])]
    assert sum(per_source) == 4000 and abs(per_source[0] / 4000 - 0.75) < 0.03


def test_windows_shuffle_and_held_out_read_token_files_as_documents(tmp_path, small_tokenizer):
    paths = write_jsonl_shards(tmp_path / "text", [30, 20])
    folder = tmp_path / "tok"
    write_token_files(SourceSpec(files=paths), small_tokenizer, folder)
    kw = dict(num_streams=1, blocks_per_step=4, shuffle="windows")
    text = make([SourceSpec(files=paths)], small_tokenizer, **kw)
    tokens = make([SourceSpec(files=[str(folder)], format="tokens")], small_tokenizer, **kw)
    assert tokens.shuffle == "windows"
    assert all(
        torch.equal(a.input_ids, b.input_ids)
        for a, b in zip(steps(text, 20)[0], steps(tokens, 20)[0], strict=True)
    )
    from lmpretrain.config import DataConfig
    from lmpretrain.data import heldout_blocks

    def held(src):
        return heldout_blocks(DataConfig(eval=[src], seq_len=16), small_tokenizer, num_blocks=20)

    assert torch.equal(held(SourceSpec(files=paths)), held(SourceSpec(files=[str(folder)])))


def test_refusals_name_the_fix(tmp_path, small_tokenizer):
    from lmpretrain.data.tokenizer import train_bpe

    rng = random.Random(5)
    bigger = train_bpe([make_doc(f"d{i}", rng) for i in range(400)], vocab_size=600, out_dir=tmp_path / "big")
    folder = prepare(tmp_path, bigger)
    assert json.loads((folder / HEADER).read_text())["max_id"] >= len(small_tokenizer)
    with pytest.raises(
        DataError, match=r"token files hold id \d+, outside the tokenizer's vocabulary of 320"
    ):
        make([SourceSpec(files=[str(folder)])], small_tokenizer)
    mine = prepare(tmp_path, small_tokenizer, name="mine")
    with pytest.raises(DataError, match="prepared with add_bos=True, the run has data.add_bos=False"):
        make([SourceSpec(files=[str(mine)])], small_tokenizer, add_bos=False)
    text = write_jsonl_shards(tmp_path / "t", [5])
    with pytest.raises(DataError, match="data.shuffle=global draws blocks from token files"):
        make([SourceSpec(files=text)], small_tokenizer, shuffle="global")
    with pytest.raises(DataError, match="exists; choose another --out or pass --overwrite"):
        write_token_files(SourceSpec(files=text), small_tokenizer, mine)
    (mine / "shard-00000.bin").write_bytes(b"\0\0")
    with pytest.raises(DataError, match="damaged: prepare it again"):
        make([SourceSpec(files=[str(mine)])], small_tokenizer)


@pytest.mark.slow
def test_prepare_script_killed_leaves_nothing_that_looks_complete(tmp_path, small_tokenizer):
    rng = random.Random(9)
    for i in range(40):  # enough text that the prepare is still running when killed
        (tmp_path / f"f{i}.txt").write_text("\n\n".join(make_doc(f"{i}.{k}", rng) for k in range(2000)))
    small_tokenizer.save_pretrained(tmp_path / "tokenizer")
    out = tmp_path / "tokens"
    cmd = [sys.executable, str(PREPARE), "--files", str(tmp_path / "*.txt"), "--separator", "blank_lines"]
    cmd += ["--tokenizer", str(tmp_path / "tokenizer"), "--out", str(out), "--tasks", "4", "--workers", "2"]
    proc = subprocess.Popen(cmd, env={**os.environ, "CI": "true"}, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".tokens.prepare/shards/shard-*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    rr.kill_tree(proc, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() and not list(tmp_path.rglob(HEADER))
    with pytest.raises(DataError):
        make([SourceSpec(files=[str(out)], format="tokens")], small_tokenizer)
    # The same command again resumes (datatrove skips the tasks it marked complete) and completes the folder.
    done = subprocess.run(cmd, env={**os.environ, "CI": "true"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "80,000 documents" in done.stdout and (out / HEADER).exists()


@pytest.fixture(scope="module")
def stdlib_tokens(tmp_path_factory, stdlib_cache):
    """Small JSONL corpora tokenized with the builtin tokenizer the smoke config uses."""
    from lmpretrain.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("stdlib_tokens")
    paths = write_jsonl_shards(root / "text", [400, 300, 500], max_words=80)
    val = write_jsonl_shards(root / "val", [200], prefix="val", seed=1, max_words=80)
    tok = load_tokenizer("builtin:python-stdlib")
    write_token_files(SourceSpec(files=paths), tok, root / "tok")
    return root / "tok", val[0]


@pytest.mark.slow
def test_kill_9_then_resume_is_bit_identical_through_the_recipe(stdlib_tokens, tmp_path):
    folder, val = stdlib_tokens
    run = [
        *rr.QUICK,
        f"--data.train=[{{files: [{folder}]}}]",
        f"--data.eval=[{{files: [{val}]}}]",
        "--data.num_workers=2",
        "--train.max_steps=16",
        "--checkpoint.every=4",
        "--eval.every=8",
        "--logging.wandb_mode=disabled",
    ]
    straight = rr.run(tmp_path / "straight", *run)
    assert "shuffle: global, a seeded permutation" in straight.output
    out = tmp_path / "killed"
    proc = rr.start(out, *run)
    rr.wait_for_step(proc, out, 6)
    rr.kill_tree(proc, signal.SIGKILL)
    proc.wait(timeout=120)
    stopped = rr.read_metrics(out)[-1]["step"]
    assert stopped < 16
    resumed = rr.run(out, *run)
    assert "resum" in resumed.output.lower()
    assert rr.file_sha256(straight.out / "final" / "model.safetensors") == rr.file_sha256(
        out / "final" / "model.safetensors"
    )
    a = {r["step"]: (r.get("train/loss"), r.get("eval/loss")) for r in straight.metrics()}
    b = {r["step"]: (r.get("train/loss"), r.get("eval/loss")) for r in resumed.metrics()}
    assert a == b
