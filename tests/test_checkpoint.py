"""Checkpoints: exact round trips of a model, its optimizer and stateful objects in both formats, atomic
writes under real kills (sync and async), refusals, discovery, retention, fingerprints, 2 real ranks."""

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import conftest
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

import recipe_runner as rr
from lmpretrain.checkpoint.checkpointer import (
    MARKER_FILE,
    Checkpointer,
    CheckpointError,
    PerRank,
    check_output_dir_writable,
    checkpoint_problem,
)
from lmpretrain.config import load_config
from lmpretrain.data import TrainStream, load_tokenizer
from lmpretrain.errors import CheckpointMismatchError, ConfigError
from lmpretrain.layout import Layout
from lmpretrain.model import build_model_config
from lmpretrain.preflight import preflight
from lmpretrain.run.fingerprint import (
    FINGERPRINT_NAMES,
    SILENT_FINGERPRINT_KEYS,
    allow_mismatch_problems,
    check_fingerprint,
    run_fingerprint,
)
from lmpretrain.run.rng import LoopRNG, capture_rng_state, restore_rng_state
from lmpretrain.run.train_state import TrainState
from recipe_runner import launch_ranks

SRC = str(Path(__file__).resolve().parents[1] / "src")
FORMATS = ["full", "sharded"]


def tiny_llama(seed: int) -> LlamaForCausalLM:
    # attention dropout: the forward pass draws from the torch RNG, so resume needs it restored
    model = conftest.tiny_llama(seed, attention_dropout=0.1)
    model.config._attn_implementation = "eager"
    return model


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


class Box:
    """The smallest stateful object: holds one plain value."""

    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def save_simple(ck: Checkpointer, step: int, eval_loss=None, model=None) -> Path:
    model = model or torch.nn.Linear(3, 2)
    states = {"train": Box(step), "data": PerRank(Box({"pos": step}))}
    return ck.save(step, model=model, optimizer=adamw(model), states=states, meta={"eval_loss": eval_loss})


def load_simple(ck: Checkpointer, path) -> tuple[int, dict]:
    model = torch.nn.Linear(3, 2)
    train_box, data_box = Box(), Box()
    ck.load(path, model=model, optimizer=adamw(model), states={"train": train_box, "data": PerRank(data_box)})
    return train_box.value, data_box.value


# ---- round trips -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_restores_weights_optimizer_and_every_state(tmp_path, fmt):
    model = tiny_llama(0)
    optimizer = adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    train(model, optimizer, 3)
    for _ in range(3):
        scheduler.step()
    state = TrainState(step=3, tokens_seen=72, wandb_run_id="abc123")
    state.record_eval(2.75)
    data = Box(
        {"streams": {0: {"pos": torch.tensor([3, 4]), "window": [1, 2], "doc": "a.py"}, 2: {"pos": 7}}}
    )
    random.seed(5)
    np.random.seed(6)
    states = {"train": state, "scheduler": scheduler, "data": PerRank(data), "rng": PerRank(LoopRNG(0))}
    path = Checkpointer(tmp_path, format=fmt).save(
        3, model=model, optimizer=optimizer, states=states, meta={"config": {"optim": {"lr": 3e-3}}}
    )
    assert path == tmp_path / "checkpoints" / "step-00000003"
    expected_draws = draws()

    fresh = tiny_llama(1)
    fresh_optimizer = adamw(fresh)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda s: min(1.0, (s + 1) / 10))
    fresh_state, fresh_data, fresh_rng = TrainState(), Box(), LoopRNG(0)
    random.seed(99)
    meta = Checkpointer(tmp_path, format=fmt).load(
        path,
        model=fresh,
        optimizer=fresh_optimizer,
        states={
            "train": fresh_state,
            "scheduler": fresh_scheduler,
            "data": PerRank(fresh_data),
            "rng": PerRank(fresh_rng),
        },
    )
    assert meta["config"] == {"optim": {"lr": 3e-3}} and meta["format"] == fmt and meta["world_size"] == 1
    assert random.random() != expected_draws[0]  # loading stores the RNG state; start() applies it
    fresh_rng.start()
    got_draws = draws()
    assert got_draws[:2] == expected_draws[:2] and torch.equal(got_draws[2], expected_draws[2])
    assert_same_tensors(fresh.state_dict(), model.state_dict())
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied after loading
    live, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert live["param_groups"] == loaded["param_groups"]
    for key in live["state"]:
        assert_same_tensors(live["state"][key], loaded["state"][key])
    assert loaded["state"][0]["step"].item() == 3
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_state == state and fresh_state.eval_step == 3
    assert torch.equal(fresh_data.value["streams"][0]["pos"], torch.tensor([3, 4]))
    assert fresh_data.value["streams"][0]["window"] == [1, 2] and fresh_data.value["streams"][2] == {"pos": 7}


