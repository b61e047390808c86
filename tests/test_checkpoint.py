"""Checkpoints: exact round trips, atomic writes under real kills, discovery, retention, fingerprints."""

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lmpretrain.checkpoint import (
    MARKER_FILE,
    Checkpointer,
    CheckpointError,
    check_output_dir_writable,
    checkpoint_problem,
    merge_data_states,
)
from lmpretrain.errors import CheckpointMismatchError
from lmpretrain.fingerprint import check_fingerprint
from lmpretrain.rng import capture_rng_state, restore_rng_state
from recipe_runner import launch_two_ranks

SRC = str(Path(__file__).resolve().parents[1] / "src")


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        attention_dropout=0.1,  # the forward pass draws from the torch RNG, so resume needs it restored
    )
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model.train()


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def train(model, optimizer, steps: int) -> list[float]:
    """Batches come from the global torch RNG: a resume that forgot the RNG sees different data."""
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 97, (2, 12))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def draws() -> tuple:
    return random.random(), np.random.rand(3).tolist(), torch.rand(3)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def save_simple(ck: Checkpointer, step: int, eval_loss=None, model=None) -> Path:
    model = model or torch.nn.Linear(3, 2)
    trainer_state = {"step": step, "eval_loss": eval_loss, "world_size": 1}
    return ck.save(
        step,
        model=model,
        optimizer=adamw(model),
        data_state={"streams": {0: {"pos": step}}},
        trainer_state=trainer_state,
    )


# ---- round trips -------------------------------------------------------------------------------------


def test_round_trip_restores_weights_optimizer_rng_data_and_trainer_state(tmp_path):
    model = tiny_llama(0)
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    train(model, optimizer, 3)
    for _ in range(3):
        scheduler.step()
    random.seed(5)
    np.random.seed(6)
    data_state = {
        "streams": {0: {"pos": torch.tensor([3, 4]), "window": [1, 2], "doc": "a.py"}, 2: {"pos": 7}}
    }
    trainer_state = {
        "step": 3,
        "tokens_seen": 72,
        "best_eval_loss": 2.5,
        "eval_loss": 2.75,
        "skipped_steps": 0,
        "wandb_run_id": "abc123",
        "scheduler": scheduler.state_dict(),
        "scaler": None,
        "world_size": 1,
        "config": {"optim": {"lr": 3e-3}},
        "fingerprint": {"seq_len": 12},
    }
    path = Checkpointer(tmp_path).save(
        3, model=model, optimizer=optimizer, data_state=data_state, trainer_state=trainer_state
    )
    assert path == tmp_path / "checkpoints" / "step-00000003"
    expected_draws = draws()

    fresh = tiny_llama(1)
    fresh_optimizer = adamw(fresh)
    random.seed(99)
    data, saved = Checkpointer(tmp_path).load(path, model=fresh, optimizer=fresh_optimizer)

    got_draws = draws()
    assert got_draws[:2] == expected_draws[:2] and torch.equal(got_draws[2], expected_draws[2])
    assert_same_tensors(fresh.state_dict(), model.state_dict())
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied after loading
    live, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert live["param_groups"] == loaded["param_groups"]
    for key in live["state"]:
        assert_same_tensors(live["state"][key], loaded["state"][key])
    assert loaded["state"][0]["step"].item() == 3
    assert json.dumps(saved, sort_keys=True) == json.dumps(trainer_state, sort_keys=True)
    assert data.keys() == {"streams"} and data["streams"].keys() == {0, 2}
    assert torch.equal(data["streams"][0]["pos"], torch.tensor([3, 4]))
    assert data["streams"][0]["window"] == [1, 2] and data["streams"][2] == {"pos": 7}


