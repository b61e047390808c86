"""train.batch_ramp: the blocks of each step as closed forms, a stream whose steps grow and still reads
every stream in order and resumes exactly (any world size), the schedule in tokens, the pre-flight."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import write_jsonl_shards
from data_helpers import make, steps

from lmpretrain.config import Config, load_config
from lmpretrain.data import BatchRamp, SourceSpec, blocks_per_stream, load_tokenizer, merge_data_states
from lmpretrain.data.prepare import write_token_files
from lmpretrain.errors import ConfigError
from lmpretrain.layout import Layout
from lmpretrain.preflight import preflight
from lmpretrain.update import learning_rate

SMOKE = "configs/smoke.yaml"


def test_blocks_of_each_step_are_closed_forms():
    # 10-token blocks: stage 0 takes ceil(100 / 40) = 3 steps (120 tokens, past its 100), stage 1 starts
    # there and takes ceil((400 - 120) / 80) = 4 steps; a stage already passed takes none.
    ramp = BatchRamp(16, 10, ((100, 4), (400, 8), (420, 2)), lr_power=0.5)
    sizes = [ramp.blocks(s) for s in range(12)]
    assert sizes == [4, 4, 4, 8, 8, 8, 8] + [16] * 5
    assert [ramp.blocks_before(n) for n in range(13)] == [sum(sizes[:n]) for n in range(13)]
    assert ramp.blocks_before(1000) == 12 + 32 + 16 * (1000 - 7)
    assert ramp.schedule_steps(7) == 44 / 16 and ramp.lr_scale(0) == 0.5 and ramp.lr_scale(7) == 1.0
    assert ramp.describe() == (
        "batch ramp: 4 blocks for steps 1-3, 8 blocks for steps 4-7, then 16 blocks per step "
        "(lr x (batch / 16)^0.5)"
    )
    constant = BatchRamp(16)
    assert [constant.blocks(s) for s in range(3)] == [16] * 3 and constant.schedule_steps(5) == 5


def _by_stream(results, ramp, owned, num_streams, first=0):
    """{stream: its blocks of each step, in order} from a rank's steps (rows ordered by stream id)."""
    out = {s: [] for s in owned}
    for i, r in enumerate(results):
        counts, at = blocks_per_stream(ramp.blocks(first + i), num_streams), 0
        for s in owned:
            out[s] += r.input_ids[at : at + counts[s]].tolist()
            at += counts[s]
        assert at == len(r.input_ids)
    return out


@pytest.mark.parametrize("layout", ["windows", "windows+workers", "global"])
def test_a_ramped_stream_reads_what_the_constant_one_reads_and_resumes_exactly(
    tmp_path, small_tokenizer, layout
):
    paths = write_jsonl_shards(tmp_path / "d", [6, 4, 9, 3, 5, 7])
    if layout == "global":  # token files: every step draws the next blocks of a seeded permutation
        write_token_files(SourceSpec(files=paths), small_tokenizer, tmp_path / "t")
        paths = [str(tmp_path / "t")]
    src, kw = [SourceSpec(files=paths)], {"num_workers": 2 if layout == "windows+workers" else 0}
    ramp = BatchRamp(8, 16, ((3 * 4 * 16, 4),))  # steps 1-3 take 4 blocks, then 8
    ts = make(src, small_tokenizer, blocks_per_step=ramp, **kw)
    ref = steps(ts, 9)[0]
    ts.close()
    assert [len(r.input_ids) for r in ref] == [4, 4, 4] + [8] * 6
    assert ts.shuffle == ("global" if layout == "global" else "windows")
    if layout != "global":  # each stream gives its blocks in order, whatever the step sizes
        constant = make(src, small_tokenizer, blocks_per_step=8, **kw)
        plain = _by_stream(steps(constant, 9)[0], BatchRamp(8), range(4), 4)
        constant.close()
        for s, blocks in _by_stream(ref, ramp, range(4), 4).items():
            assert blocks == plain[s][: len(blocks)]
    for k in (2, 3):  # resume inside the stage and at its boundary, on 2 ranks, then back on 1
        states, shares = [], []
        for rank in range(2):
            part = make(src, small_tokenizer, blocks_per_step=ramp, rank=rank, world_size=2)
            got = steps(part, k)[0]
            states.append(part.state_dict())
            shares.append(_by_stream(got, ramp, [rank, rank + 2], 4))
        assert {**shares[0], **shares[1]} == _by_stream(ref[:k], ramp, range(4), 4)
        resumed = make(src, small_tokenizer, blocks_per_step=ramp, **kw)
        resumed.load_state_dict(merge_data_states(states))
        after = steps(resumed, 9 - k)[0]
        resumed.close()
        assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(ref[k:], after, strict=True))