def test_rng_helpers_round_trip_every_generator():
    state = capture_rng_state()
    expected = draws()
    restore_rng_state(state)
    got = draws()
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_a_fresh_loop_rng_seeds_every_generator():
    LoopRNG(7).start()
    first = draws()
    random.random(), torch.rand(5)
    LoopRNG(7).start()
    second = draws()
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_resumed_training_is_bit_identical_to_uninterrupted(tmp_path, fmt):
    model = tiny_llama(0)
    optimizer = adamw(model)
    train(model, optimizer, 3)
    ck = Checkpointer(tmp_path, format=fmt)
    rng = LoopRNG(0)
    path = ck.save(3, model=model, optimizer=optimizer, states={"rng": PerRank(rng)})
    straight = train(model, optimizer, 3)

    torch.manual_seed(1234)  # the resumed process starts from different RNG state and weights
    resumed_model = tiny_llama(7)
    resumed_optimizer = adamw(resumed_model)
    resumed_rng = LoopRNG(0)
    ck.load(
        ck.latest(), model=resumed_model, optimizer=resumed_optimizer, states={"rng": PerRank(resumed_rng)}
    )
    resumed_rng.start()
    resumed = train(resumed_model, resumed_optimizer, 3)

    assert path == ck.latest()
    assert resumed == straight
    assert_same_tensors(resumed_model.state_dict(), model.state_dict())


def test_model_file_is_safetensors_with_the_tied_alias_stored_once(tmp_path):
    from safetensors import safe_open

    model = tiny_llama(0)
    path = Checkpointer(tmp_path).save(0, model=model, optimizer=adamw(model), states={})
    with safe_open(path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert keys | {"lm_head.weight"} == set(model.state_dict())


@pytest.mark.parametrize("fmt", FORMATS)
def test_saving_an_unstepped_optimizer_leaves_it_untouched(tmp_path, fmt):
    # torch's get_optimizer_state_dict would initialise it with a fake step (step=1), changing the run.
    model = torch.nn.Linear(3, 2)
    optimizer = adamw(model)
    path = Checkpointer(tmp_path, format=fmt).save(0, model=model, optimizer=optimizer, states={})
    assert not optimizer.state
    stepped_model = torch.nn.Linear(3, 2)
    stepped = adamw(stepped_model)
    stepped_model(torch.ones(1, 3)).sum().backward()
    stepped.step()
    stepped.param_groups[0]["lr"] = 1.0
    Checkpointer(tmp_path, format=fmt).load(path, model=stepped_model, optimizer=stepped, states={})
    assert not stepped.state and stepped.param_groups[0]["lr"] == 3e-3
    assert_same_tensors(stepped_model.state_dict(), model.state_dict())


def test_sharded_format_writes_dcp_shards_and_no_whole_files(tmp_path):
    model = tiny_llama(0)
    optimizer = adamw(model)
    train(model, optimizer, 1)
    path = Checkpointer(tmp_path, format="sharded").save(1, model=model, optimizer=optimizer, states={})
    names = set(json.loads((path / MARKER_FILE).read_text()))
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "meta.json", "states.pt", "rank-00000.pt"} <= names
    assert "model.safetensors" not in names and "optimizer.pt" not in names


# ---- refusals: nothing is written, nothing older is touched --------------------------------------------