def test_rng_helpers_round_trip_every_generator():
    state = capture_rng_state()
    expected = draws()
    restore_rng_state(state)
    got = draws()
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_resumed_training_is_bit_identical_to_uninterrupted(tmp_path):
    model = tiny_llama(0)
    optimizer = adamw(model)
    train(model, optimizer, 3)
    ck = Checkpointer(tmp_path)
    path = ck.save(3, model=model, optimizer=optimizer, data_state={}, trainer_state={"step": 3})
    straight = train(model, optimizer, 3)

    torch.manual_seed(1234)  # the resumed process starts from different RNG state and weights
    resumed_model = tiny_llama(7)
    resumed_optimizer = adamw(resumed_model)
    ck.load(ck.latest(), model=resumed_model, optimizer=resumed_optimizer)
    resumed = train(resumed_model, resumed_optimizer, 3)

    assert path == ck.latest()
    assert resumed == straight
    assert_same_tensors(resumed_model.state_dict(), model.state_dict())


def test_model_file_is_safetensors_with_the_tied_alias_stored_once(tmp_path):
    from safetensors import safe_open

    model = tiny_llama(0)
    path = Checkpointer(tmp_path).save(
        0, model=model, optimizer=adamw(model), data_state={}, trainer_state={"step": 0}
    )
    with safe_open(path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert keys | {"lm_head.weight"} == set(model.state_dict())


def test_saving_an_unstepped_optimizer_leaves_it_untouched(tmp_path):
    # torch's get_optimizer_state_dict would initialise it with a fake step (step=1), changing the run.
    model = torch.nn.Linear(3, 2)
    optimizer = adamw(model)
    path = Checkpointer(tmp_path).save(
        0, model=model, optimizer=optimizer, data_state={}, trainer_state={"step": 0}
    )
    assert not optimizer.state
    stepped_model = torch.nn.Linear(3, 2)
    stepped = adamw(stepped_model)
    stepped_model(torch.ones(1, 3)).sum().backward()
    stepped.step()
    stepped.param_groups[0]["lr"] = 1.0
    Checkpointer(tmp_path).load(path, model=stepped_model, optimizer=stepped)
    assert not stepped.state and stepped.param_groups[0]["lr"] == 3e-3
    assert_same_tensors(stepped_model.state_dict(), model.state_dict())


def test_data_state_that_cannot_be_loaded_safely_is_refused_before_writing(tmp_path):
    ck = Checkpointer(tmp_path)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match=r"numpy.int64.*convert"):
        ck.save(
            1,
            model=model,
            optimizer=adamw(model),
            data_state={"streams": {0: {"pos": np.int64(3)}}},
            trainer_state={"step": 1},
        )
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_merge_data_states_merges_streams_and_refuses_conflicts():
    merged = merge_data_states([{"streams": {0: {"pos": 1}, 2: {"pos": 3}}}, {"streams": {1: {"pos": 2}}}])
    assert merged == {"streams": {0: {"pos": 1}, 2: {"pos": 3}, 1: {"pos": 2}}}
    with pytest.raises(CheckpointError, match="stream 0"):
        merge_data_states([{"streams": {0: {"pos": 1}}}, {"streams": {0: {"pos": 2}}}])


# ---- validity, discovery, retention ---------------------------------------------------------------------


def test_directory_without_marker_is_ignored(tmp_path, caplog):
    ck = Checkpointer(tmp_path)
    first = save_simple(ck, 1)
    second = save_simple(ck, 2)
    (second / MARKER_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="lmpretrain.checkpoint"):
        assert ck.latest() == first
    assert "step-00000002" in caplog.text and "no COMPLETE marker" in caplog.text
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        ck.load(second, model=torch.nn.Linear(3, 2), optimizer=adamw(torch.nn.Linear(3, 2)))


def test_truncated_newest_checkpoint_falls_back_to_previous_with_warning(tmp_path, caplog):
    ck = Checkpointer(tmp_path)
    first = save_simple(ck, 1)
    second = save_simple(ck, 2)
    optim_file = second / "optimizer.pt"
    optim_file.write_bytes(optim_file.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="lmpretrain.checkpoint"):
        assert ck.latest() == first
    assert (
        "ignoring checkpoint" in caplog.text and "step-00000002" in caplog.text and "truncated" in caplog.text
    )
    model = torch.nn.Linear(3, 2)
    data, state = ck.load(ck.latest(), model=model, optimizer=adamw(model))
    assert state["step"] == 1 and data == {"streams": {0: {"pos": 1}}}