def test_the_schedule_counts_tokens_in_steps_of_the_final_batch():
    cfg = Config()
    cfg.train.max_steps, cfg.optim.warmup_steps, cfg.optim.schedule = 20, 4, "wsd"
    none = BatchRamp(8)
    assert [learning_rate(cfg, n, none) for n in range(20)] == [learning_rate(cfg, n) for n in range(20)]
    ramp = BatchRamp(8, 64, ((4 * 4 * 64, 4),), lr_power=0.5)  # 4 steps of half the batch = 2 final steps
    # In the ramp: warmup by tokens ((n + 1) / 2 final steps done), times sqrt(4 / 8).
    for n in range(4):
        assert learning_rate(cfg, n, ramp) == pytest.approx(cfg.optim.lr * math.sqrt(0.5) * (n + 1) / 2 / 4)
    # After it: the constant-batch schedule 2 steps behind, over 20 - 2 steps of the final batch.
    shorter = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=18))
    for n in range(4, 20):
        assert learning_rate(cfg, n, ramp) == pytest.approx(learning_rate(shorter, n - 2), rel=1e-12)
    linear = dataclasses.replace(ramp, lr_power=1.0)
    assert learning_rate(cfg, 0, linear) == pytest.approx(cfg.optim.lr * 0.5 / 2 / 4)
    # A ramp of 1.5 final steps: update n >= 3 ends at n - 0.5 of them, so update 5 ends past the warmup
    # (4.5 of 4 steps): the peak, not 4.5 / 4 of it (as the schedule gave before it was clamped).
    odd = BatchRamp(8, 64, ((3 * 4 * 64, 4),), lr_power=0.5)
    assert learning_rate(cfg, 4, odd) == pytest.approx(cfg.optim.lr * 3.5 / 4, rel=1e-12)
    assert learning_rate(cfg, 5, odd) == cfg.optim.lr
    assert max(learning_rate(cfg, n, odd) for n in range(20)) == cfg.optim.lr


def test_preflight_lists_every_ramp_stage_that_does_not_split(stdlib_cache):
    tok = load_tokenizer("builtin:python-stdlib")
    stages = "[{until_tokens: 1e3, global_batch: 6}, {until_tokens: 2e3, global_batch: 8}, " + (
        "{until_tokens: 3e3, global_batch: 12}]"
    )
    cfg = load_config([SMOKE, f"--train.batch_ramp={stages}"])  # micro 4 x 2 ranks: multiples of 8
    assert cfg.train.batch_ramp[0].until_tokens == 1000.0
    with pytest.raises(ConfigError) as err:
        preflight(cfg, Layout("ddp", 2), tok)
    message = str(err.value)
    assert "multiple of train.micro_batch_size x world size = 8" in message
    assert (
        "stage 0 (until_tokens 1000) global_batch=6; stage 2 (until_tokens 3000) global_batch=12" in message
    )
    assert "stage 1" not in message
    with pytest.raises(ConfigError) as err:  # on one process micro-batches of 4 split 8 and 12, not 6
        preflight(cfg, Layout(), tok)
    assert "stage 0 (until_tokens 1000) global_batch=6" in str(err.value) and "stage 2" not in str(err.value)
    engine = load_config(
        [SMOKE, "--train.ema_decay=0.9", "--train.batch_ramp=[{until_tokens: 1, global_batch: 8}]"]
    )
    with pytest.raises(ConfigError) as err:
        preflight(engine, Layout("deepspeed", zero_stage=2), tok)
    assert "train.ema_decay is not supported under DeepSpeed" in str(err.value)
    assert "train.batch_ramp is not supported under DeepSpeed" in str(err.value)