def test_state_that_cannot_be_loaded_safely_is_refused_before_writing(tmp_path):
    ck = Checkpointer(tmp_path)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match=r"state 'data'.*numpy.int64.*convert"):
        ck.save(1, model=model, optimizer=adamw(model), states={"data": PerRank(Box(np.int64(3)))})
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_weights_are_never_committed(tmp_path, fmt):
    ck = Checkpointer(tmp_path, format=fmt)
    model = tiny_llama(0)
    optimizer = adamw(model)
    train(model, optimizer, 1)
    first = ck.save(1, model=model, optimizer=optimizer, states={})
    before = sorted(p.name for p in first.iterdir())
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(
        CheckpointError, match=r"model.layers.1.mlp.up_proj.weight.*inf/NaN at step 2.*intact"
    ):
        ck.save(2, model=model, optimizer=optimizer, states={})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.name]  # no step-2, no tmp
    assert ck.latest() == first and sorted(p.name for p in first.iterdir()) == before


def test_a_state_missing_from_the_checkpoint_is_named(tmp_path):
    ck = Checkpointer(tmp_path)
    path = save_simple(ck, 1)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match=r"no state 'guard' \(it has \['train'\]\)"):
        ck.load(path, model=model, optimizer=adamw(model), states={"train": Box(), "guard": Box()})


def test_per_rank_states_merge_when_asked(tmp_path):
    ck = Checkpointer(tmp_path)
    path = save_simple(ck, 4)
    merged = Box()
    model = torch.nn.Linear(3, 2)
    ck.load(
        path,
        model=model,
        optimizer=adamw(model),
        states={
            "data": PerRank(merged, merge=lambda saved: {"value": {"ranks": len(saved), **saved[0]["value"]}})
        },
    )
    assert merged.value == {"ranks": 1, "pos": 4}


# ---- validity, discovery, retention ---------------------------------------------------------------------


def test_directory_without_marker_is_ignored(tmp_path, caplog):
    ck = Checkpointer(tmp_path)
    first = save_simple(ck, 1)
    second = save_simple(ck, 2)
    (second / MARKER_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="lmpretrain.checkpoint.checkpointer"):
        assert ck.latest() == first
    assert "step-00000002" in caplog.text and "no COMPLETE marker" in caplog.text
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        load_simple(ck, second)


@pytest.mark.parametrize("fmt,victim", [("full", "optimizer.pt"), ("sharded", "dcp/__0_0.distcp")])
def test_truncated_newest_checkpoint_falls_back_to_previous_with_warning(tmp_path, caplog, fmt, victim):
    ck = Checkpointer(tmp_path, format=fmt)
    model = tiny_llama(0)
    optimizer = adamw(model)
    train(model, optimizer, 1)
    states = {"train": Box(1)}
    first = ck.save(1, model=model, optimizer=optimizer, states=states)
    ck.save(2, model=model, optimizer=optimizer, states={"train": Box(2)})
    damaged = tmp_path / "checkpoints" / "step-00000002" / victim
    damaged.write_bytes(damaged.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="lmpretrain.checkpoint.checkpointer"):
        assert ck.latest() == first
    assert (
        "ignoring checkpoint" in caplog.text and "step-00000002" in caplog.text and "truncated" in caplog.text
    )
    box, fresh = Box(), tiny_llama(3)
    ck.load(ck.latest(), model=fresh, optimizer=adamw(fresh), states={"train": box})
    assert box.value == 1


def test_retention_keeps_the_last_k_and_the_best_eval_loss(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2)
    for step, loss in [(1, 5.0), (2, 1.0), (3, None), (4, 3.0), (5, 4.0)]:
        save_simple(ck, step, eval_loss=loss)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-00000002", "step-00000004", "step-00000005"]


def test_best_uses_only_an_eval_run_at_the_saved_step():
    state = TrainState(step=10)
    state.record_eval(1.5)
    assert state.eval_loss_now == 1.5 and state.best_eval_loss == 1.5
    state.step = 11  # a checkpoint at step 11 must not claim step 10's eval loss
    assert state.eval_loss_now is None and state.eval_loss == 1.5
    state.record_eval(2.0)
    assert state.eval_loss_now == 2.0 and state.best_eval_loss == 1.5


def test_saving_the_same_step_again_replaces_it(tmp_path):
    ck = Checkpointer(tmp_path)
    save_simple(ck, 1, eval_loss=2.0)
    path = save_simple(ck, 1, eval_loss=1.0)
    assert checkpoint_problem(path) is None
    assert json.loads((path / "meta.json").read_text())["eval_loss"] == 1.0
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_write_raises_and_leaves_no_directory(tmp_path, monkeypatch, async_save):
    ck = Checkpointer(tmp_path, async_save=async_save)
    first = save_simple(ck, 1)
    ck.wait()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_simple(ck, 2)
        ck.wait()  # an async write fails in the background; the commit reports it
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [first.name]
    assert ck.latest() == first