def test_retention_keeps_the_last_k_and_the_best_eval_loss(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2)
    for step, loss in [(1, 5.0), (2, 1.0), (3, None), (4, 3.0), (5, 4.0)]:
        save_simple(ck, step, eval_loss=loss)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-00000002", "step-00000004", "step-00000005"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    ck = Checkpointer(tmp_path)
    save_simple(ck, 1, eval_loss=2.0)
    path = save_simple(ck, 1, eval_loss=1.0)
    assert checkpoint_problem(path) is None
    assert json.loads((path / "trainer_state.json").read_text())["eval_loss"] == 1.0
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]


def test_a_failed_write_raises_and_leaves_no_directory(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path)
    first = save_simple(ck, 1)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_simple(ck, 2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.name]
    assert ck.latest() == first


# A child process that saves step 1, then is SIGKILLed in the middle of saving step 2: either while
# optimizer.pt is half written, or after every file and the marker are written but before the rename.
CRASH_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from lmpretrain.checkpoint import Checkpointer

    out, where = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    ck = Checkpointer(out)
    ck.save(1, model=model, optimizer=optimizer, data_state={}, trainer_state={"step": 1, "world_size": 1})

    def hang(message):
        print(message, flush=True)
        time.sleep(60)

    if where == "mid-write":
        def half_save(obj, f, *args, **kwargs):
            f.write(b"partial bytes")
            f.flush()
            hang("WRITING")
        torch.save = half_save
    else:
        real_rename = os.rename
        def stalled_rename(src, dst):
            if ".tmp-step-00000002" in str(src):
                hang("RENAMING")
            return real_rename(src, dst)
        os.rename = stalled_rename
    ck.save(2, model=model, optimizer=optimizer, data_state={}, trainer_state={"step": 2, "world_size": 1})
