"""Sharding on CPU in 2 real gloo processes: FSDP2 and ZeRO train like DDP, with half the optimizer state."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "sharding_cpu.py"
ACCELERATE = Path(sys.executable).with_name("accelerate")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """One run of the documented launch (ACCELERATE_USE_CPU=true accelerate launch --multi_gpu, 2 ranks)."""
    out = tmp_path_factory.mktemp("sharding") / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(ACCELERATE_USE_CPU="true", PYTHONUNBUFFERED="1")
    cmd = [
        str(ACCELERATE),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        str(SCRIPT),
        "--steps",
        "10",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "process group: world_size=2 backend=gloo" in proc.stdout, proc.stdout
    return json.loads(out.read_text())


def test_a_real_two_process_gloo_group_ran_every_mode(report):
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert list(report["modes"]) == ["ddp", "fsdp2", "zero"]
    for mode, m in report["modes"].items():
        assert [r["rank"] for r in m["ranks"]] == [0, 1], mode  # both ranks reported
        assert m["ranks"][0]["param_digest"] == m["ranks"][1]["param_digest"], mode  # replicas agree
        assert len(m["losses"]) == 10
    losses = report["modes"]["ddp"]["losses"]
    assert losses[-1] < losses[0] - 1.0  # it trained (the same batch every step is being learnt)
    assert max(report["modes"]["ddp"]["grad_norms"]) > 1.0  # clipping (max_norm 1) really acted


@pytest.mark.parametrize("mode", ["fsdp2", "zero"])
def test_sharded_training_matches_ddp_in_float64(report, mode):
    ddp, m = report["modes"]["ddp"], report["modes"][mode]
    assert m["max_rel_param_diff_vs_ddp"] < 1e-9
    assert m["losses"] == pytest.approx(ddp["losses"], rel=1e-9, abs=0)
    assert m["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-9, abs=0)


@pytest.mark.parametrize("mode", ["fsdp2", "zero"])
def test_each_rank_holds_about_half_the_optimizer_state(report, mode):
    ddp, m = report["modes"]["ddp"], report["modes"][mode]
    for rank in range(2):
        full = ddp["ranks"][rank]["optimizer_state_bytes"]
        assert full > 0
        assert 0.4 * full <= m["ranks"][rank]["optimizer_state_bytes"] <= 0.6 * full, (mode, rank)
    # FSDP2 shards the parameters too; ZeRO-1 keeps them whole on every rank.
    expected = 0.5 if mode == "fsdp2" else 1.0
    for rank in range(2):
        ratio = m["ranks"][rank]["param_bytes"] / ddp["ranks"][rank]["param_bytes"]
        assert ratio == pytest.approx(expected, abs=0.01), (mode, rank)


def test_a_single_process_is_refused_not_reported_as_sharded(tmp_path):
    # What `accelerate launch --cpu --num_processes 2` silently gives: one process, nothing to shard.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(tmp_path / "r.json")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "refusing to run" in proc.stderr and "--num_processes 2" in proc.stderr
    assert not (tmp_path / "r.json").exists()
