"""Tracking: real offline W&B runs (through accelerate) read back from their files, resume continuity,
secrets, the W&B mode fallback, the .wandb parser, and the console helpers."""

import json
import logging
import math
import socket
import subprocess
import time
from pathlib import Path

import pytest
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from lmpretrain.analysis.wandb_offline import (
    CorruptRunFile,
    find_offline_runs,
    iter_records,
    load_table,
    read_offline_history,
    read_offline_run,
    run_file,
    wait_until_complete,
)
from lmpretrain.observe.console import ConsoleWarnings, format_log_line
from lmpretrain.observe.tracking import (
    REDACTED,
    SAMPLES_TABLE_KEY,
    Tracker,
    can_reach,
    has_wandb_credentials,
    is_secret_key,
    read_jsonl,
    resolve_wandb_mode,
    scrub_secrets,
    wandb_log_with,
)
from lmpretrain.update.guard import NONFINITE, OVERFLOW, SPIKE

WANDB_CLI = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "wandb"


@pytest.fixture(autouse=True)
def wandb_env(tmp_path, monkeypatch):
    """Keep W&B offline, quiet, and its caches/settings inside the test's tmp dir."""
    for var in (
        "WANDB_API_KEY",
        "WANDB_IDENTITY_TOKEN_FILE",
        "WANDB_BASE_URL",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in (
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_CONFIG_DIR", "config"),
    ):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    yield
    AcceleratorState._reset_state(True)


def make_tracker(out, mode="offline", **kw):
    accelerator = Accelerator(log_with=wandb_log_with(mode), cpu=True)
    defaults = dict(
        output_dir=out,
        project="lmpretrain-tests",
        mode=mode,
        run_name="tiny",
        group="sweep-a",
        run_config={"optim": {"lr": 1e-3}, "model": {"type": "llama"}, "world_size": 1},
    )
    return Tracker(accelerator, **{**defaults, **kw})


def train_row(step, tokens_per_step=64):
    return {
        "train/loss": 5.0 / step,
        "train/lr": 1e-3,
        "train/grad_norm": 1.5,
        "train/clipped": step % 2 == 0,
        "train/tokens_seen": step * tokens_per_step,
        "perf/tokens_per_s": 1000.0 + step,
    }


def steps_of(rows, key="step"):
    return [r[key] for r in rows]


# --------------------------------------------------------------------------------------------
# A real offline run, read back from its files
# --------------------------------------------------------------------------------------------


def test_offline_run_has_keys_steps_config_and_tables(tmp_path):
    out = tmp_path / "run"
    tracker = make_tracker(out)
    assert tracker.mode == "offline" and tracker.run_id
    for step in range(1, 7):
        tracker.log(train_row(step), step)
        if step % 3 == 0:  # eval logged by a second call at the same step merges into the row
            tracker.log({"eval/loss": 4.0 / step, "eval/ppl": math.exp(4.0 / step)}, step)
            tracker.log_samples(step, [("def ", f"generated at {step}"), ("class ", "x")])
    tracker.finish()
    tracker.finish()  # idempotent

    rows = read_jsonl(out / "metrics.jsonl")
    assert steps_of(rows) == [1, 2, 3, 4, 5, 6]
    assert rows[2]["eval/loss"] == pytest.approx(4.0 / 3) and rows[2]["train/loss"] == pytest.approx(5.0 / 3)
    assert "eval/loss" not in rows[3]

    folders = find_offline_runs(out)
    assert len(folders) == 1 and folders[0].name.endswith(tracker.run_id)
    run = read_offline_run(folders[0])
    assert run["id"] == tracker.run_id and run["name"] == "tiny" and run["group"] == "sweep-a"
    assert run["project"] == "lmpretrain-tests" and run["exit_code"] == 0
    assert run["config"] == {"optim": {"lr": 1e-3}, "model": {"type": "llama"}, "world_size": 1}
    history = run["history"]
    assert steps_of(history, "_step") == [1, 2, 3, 4, 5, 6]
    for w, m in zip(history, rows, strict=True):  # same keys and values in W&B and metrics.jsonl
        metric_keys = {k for k in m if not k.startswith("_") and k != "step"}
        assert metric_keys <= set(w)
        assert all(w[k] == m[k] for k in metric_keys)
    assert history[5]["train/clipped"] is True and history[5]["train/tokens_seen"] == 6 * 64
    assert run["summary"]["eval/loss"]["min"] == pytest.approx(4.0 / 6)  # define_metric(summary="min")

    table = load_table(run, history[2], SAMPLES_TABLE_KEY)
    assert table["columns"] == ["step", "prompt", "generation"]
    assert table["data"] == [[3, "def ", "generated at 3"], [3, "class ", "x"]]
    assert load_table(run, history[1], SAMPLES_TABLE_KEY) is None
    samples = read_jsonl(out / "samples.jsonl")
    assert [(s["step"], s["prompt"]) for s in samples] == [
        (3, "def "),
        (3, "class "),
        (6, "def "),
        (6, "class "),
    ]

    # tokens seen is the x-axis of every train/eval/perf metric
    metrics = [
        r.metric for r in iter_records(run_file(folders[0])) if r.WhichOneof("record_type") == "metric"
    ]
    axis = {m.glob_name or m.name: m.step_metric for m in metrics}
    assert axis["train/*"] == axis["eval/*"] == axis["perf/*"] == "train/tokens_seen"


def test_parser_agrees_with_wandb_cli_and_handles_multi_block_records(tmp_path):
    out = tmp_path / "run"
    big = "x" * 100_000  # a config record spanning 4 blocks: FIRST, MIDDLE, MIDDLE, LAST chunks
    tracker = make_tracker(out, run_config={"blob": big})
    for step in range(1, 400):  # enough records to cross several 32 KiB block boundaries
        tracker.log(train_row(step), step)
    tracker.finish()
    folder = find_offline_runs(out)[0]
    run = read_offline_run(folder)
    assert run["config"]["blob"] == big
    assert steps_of(run["history"], "_step") == list(range(1, 400))
    assert run_file(folder).stat().st_size > 4 * 32768

    cli = subprocess.run(
        [str(WANDB_CLI), "leet", "inspect", "--json", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    cli_history = [
        json.loads(line)["history"]["item"]
        for line in cli.stdout.splitlines()
        if json.loads(line).get("type") == "history"
    ]
    assert cli_history == run["history"]


def test_parser_stops_at_a_torn_tail_and_rejects_corruption(tmp_path, caplog):
    out = tmp_path / "run"
    tracker = make_tracker(out)
    for step in range(1, 50):
        tracker.log(train_row(step), step)
    tracker.finish()
    path = run_file(find_offline_runs(out)[0])
    assert wait_until_complete(path)  # finish() may return before wandb-core's last block lands
    data = path.read_bytes()

    torn = tmp_path / "torn.wandb"
    torn.write_bytes(data[: len(data) - 5])  # killed mid-write
    with caplog.at_level(logging.WARNING):
        assert len(list(iter_records(torn))) == len(list(iter_records(path))) - 1
    assert "torn" in caplog.text

    damaged = bytearray(data)
    damaged[200] ^= 0xFF
    bad = tmp_path / "bad.wandb"
    bad.write_bytes(bytes(damaged))
    with pytest.raises(CorruptRunFile):
        list(iter_records(bad))
    (tmp_path / "not.wandb").write_bytes(b"hello world")
    with pytest.raises(CorruptRunFile, match="not a W&B"):
        list(iter_records(tmp_path / "not.wandb"))


# --------------------------------------------------------------------------------------------
# Resume continuity
# --------------------------------------------------------------------------------------------


def test_resume_continues_the_same_run_without_duplicate_or_backward_steps(tmp_path):
    out = tmp_path / "run"
    first = make_tracker(out)
    for step in range(1, 9):  # checkpoint at 5, then "crash" after step 8
        first.log(train_row(step), step)
        if step == 4:
            first.log({"eval/loss": 1.0}, step)
    first.finish()
    run_id = first.run_id

    second = make_tracker(out, run_id=run_id, resume_step=5)
    assert second.run_id == run_id
    assert steps_of(read_jsonl(out / "metrics.jsonl")) == [1, 2, 3, 4, 5]  # rows after the checkpoint dropped
    for step in range(6, 11):  # steps 6..8 are redone, 9..10 are new
        second.log({**train_row(step), "train/loss": 100.0 + step}, step)
    second.finish()

    rows = read_jsonl(out / "metrics.jsonl")
    assert steps_of(rows) == list(range(1, 11))
    assert [r["train/loss"] for r in rows[5:]] == [106.0, 107.0, 108.0, 109.0, 110.0]

    folders = find_offline_runs(out)
    assert len(folders) == 2 and all(read_offline_run(f)["id"] == run_id for f in folders)
    assert steps_of(read_offline_run(folders[1])["history"], "_step") == [9, 10]  # 6..8 not re-sent
    merged = read_offline_history(out)
    assert merged["id"] == run_id and merged["duplicate_steps"] == 0
    steps = steps_of(merged["history"], "_step")
    assert steps == list(range(1, 11)) and steps == sorted(set(steps))


def logged_run(out, last_step: int) -> None:
    """A finished run (W&B off) that logged train rows for steps 1..last_step into `out`."""
    tracker = make_tracker(out, mode="disabled")
    for step in range(1, last_step + 1):
        tracker.log(train_row(step), step)
    tracker.finish()


def test_resume_merges_a_log_at_the_checkpoint_step_and_fresh_runs_keep_old_metrics(tmp_path):
    out = tmp_path / "run"
    logged_run(out, last_step=3)
    second = make_tracker(out, mode="disabled", resume_step=3)
    second.log({"eval/loss": 2.0}, 3)  # same step as the last kept row: merged, not duplicated
    second.log(train_row(4), 4)
    with pytest.raises(ValueError, match="backwards"):
        second.log(train_row(2), 2)
    second.finish()
    rows = read_jsonl(out / "metrics.jsonl")
    assert steps_of(rows) == [1, 2, 3, 4] and rows[2]["eval/loss"] == 2.0 and "train/loss" in rows[2]

    fresh = make_tracker(out, mode="disabled")  # no resume_step: a new run must not append to old rows
    fresh.log(train_row(1), 1)
    fresh.finish()
    assert steps_of(read_jsonl(out / "metrics.jsonl")) == [1]
    assert steps_of(read_jsonl(out / "metrics.jsonl.prev")) == [1, 2, 3, 4]


def test_a_new_wandb_run_on_resume_gets_every_step_it_is_given(tmp_path):
    out = tmp_path / "run"
    logged_run(out, last_step=5)
    second = make_tracker(out, resume_step=3)  # W&B on now, no run to continue: a new run
    for step in range(4, 7):
        second.log(train_row(step), step)
    second.finish()
    assert steps_of(read_offline_history(out)["history"], "_step") == [4, 5, 6]
    assert steps_of(read_jsonl(out / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]


def test_disabled_mode_writes_metrics_but_no_wandb(tmp_path):
    out = tmp_path / "run"
    assert wandb_log_with("disabled") is None
    tracker = make_tracker(out, mode="disabled")
    tracker.log(train_row(1), 1)
    tracker.log_samples(1, [("a", "b")])
    tracker.finish()
    assert tracker.run_id is None and tracker.mode == "disabled"
    assert steps_of(read_jsonl(out / "metrics.jsonl")) == [1]
    assert read_jsonl(out / "samples.jsonl") == [{"step": 1, "prompt": "a", "generation": "b"}]
    assert not (out / "wandb").exists()


def test_tracker_refuses_an_accelerator_without_wandb(tmp_path):
    with pytest.raises(ValueError, match="log_with"):
        Tracker(
            Accelerator(cpu=True),
            output_dir=tmp_path,
            project="p",
            mode="offline",
            run_name=None,
            group=None,
            run_config={},
        )


# --------------------------------------------------------------------------------------------
# Secrets
# --------------------------------------------------------------------------------------------


def test_no_secret_in_any_artefact_when_the_api_key_is_set(tmp_path, monkeypatch, caplog):
    key = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrstuvwxyz")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")  # no network -> offline
    out = tmp_path / "run"
    config = {
        "hub": {"token": "hf_abcdefghijklmnopqrstuvwxyz", "repo": "me/model"},
        "logging": {"wandb_api_key": key, "note": f"launched with key={key}"},
        "secrets": {"password": "hunter2hunter2"},
        "tokenizer": {"pad_token": "<pad>", "bos_token_id": 1},
        "train": {"tokens_per_step": 4096},
    }
    with caplog.at_level(logging.WARNING):
        tracker = make_tracker(out, mode="online", run_config=config)
    assert tracker.mode == "offline" and "cannot reach" in caplog.text
    tracker.log({**train_row(1), "note": f"key {key}"}, 1)
    tracker.log_samples(1, [("prompt", "gen")])
    tracker.finish()

    sent = read_offline_run(find_offline_runs(out)[0])["config"]
    assert sent["hub"] == {"token": REDACTED, "repo": "me/model"}
    assert sent["logging"] == {"wandb_api_key": REDACTED, "note": f"launched with key={REDACTED}"}
    assert sent["secrets"]["password"] == REDACTED
    assert sent["tokenizer"] == {"pad_token": "<pad>", "bos_token_id": 1}
    assert sent["train"] == {"tokens_per_step": 4096}
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 5
    leaks = [
        str(p) for p in files if key.encode() in p.read_bytes() or b"hf_abcdefghijklmnop" in p.read_bytes()
    ]
    assert leaks == []


def test_secret_key_names():
    for k in (
        "api_key",
        "wandb_api_key",
        "hf_token",
        "token",
        "HF-TOKEN",
        "access_token",
        "secret",
        "aws_secret_key",
        "password",
        "db_passwd",
        "credentials",
        "apikey",
    ):
        assert is_secret_key(k), k
    for k in (
        "tokenizer",
        "tokens_seen",
        "max_tokens",
        "pad_token",
        "eos_token",
        "bos_token_id",
        "token_ids",
        "num_tokens",
        "tokens_per_step",
        "lr",
    ):
        assert not is_secret_key(k), k
    assert scrub_secrets({"a": ["x", {"token": 5}], "b": "say SECRETVALUE"}, secrets=["SECRETVALUE"]) == {
        "a": ["x", {"token": REDACTED}],
        "b": f"say {REDACTED}",
    }


# --------------------------------------------------------------------------------------------
# W&B mode
# --------------------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_online_falls_back_to_offline_without_key_or_network(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("WANDB_MODE")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        up = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("WANDB_BASE_URL", up)
        with caplog.at_level(logging.WARNING):
            assert resolve_wandb_mode("online") == "offline"  # no key anywhere
        assert "no W&B API key" in caplog.text
        (tmp_path / "netrc").write_text(f"machine 127.0.0.1:{server.getsockname()[1]} login user password k")
        monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
        assert has_wandb_credentials()
        assert resolve_wandb_mode("online") == "online"  # key in .netrc and the host answers
        monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        assert resolve_wandb_mode("online") == "online"

    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    t0 = time.perf_counter()
    assert resolve_wandb_mode("online") == "offline"
    assert time.perf_counter() - t0 < 3
    assert not can_reach("http://unresolvable.invalid", timeout=2.0)

    assert resolve_wandb_mode("offline") == "offline"
    assert resolve_wandb_mode("disabled") == "disabled"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_wandb_mode("online") == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("offline") == "disabled" and wandb_log_with("offline") is None
    with pytest.raises(ValueError, match="wandb_mode"):
        resolve_wandb_mode("cloud")


# --------------------------------------------------------------------------------------------
# Console and run metadata
# --------------------------------------------------------------------------------------------


def test_console_warnings_are_said_once_per_kind():
    said = []
    warn = ConsoleWarnings(
        said.append, spike_sigma=4.0, window=20, min_window=10, clip_streak=5, max_skipped=10
    )
    for step in range(1, 30):  # steady, slightly noisy loss, clipped every step
        warn.observe(step, 3.0 + 0.01 * (step % 3), clipped=True)
    assert len(said) == 1 and "clipped on each of the last 5 steps" in said[0]
    warn.observe(30, 9.0)  # a spike, not skipped
    warn.observe(31, 9.5, skipped=OVERFLOW)
    warn.observe(32, 9.6, skipped=OVERFLOW)
    warn.observe(33, float("nan"), skipped=NONFINITE)
    warn.observe(34, 9.0, skipped=SPIKE)
    warn.observe(35, float("nan"), skipped=NONFINITE)
    assert len(said) == 5, said
    assert (
        "loss spike at step 30: 9.0000 is more than 4 sigma above the last 20 steps' mean 3.0105" in said[1]
    )
    assert "step 31 was skipped: inf/nan gradients under fp16 loss scaling" in said[2]
    assert (
        "update of step 33 was skipped: its loss (nan) or gradient norm is not finite; 10 in a row" in said[3]
    )
    assert "update of step 34 was skipped: its loss 9.0000 is a spike (train.skip_spikes)" in said[4]
    assert warn.said == {
        "clipping",
        "spike",
        f"skipped:{OVERFLOW}",
        f"skipped:{NONFINITE}",
        f"skipped:{SPIKE}",
    }


def test_format_log_line_shows_only_present_keys():
    line = format_log_line(
        10,
        {
            "train/loss": 3.14159,
            "train/lr": 3e-4,
            "train/grad_norm": 1.2,
            "train/clipped": True,
            "perf/tokens_per_s": 12345.0,
            "perf/mfu": 0.123,
            "train/tokens_seen": 2_500_000,
        },
        max_steps=100,
    )
    assert line == (
        "step 10/100 | loss 3.1416 | lr 3.00e-04 | gnorm 1.2 (clipped) | 12.3k tok/s | mfu 12.3% "
        "| 2.5M tokens"
    )
    assert format_log_line(5, {"eval/loss": 2.0, "eval/ppl": 7.389}) == "step 5 | eval loss 2.0000 ppl 7.39"
    with_se = {"eval/loss": 2.0, "eval/loss_se": 0.0123, "eval/ppl": 7.389}
    assert format_log_line(5, with_se) == "step 5 | eval loss 2.0000 ± 0.0123 ppl 7.39"
    with_ema = {"eval/loss": 2.0, "eval/ema/loss": 1.9, "eval/ema/bpb": 1.0}  # train.ema_decay
    assert format_log_line(5, with_ema) == "step 5 | eval loss 2.0000 (ema 1.9000)"