""")


@pytest.mark.parametrize("where", ["mid-write", "before-rename"])
def test_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, where):
    script = tmp_path / "child.py"
    script.write_text(CRASH_CHILD)
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run"), where],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line.strip() in ("WRITING", "RENAMING"), child.stderr.read()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
        child.communicate()
    ckdir = tmp_path / "run" / "checkpoints"
    leftovers = [p.name for p in ckdir.iterdir() if p.name.startswith(".tmp-step-00000002")]
    assert len(leftovers) == 1  # the interrupted save, never named step-*
    if where == "before-rename":  # complete files and marker, but not committed: still never loaded
        assert (ckdir / leftovers[0] / MARKER_FILE).exists()
    ck = Checkpointer(tmp_path / "run")
    assert ck.latest() == ckdir / "step-00000001"
    model = torch.nn.Linear(4, 4)
    _, state = ck.load(ck.latest(), model=model, optimizer=adamw(model))
    assert state["step"] == 1
    save_simple(ck, 3, model=torch.nn.Linear(4, 4))  # the next save removes the leftover
    assert sorted(p.name for p in ckdir.iterdir()) == ["step-00000001", "step-00000003"]


# ---- resume resolution, output dir ----------------------------------------------------------------------


def test_resolve_resume_auto_never_and_path(tmp_path):
    ck = Checkpointer(tmp_path)
    assert ck.resolve_resume("auto", overwrite=False) is None
    assert ck.resolve_resume("never", overwrite=False) is None
    first = save_simple(ck, 1)
    second = save_simple(ck, 2)
    assert ck.resolve_resume("auto", overwrite=False) == second
    assert ck.resolve_resume(str(first), overwrite=False) == first
    with pytest.raises(CheckpointError, match=r"run.resume=never.*--run.resume=auto.*--run.overwrite=true"):
        ck.resolve_resume("never", overwrite=False)
    with pytest.raises(CheckpointError, match="not a directory"):
        ck.resolve_resume(str(tmp_path / "nope"), overwrite=False)
    with pytest.raises(CheckpointError, match="looks like an output dir"):
        ck.resolve_resume(str(tmp_path), overwrite=False)
    (first / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is not a loadable checkpoint.*trainer_state.json"):
        ck.resolve_resume(str(first), overwrite=False)
    assert ck.resolve_resume("never", overwrite=True) is None
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_unwritable_output_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"output_dir .*a-file/run.* is not usable for checkpoints"):
        check_output_dir_writable(blocker / "run")
    check_output_dir_writable(tmp_path / "fine")
    assert list((tmp_path / "fine").iterdir()) == []  # the probe cleans up after itself


# ---- fingerprints -----------------------------------------------------------------------------------------


SAVED_FP = {
    "sources": ["stdlib"],
    "seq_len": 128,
    "model": {"hidden_size": 32, "layers": 2},
    "num_workers": 2,
    "world_size": 2,
    "micro_batch_size": 4,
    "grad_accum_steps": 1,
    "global_batch": 8,
}


def test_fingerprint_mismatch_names_every_key_and_the_override():
    current = {
        **SAVED_FP,
        "seq_len": 256,
        "model": {"hidden_size": 64, "layers": 2},
        "num_workers": 0,
        "tokenizer": "bpe-1k",
    }
    with pytest.raises(CheckpointMismatchError) as err:
        check_fingerprint(SAVED_FP, current, allow_mismatch=False)
    message = str(err.value)
    assert "seq_len: 128 -> 256" in message
    assert "model.hidden_size: 32 -> 64" in message
    assert "tokenizer: '<absent>' -> 'bpe-1k'" in message
    assert "--run.allow_mismatch=true" in message
    assert "num_workers" not in message and "layers" not in message
    warnings = check_fingerprint(SAVED_FP, current, allow_mismatch=True)
    assert len(warnings) == 3 and all("--run.allow_mismatch=true" in w for w in warnings)


def test_fingerprint_equal_or_only_num_workers_is_silent():
    assert check_fingerprint(SAVED_FP, dict(SAVED_FP), allow_mismatch=False) == []
    assert check_fingerprint(SAVED_FP, {**SAVED_FP, "num_workers": 8}, allow_mismatch=False) == []


def test_global_batch_change_suggests_a_linearly_rescaled_lr():
    current = {**SAVED_FP, "world_size": 4, "global_batch": 16}
    with pytest.raises(CheckpointMismatchError, match=r"global batch changes 8 -> 16.*x2"):
        check_fingerprint(SAVED_FP, current, allow_mismatch=False, lr=3e-4)
    warnings = check_fingerprint(SAVED_FP, current, allow_mismatch=True, lr=3e-4)
    assert any("8 -> 16" in w and "lr 0.0003 -> 0.0006" in w for w in warnings)


def test_world_size_change_with_the_same_global_batch_needs_no_rescale():
    current = {**SAVED_FP, "world_size": 1, "micro_batch_size": 8}
    warnings = check_fingerprint(SAVED_FP, current, allow_mismatch=True)
    assert any("global batch stays 8: no learning-rate rescaling" in w for w in warnings)


# ---- two real processes (gloo) -------------------------------------------------------------------------------


RANK_WORKER = textwrap.dedent("""
    import json, os, random, sys
    import numpy as np, torch
    from accelerate import PartialState
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lmpretrain.checkpoint import Checkpointer
    from lmpretrain.errors import CheckpointError

    out = sys.argv[1]
    state = PartialState(cpu=True)
    rank = state.process_index
    assert state.num_processes == 2, state

    def draws():
        return [random.random(), np.random.rand(), torch.rand(1).item()]

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    random.seed(10 + rank); np.random.seed(20 + rank); torch.manual_seed(30 + rank)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    ck = Checkpointer(out, state)
    streams = {rank: {"pos": torch.tensor([rank, 1])}, rank + 2: {"pos": torch.tensor([rank, 2])}}
    path = ck.save(2, model=model, optimizer=optimizer, data_state={"streams": streams},
                   trainer_state={"step": 2, "world_size": 2})
    expected = draws()
    weights = {k: v.clone() for k, v in model.module.state_dict().items()}

    torch.manual_seed(99)
    fresh = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    data, trainer_state = ck.load(path, model=fresh, optimizer=fresh_optimizer)
    got = draws()
    same_weights = all(torch.equal(weights[k], v) for k, v in fresh.module.state_dict().items())

    # A save that fails on one rank only must raise on both, not hang, and leave nothing behind.
    bad = {"streams": {rank: {"pos": np.int64(1) if rank == 1 else 1}}}
    try:
        ck.save(3, model=model, optimizer=optimizer, data_state=bad, trainer_state={"step": 3, "world_size": 2})
        failed = "no error"
    except CheckpointError as err:
        failed = str(err)

    # FSDP2 (fully_shard runs on gloo): parameters are DTensor shards; the checkpoint holds full
    # tensors, and a fresh sharded model loaded from it continues exactly like the original.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def sharded(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))
        for layer in m:
            fully_shard(layer)
        return fully_shard(m)

    def fsdp_step(m, opt):
        m(torch.randint(0, 10, (4,))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    fsdp_ck = Checkpointer(os.path.join(out, "fsdp"), state)
    m1 = sharded(0)
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    fsdp_step(m1, o1)
    fsdp_path = fsdp_ck.save(1, model=m1, optimizer=o1, data_state={}, trainer_state={"step": 1})
    fsdp_step(m1, o1)
    m2 = sharded(1)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    fsdp_ck.load(fsdp_path, model=m2, optimizer=o2)
    fsdp_step(m2, o2)
    full = StateDictOptions(full_state_dict=True)
    a, b = get_model_state_dict(m1, options=full), get_model_state_dict(m2, options=full)
    fsdp_ok = type(next(m2.parameters())).__name__ == "DTensor" and all(torch.equal(a[k], b[k]) for k in a)

    result = {"expected": expected, "got": got, "same_weights": same_weights, "streams": sorted(data["streams"]),
              "step": trainer_state["step"], "failed": failed, "latest": str(ck.latest()), "fsdp_ok": fsdp_ok}
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    state.wait_for_everyone()
    torch.distributed.destroy_process_group()  # an undestroyed gloo group can abort at interpreter exit
""")


def test_two_ranks_save_their_own_rng_and_data_and_get_them_back_ddp_and_fsdp2(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(RANK_WORKER)
    out = tmp_path / "run"
    out.mkdir()
    launch_two_ranks(script, str(out))
    results = [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(2)]
    for rank, r in enumerate(results):
        assert r["got"] == r["expected"], rank
        assert r["same_weights"] and r["step"] == 2 and r["streams"] == [0, 1, 2, 3]
        assert r["latest"].endswith("step-00000002")
        assert r["fsdp_ok"], rank
    assert results[0]["failed"].startswith("another rank failed to start step-00000003")
    assert (
        results[1]["failed"].startswith("failed to start step-00000003")
        and "numpy.int64" in results[1]["failed"]
    )
    assert results[0]["expected"] != results[1]["expected"]  # the ranks really had different RNG streams
    path = out / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE",
        "model.safetensors",
        "optimizer.pt",
        "rank-00000.pt",
        "rank-00001.pt",
        "trainer_state.json",
    ]

    # Resuming on a different world size (1 process): every rank's streams, rank 0's RNG.
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    data, _ = Checkpointer(out).load(path, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert sorted(data["streams"]) == [0, 1, 2, 3]
    assert torch.equal(data["streams"][3]["pos"], torch.tensor([1, 2]))
    assert [random.random(), np.random.rand(), torch.rand(1).item()] == results[0]["expected"]
