"""Issue-6 checks on real smoke runs: local comparison, regression assert, and no secret anywhere."""

import subprocess
import sys

import pytest

import recipe_runner as rr

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

SECRET = "wandb-test-secret-0123456789abcdef0123456789"
SHORT = [*rr.QUICK, "--train.max_steps=8", "--eval.every=4", "--checkpoint.every=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs with the same seed and one with another lr, all with an API key in the environment
    (each as `python recipes/pretrain.py` runs it, forked: rr.run_each)."""
    root = tmp_path_factory.mktemp("compare")
    plan = {"seed-a": [], "seed-b": [], "lr-high": ["--optim.lr=1e-2"]}
    logs = rr.run_each(
        [[str(rr.SMOKE), f"--run.output_dir={root / name}", *SHORT, *extra] for name, extra in plan.items()],
        env={"WANDB_API_KEY": SECRET},
    )
    return {name: rr.Run(root / name, 0, log) for name, log in zip(plan, logs, strict=True)}


def compare(*args):
    return subprocess.run(
        [sys.executable, str(rr.ROOT / "scripts" / "compare_runs.py"), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )


def test_compare_runs_table_diff_and_plot(runs, tmp_path):
    png = tmp_path / "loss.png"
    out = compare(runs["seed-a"].out, runs["lr-high"].out, "--plot", png)
    assert out.returncode == 0, out.stdout
    header, rule, *rows = out.stdout.splitlines()[:4]
    assert header.split()[:2] == ["run", "steps"] and set(rule) <= {"-", " "}
    assert rows[0].split()[:2] == ["seed-a", "8"] and rows[1].split()[:2] == ["lr-high", "8"]
    assert "optim.lr" in out.stdout and "0.003" in out.stdout and "0.01" in out.stdout
    assert "run.output_dir" in out.stdout and "train.max_steps" not in out.stdout  # only what differs
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_assert_close_passes_for_same_seed_and_fails_for_another_lr(runs, tmp_path):
    same = compare(
        runs["seed-a"].out, runs["seed-b"].out, "--assert-close", "1e-6", "--plot", tmp_path / "a.png"
    )
    assert same.returncode == 0, same.stdout
    differ = compare(
        runs["seed-a"].out, runs["lr-high"].out, "--assert-close", "1e-3", "--plot", tmp_path / "b.png"
    )
    assert differ.returncode == 1 and "NOT CLOSE" in differ.stdout


def test_compare_reads_offline_wandb_files_too(runs, tmp_path):
    out = compare(
        runs["seed-a"].out,
        runs["seed-b"].out,
        "--wandb",
        "--assert-close",
        "1e-6",
        "--plot",
        tmp_path / "w.png",
    )
    assert out.returncode == 0, out.stdout


def test_no_secret_in_any_artefact(runs):
    for run in runs.values():
        assert SECRET not in run.output
        files = [p for p in run.out.rglob("*") if p.is_file()]
        assert len(files) > 10  # config, metrics, checkpoints, final, wandb files
        leaking = [p for p in files if SECRET.encode() in p.read_bytes()]
        assert leaking == []