def test_async_save_writes_the_state_of_the_step_it_was_called_at(tmp_path):
    ck = Checkpointer(tmp_path, async_save=True)
    model = tiny_llama(0)
    optimizer = adamw(model)
    train(model, optimizer, 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    path = ck.save(2, model=model, optimizer=optimizer, states={})
    train(model, optimizer, 2)  # training goes on while (or before) the write happens
    assert ck.wait() == path and checkpoint_problem(path) is None
    fresh = tiny_llama(5)
    ck.load(path, model=fresh, optimizer=adamw(fresh), states={})
    assert_same_tensors(fresh.state_dict(), expected)


# A child process that saves step 1, then is SIGKILLed in the middle of saving step 2: while
# optimizer.pt is half written, after every file and the marker are written but before the rename, or
# (async) while the background thread writes the weights and the training loop has moved on.
CRASH_CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from lmpretrain.checkpoint.checkpointer import Checkpointer

    out, where = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    ck = Checkpointer(out, async_save=where == "async-write")
    ck.save(1, model=model, optimizer=optimizer, states={})
    ck.wait()

    def hang(message):
        print(message, flush=True)
        time.sleep(60)

    if where == "mid-write":
        def half_save(obj, f, *args, **kwargs):
            f.write(b"partial bytes")
            f.flush()
            hang("WRITING")
        torch.save = half_save
    elif where == "async-write":
        import safetensors.torch
        def slow_write(tensors, path, metadata=None):
            open(path, "wb").write(b"partial")
            time.sleep(60)
        safetensors.torch.save_file = slow_write
    else:
        real_rename = os.rename
        def stalled_rename(src, dst):
            if ".tmp-step-00000002" in str(src):
                hang("RENAMING")
            return real_rename(src, dst)
        os.rename = stalled_rename
    ck.save(2, model=model, optimizer=optimizer, states={})
    hang("TRAINING ON")  # only an async save returns before its files are written
""")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["mid-write", "before-rename", "async-write"])
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
    expected = {"mid-write": "WRITING", "before-rename": "RENAMING", "async-write": "TRAINING ON"}[where]
    try:
        line = child.stdout.readline()
        assert line.strip() == expected, child.stderr.read()
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
    else:
        assert not (ckdir / leftovers[0] / MARKER_FILE).exists()
    ck = Checkpointer(tmp_path / "run")
    assert ck.latest() == ckdir / "step-00000001"
    model = torch.nn.Linear(4, 4)
    ck.load(ck.latest(), model=model, optimizer=adamw(model), states={})
    save_simple(ck, 3, model=torch.nn.Linear(4, 4))  # the next save removes the leftover
    assert sorted(p.name for p in ckdir.iterdir()) == ["step-00000001", "step-00000003"]


# ---- final/ export -----------------------------------------------------------------------------------------

# A child that exports a model to final/, then is SIGKILLed while exporting it again (the tokenizer
# files are being written): final/ must still be the first export, complete.
EXPORT_CHILD = textwrap.dedent("""
    import sys, time, torch
    from accelerate import Accelerator
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from lmpretrain.checkpoint.export import export_pretrained
    from lmpretrain.data.tokenizer import load_tokenizer

    out = sys.argv[1]
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    tokenizer = load_tokenizer("builtin:python-stdlib")
    export_pretrained(model, tokenizer, f"{out}/final", accelerator)
    print("EXPORTED", flush=True)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # the second export would differ
    def hang(*args, **kwargs):
        print("WRITING", flush=True)
        time.sleep(60)
    tokenizer.save_pretrained = hang
    export_pretrained(model, tokenizer, f"{out}/final", accelerator)
""")


@pytest.mark.slow
def test_an_interrupted_export_leaves_the_previous_final_complete(tmp_path, stdlib_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    script = tmp_path / "child.py"
    script.write_text(EXPORT_CHILD)
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def read_until(word: str) -> None:
        for line in child.stdout:  # libraries may print their own lines first
            if line.strip() == word:
                return
        pytest.fail(f"the child ended before {word}: {child.stderr.read()}")

    try:
        read_until("EXPORTED")
        first = (tmp_path / "final" / "model.safetensors").read_bytes()
        read_until("WRITING")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
        child.communicate()
    assert [p.name for p in tmp_path.glob(".tmp-final-*")]  # the interrupted export, never named final
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == first
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    AutoTokenizer.from_pretrained(tmp_path / "final")
    assert model.lm_head.weight is model.model.embed_tokens.weight


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
    (first / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match="is not a loadable checkpoint.*meta.json"):
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


def test_fingerprint_mismatch_names_every_key_and_the_exact_flag():
    current = {
        **SAVED_FP,
        "seq_len": 256,
        "model": {"hidden_size": 64, "layers": 2},
        "num_workers": 0,
        "tokenizer": "bpe-1k",
    }
    with pytest.raises(CheckpointMismatchError) as err:
        check_fingerprint(SAVED_FP, current)
    message = str(err.value)
    assert "seq_len: 128 -> 256" in message
    assert "model.hidden_size: 32 -> 64" in message
    assert "tokenizer: '<absent>' -> 'bpe-1k'" in message
    assert "'--run.allow_mismatch=[model.hidden_size,seq_len,tokenizer]'" in message
    assert "num_workers" not in message and "layers" not in message
    lines = check_fingerprint(SAVED_FP, current, allow_mismatch=["model.hidden_size", "seq_len", "tokenizer"])
    assert len(lines) == 3 and all(
        line.startswith("WARNING: resuming across a fingerprint") for line in lines
    )
    assert check_fingerprint(SAVED_FP, current, allow_mismatch=["model", "seq_len", "tokenizer"]) == lines


def test_allow_mismatch_waives_only_the_differences_it_names():
    current = {**SAVED_FP, "seq_len": 256, "tokenizer": "bpe-1k"}
    with pytest.raises(CheckpointMismatchError) as err:
        check_fingerprint(SAVED_FP, current, allow_mismatch=["seq_len"])
    message = str(err.value)
    assert "tokenizer: '<absent>' -> 'bpe-1k'" in message and "seq_len" not in message
    assert "'--run.allow_mismatch=[tokenizer]'" in message


def test_allow_mismatch_names_are_checked_with_the_config():
    assert allow_mismatch_problems(["micro_batch_size", "model.hidden_size", "seq_len"]) == []
    (problem,) = allow_mismatch_problems(["seq_len", "everything"])
    assert "unknown name(s) 'everything'" in problem and "micro_batch_size" in problem
    cfg = load_config([str(rr.SMOKE), "--run.allow_mismatch=[micro_bach_size]"])
    with pytest.raises(ConfigError) as err:  # in the one pre-flight pass, before any work
        preflight(cfg, Layout(), load_tokenizer(cfg.data.tokenizer))
    assert any("'micro_bach_size'" in p for p in err.value.problems)


def test_fingerprint_names_are_the_entries_of_a_real_fingerprint(tmp_path):
    ramp = "--train.batch_ramp=[{until_tokens: 1000, global_batch: 4}]"  # its entry is there only with a ramp
    cfg = load_config([str(rr.SMOKE), "--data.num_workers=0", ramp])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    stream = TrainStream(
        cfg.data, tokenizer, blocks_per_step=cfg.global_batch(1), rank=0, world_size=1, seed=1
    )
    fingerprint = run_fingerprint(cfg, 1, stream.fingerprint(), build_model_config(cfg.model, tokenizer))
    # epoch_offset is an entry of global-shuffle runs only (token files; the smoke config reads text).
    assert set(fingerprint) - SILENT_FINGERPRINT_KEYS == set(FINGERPRINT_NAMES) - {"epoch_offset"}


def test_fingerprint_equal_or_only_num_workers_is_silent():
    assert check_fingerprint(SAVED_FP, dict(SAVED_FP)) == []
    assert check_fingerprint(SAVED_FP, {**SAVED_FP, "num_workers": 8}) == []


def test_global_batch_change_suggests_a_linearly_rescaled_lr():
    current = {**SAVED_FP, "world_size": 4, "global_batch": 16}
    with pytest.raises(CheckpointMismatchError, match=r"global batch changes 8 -> 16.*x2") as err:
        check_fingerprint(SAVED_FP, current, lr=3e-4)
    assert "'--run.allow_mismatch=[global_batch,world_size]'" in str(err.value)
    lines = check_fingerprint(SAVED_FP, current, allow_mismatch=["global_batch", "world_size"], lr=3e-4)
    assert any("8 -> 16" in w and "lr 0.0003 -> 0.0006" in w for w in lines)


def test_another_layout_with_the_same_global_batch_needs_no_flag():
    for current in (
        {**SAVED_FP, "world_size": 1, "micro_batch_size": 8},
        {**SAVED_FP, "world_size": 1, "micro_batch_size": 4, "grad_accum_steps": 2},
    ):
        (line,) = check_fingerprint(SAVED_FP, current)
        assert line.startswith("resuming with another layout (world_size 2 -> 1, ")
        assert line.endswith("the global batch stays 8, so the data and the trajectory are unchanged")
    # The layout is free, the rest is still checked.
    with pytest.raises(CheckpointMismatchError, match=r"allow_mismatch=\[seq_len\]'") as err:
        check_fingerprint(SAVED_FP, {**SAVED_FP, "world_size": 1, "micro_batch_size": 8, "seq_len": 256})
    assert "world_size" not in str(err.value).split("note:")[0]


# ---- two real processes (gloo) -------------------------------------------------------------------------------


RANK_WORKER = textwrap.dedent("""
    import json, os, random, sys
    import numpy as np, torch
    from accelerate import PartialState
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP
    from lmpretrain.checkpoint.checkpointer import Checkpointer, PerRank
    from lmpretrain.errors import CheckpointError
    from lmpretrain.run.rng import LoopRNG

    out = sys.argv[1]
    state = PartialState(cpu=True)
    rank = state.process_index
    assert state.num_processes == 2, state

    class Streams:
        def __init__(self, streams=None): self.streams = streams
        def state_dict(self): return {"streams": self.streams}
        def load_state_dict(self, s): self.streams = s["streams"]

    def merge(saved):
        return {"streams": {k: v for s in saved for k, v in s["streams"].items()}}

    def draws():
        return [random.random(), np.random.rand(), torch.rand(1).item()]

    def model_of(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))

    def sharded(seed):
        m = model_of(seed)
        for layer in m:
            fully_shard(layer)
        return fully_shard(m)

    def step(m, opt):
        m(torch.randint(0, 10, (4,))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    full_sd = StateDictOptions(full_state_dict=True)
    result = {}
    # DDP and FSDP2, both formats, sync and async: per-rank RNG and data come back, weights continue
    # exactly; the saved FSDP2 weights are written for the single-process reload below.
    for wrap, fmt, async_save in [("ddp", "full", False), ("ddp", "sharded", True),
                                  ("fsdp2", "full", False), ("fsdp2", "sharded", False), ("fsdp2", "sharded", True)]:
        name = f"{wrap}-{fmt}-{'async' if async_save else 'sync'}"
        make = (lambda seed: DDP(model_of(seed))) if wrap == "ddp" else sharded
        ck = Checkpointer(os.path.join(out, name), state, format=fmt, async_save=async_save)
        m1 = make(0)
        o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2)
        step(m1, o1)
        random.seed(10 + rank); np.random.seed(20 + rank); torch.manual_seed(30 + rank)
        streams = {rank: {"pos": torch.tensor([rank, 1])}, rank + 2: {"pos": torch.tensor([rank, 2])}}
        rng = LoopRNG(0)
        path = ck.save(1, model=m1, optimizer=o1, states={"data": PerRank(Streams(streams), merge), "rng": PerRank(rng)})
        expected = draws()
        at_save = get_model_state_dict(m1, options=full_sd)  # a collective under FSDP2
        if rank == 0:
            torch.save(at_save, os.path.join(out, name, "weights-at-save.pt"))
        step(m1, o1)  # an async write must not see this step
        ck.wait()
        m2 = make(1)
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
        data, rng2 = Streams(), LoopRNG(0)
        ck.load(path, model=m2, optimizer=o2, states={"data": PerRank(data, merge), "rng": PerRank(rng2)})
        rng2.start()
        got = draws()
        step(m2, o2)
        a, b = get_model_state_dict(m1, options=full_sd), get_model_state_dict(m2, options=full_sd)
        sharded_params = type(next(m2.parameters())).__name__ == "DTensor"
        result[name] = {"rng_ok": got == expected, "rng": expected, "streams": sorted(data.streams),
                        "same_after_a_step": all(torch.equal(a[k], b[k]) for k in a),
                        "dtensor": sharded_params, "latest": str(ck.latest())}
        # into the live, stepped model and optimizer (a rollback's case: full loads broadcast in place)
        rng3 = LoopRNG(0)
        ck.load(path, model=m1, optimizer=o1, states={"rng": PerRank(rng3)})
        rng3.start()
        draws()  # as after the first load: the step's batch comes from the same RNG state
        step(m1, o1)
        a = get_model_state_dict(m1, options=full_sd)
        result[name]["same_loaded_into_live"] = all(torch.equal(a[k], b[k]) for k in a)
        ck.close()

    # A save that fails on one rank only must raise on both, not hang, and leave nothing behind.
    ck = Checkpointer(os.path.join(out, "ddp-full-sync"), state)
    m = DDP(model_of(0))
    bad = Streams({rank: {"pos": np.int64(1) if rank == 1 else 1}})
    try:
        ck.save(3, model=m, optimizer=torch.optim.AdamW(m.parameters()), states={"data": PerRank(bad)})
        result["failed"] = "no error"
    except CheckpointError as err:
        result["failed"] = str(err)
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    state.wait_for_everyone()
    state.destroy_process_group()
""")


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("two-ranks")
    script = out / "worker.py"
    script.write_text(RANK_WORKER)
    launch_ranks(script, str(out), timeout=300)
    return out, [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_two_ranks_save_and_get_back_their_own_rng_data_weights_and_moments(two_rank_checkpoints):
    out, results = two_rank_checkpoints
    for rank, r in enumerate(results):
        for name, case in r.items():
            if name == "failed":
                continue
            assert case["rng_ok"] and case["same_after_a_step"] and case["same_loaded_into_live"], (
                rank,
                name,
            )
            assert case["streams"] == [0, 1, 2, 3], (rank, name)  # every rank's streams, merged
            assert case["dtensor"] == name.startswith("fsdp2"), (rank, name)
            assert case["latest"].endswith("step-00000001"), (rank, name)
    assert results[0]["ddp-full-sync"]["rng"] != results[1]["ddp-full-sync"]["rng"]  # distinct RNG streams
    assert sorted(
        p.name for p in (out / "fsdp2-sharded-sync" / "checkpoints" / "step-00000001").iterdir()
    ) == [
        "COMPLETE",
        "dcp",
        "meta.json",
        "rank-00000.pt",
        "rank-00001.pt",
        "states.pt",
    ]


@pytest.mark.slow
def test_a_save_failing_on_one_rank_raises_on_both(two_rank_checkpoints):
    out, results = two_rank_checkpoints
    assert results[0]["failed"].startswith("another rank failed to start step-00000003")
    assert (
        results[1]["failed"].startswith("failed to start step-00000003")
        and "numpy.int64" in results[1]["failed"]
    )
    assert not (out / "ddp-full-sync" / "checkpoints" / "step-00000003").exists()


@pytest.mark.parametrize("name", ["fsdp2-sharded-async", "fsdp2-full-sync"])
def test_a_two_rank_fsdp2_checkpoint_loads_into_one_process(two_rank_checkpoints, name):
    """DCP reshards onto a different process count; the full format needs no resharding."""
    out, results = two_rank_checkpoints
    path = out / name / "checkpoints" / "step-00000001"
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    class Streams:
        streams = None

        def load_state_dict(self, s):
            self.streams = s

    data, rng = Streams(), LoopRNG(0)
    merge = lambda saved: {k: v for s in saved for k, v in s["streams"].items()}  # noqa: E731
    Checkpointer(out / name).load(
        path, model=model, optimizer=optimizer, states={"data": PerRank(data, merge), "rng": PerRank(rng)}
    )
    assert sorted(data.streams) == [0, 1, 2, 3] and torch.equal(data.streams[3]["pos"], torch.tensor([1, 2]))
    rng.start()  # rank 0's RNG state
    assert [random.random(), np.random.rand(), torch.rand(1).item()] == results[0][name]["rng"]
    assert optimizer.state[model[1].weight]["exp_avg"].shape == (8, 8)  # whole moments, from two shards
    assert_same_tensors(model.state_dict(), torch.load(out / name / "weights-at-save.pt", weights_only=True))
