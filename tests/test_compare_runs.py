"""scripts/compare_runs.py and lmpretrain.analysis.runs: table, config diff, PNG, --assert-close, --wandb."""

import contextlib
import io
import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from lmpretrain.analysis.runs import (
    check_close,
    config_diff,
    curve_distance,
    flatten,
    format_table,
    load_run,
    load_runs,
    summarize,
)
from lmpretrain.observe.tracking import Tracker, wandb_log_with

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compare_runs.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run_dir(path: Path, lr: float, loss_shift: float = 0.0, steps: int = 20, seed: int = 0) -> Path:
    """A run directory as the recipe leaves it: metrics.jsonl (train rows, eval every 5) + config.yaml."""
    path.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "train/loss": 6.0 * math.exp(-step / 10) + 1 + loss_shift,
            "train/lr": lr,
            "train/tokens_seen": 512 * step,
            "perf/tokens_per_s": 1000.0 + step,
            "_timestamp": 1000.0 + 2 * step,
        }
        if step % 5 == 0:
            loss = 6.5 * math.exp(-step / 12) + 1.2 + loss_shift
            row.update({"eval/loss": loss, "eval/bpb": loss / math.log(2) / 3.5})
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "run": {"output_dir": str(path), "seed": seed},
        "optim": {"lr": lr, "min_lr": 1e-5},
        "model": {"type": "llama", "overrides": {"hidden_size": 64}},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def compare(*args) -> subprocess.CompletedProcess:
    """`python scripts/compare_runs.py ARGS` (its `__main__` block, its exit status), run in this process: an
    interpreter with matplotlib costs ~9 CPU-s a call. tests/test_tracking_e2e.py starts the script for real."""
    stdout, stderr, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv, code = [str(SCRIPT), *map(str, args)], 0
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(str(SCRIPT), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def test_table_diff_plot_and_assert_close_pass_for_identical_runs(tmp_path):
    a = make_run_dir(tmp_path / "a", lr=1e-3)
    b = make_run_dir(tmp_path / "b", lr=1e-3)
    png = tmp_path / "plots" / "loss.png"
    result = compare(a, b, "--plot", png, "--assert-close", "1e-9")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    header = out.splitlines()[0]
    for title in (
        "run",
        "steps",
        "final train loss",
        "final eval loss",
        "best eval loss",
        "final eval bpb",
        "tokens/s (median)",
        "wall time (s)",
    ):
        assert title in header
    final_train = f"{6.0 * math.exp(-2) + 1:.4f}"
    assert out.splitlines()[2].split()[:3] == ["a", "20", final_train]
    assert "38.0" in out.splitlines()[2]  # wall time: timestamps 1002 .. 1040
    # only the key that differs: run.output_dir
    diff_lines = [line for line in out.splitlines() if line.startswith("run.output_dir")]
    assert len(diff_lines) == 1 and "optim.lr" not in out
    assert "loss curves agree within 1e-09" in out
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


def test_assert_close_fails_for_different_learning_rates(tmp_path):
    a = make_run_dir(tmp_path / "a", lr=1e-3)
    b = make_run_dir(tmp_path / "b", lr=3e-3, loss_shift=0.05)
    result = compare(a, b, "--plot", tmp_path / "p.png", "--assert-close", "0.01")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NOT CLOSE: a vs b: max |diff| of train/loss = 0.05" in result.stdout
    assert any(
        line.startswith("optim.lr") and "0.001" in line and "0.003" in line
        for line in result.stdout.splitlines()
    )
    assert compare(a, b, "--plot", tmp_path / "p.png", "--assert-close", "0.1").returncode == 0
    assert compare(a, b, "--plot", tmp_path / "p.png").returncode == 0  # no check asked


def test_library_pieces(tmp_path):
    a = load_run(make_run_dir(tmp_path / "x" / "run", lr=1e-3, steps=10))
    b = load_run(make_run_dir(tmp_path / "y" / "run", lr=1e-3, steps=20, seed=1))
    assert curve_distance(a, b) == (0.0, 10)  # common steps only
    assert config_diff([a, b]) == {"run.output_dir": [str(a.path), str(b.path)], "run.seed": [0, 1]}
    assert [r.name for r in load_runs([a.path, b.path])] == [str(a.path), str(b.path)]  # same folder name
    s = summarize(b)
    assert s["steps"] == 20 and s["best_eval_loss"] == pytest.approx(6.5 * math.exp(-20 / 12) + 1.2)
    assert s["final_eval_bpb"] == pytest.approx((6.5 * math.exp(-20 / 12) + 1.2) / math.log(2) / 3.5)
    assert s["tokens_per_s_median"] == pytest.approx(1010.5)
    lone = load_run(make_run_dir(tmp_path / "z", lr=1e-3))
    lone.rows = [{"step": 100, "train/loss": 1.0}]
    assert check_close([a, lone], 1.0) == ["run vs z: no common steps with train/loss"]
    nan_run = load_run(make_run_dir(tmp_path / "w", lr=1e-3))
    nan_run.rows[0]["train/loss"] = float("nan")
    assert curve_distance(a, nan_run)[0] == math.inf
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}
    with pytest.raises(FileNotFoundError, match="--wandb"):
        load_run(tmp_path / "missing")


def test_wandb_source_reads_real_offline_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dirs = []
    try:
        for name, lr in (("lr1", 1e-3), ("lr3", 3e-3)):
            out = tmp_path / name
            tracker = Tracker(
                Accelerator(log_with=wandb_log_with("offline"), cpu=True),
                output_dir=out,
                project="cmp",
                mode="offline",
                run_name=name,
                group="g",
                run_config={"optim": {"lr": lr}, "seed": 0},
            )
            for step in range(1, 11):
                tracker.log({"train/loss": 3.0 / step + lr, "train/tokens_seen": 100 * step}, step)
                if step % 5 == 0:
                    tracker.log({"eval/loss": 3.5 / step + lr}, step)
            tracker.finish()
            run_dirs.append(out)
    finally:
        AcceleratorState._reset_state(True)

    from_wandb = [load_run(d, source="wandb") for d in run_dirs]
    from_jsonl = [load_run(d) for d in run_dirs]
    for w, j in zip(from_wandb, from_jsonl, strict=True):
        assert [r["step"] for r in w.rows] == [r["step"] for r in j.rows] == list(range(1, 11))
        assert [r["train/loss"] for r in w.rows] == [r["train/loss"] for r in j.rows]
        assert w.rows[4]["eval/loss"] == j.rows[4]["eval/loss"]
    assert config_diff(from_wandb) == {"optim.lr": [1e-3, 3e-3]}  # no config.yaml: W&B's config

    png = tmp_path / "w.png"
    result = compare(*run_dirs, "--wandb", "--plot", png, "--assert-close", "1e-3")
    assert result.returncode == 1 and "max |diff| of train/loss = 0.002" in result.stdout
    assert png.stat().st_size > 10_000


def test_keys_add_any_logged_metric_and_the_diff_shows_what_trained_each_run(tmp_path):
    runs = []
    for name, (mtp, commit) in {"a": (2.5, "abc"), "b": (2.25, "def")}.items():
        path = make_run_dir(tmp_path / name, lr=1e-3)
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        rows[-1]["train/mtp"] = mtp  # a fork's extra term, logged by the recipe as train/<name>
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = yaml.safe_load((path / "config.yaml").read_text())
        config["provenance"] = {"recipe": f"recipes/{name}.py", "git_commit": commit}
        (path / "config.yaml").write_text(yaml.safe_dump(config))
        runs.append(path)
    result = compare(*runs, "--keys", "train/mtp", "--plot", tmp_path / "p.png")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[-1] == "train/mtp"
    assert lines[2].split()[-1] == "2.5" and lines[3].split()[-1] == "2.25"
    assert any(line.startswith("provenance.git_commit") and "abc" in line and "def" in line for line in lines)
    assert any(line.startswith("provenance.recipe") for line in lines)


def test_ema_columns_appear_for_runs_with_an_ema(tmp_path):
    a = load_run(make_run_dir(tmp_path / "a", lr=1e-3, steps=10))
    b = load_run(make_run_dir(tmp_path / "b", lr=1e-3, steps=10))
    assert "ema" not in format_table([summarize(a), summarize(b)])
    for i, row in enumerate(r for r in b.rows if "eval/loss" in r):
        row["eval/ema/loss"] = 3.0 - i
    s = summarize(b)
    assert s["final_ema_loss"] == s["best_ema_loss"] == 3.0 - i
    table = format_table([summarize(a), s]).splitlines()
    assert "final ema loss" in table[0] and "best ema loss" in table[0]
    assert table[2].split()[6:8] == ["-", "-"] and table[3].split()[6:8] == [f"{3.0 - i:.4f}"] * 2


def test_keys_get_panels_and_the_digits_that_tell_runs_apart_wall_time_spans_resumes_long_values_wrap(
    tmp_path,
):
    from lmpretrain.analysis.runs import format_config_diff, format_table, plot_runs

    runs = []
    for name, value in {"a": 2.5000011, "b": 2.5000012}.items():
        path = make_run_dir(tmp_path / name, lr=1e-3)
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            r["train/entropy"] = value
            r["perf/step_time_s"] = 1.5
            if r["step"] > 10:  # stopped after step 10, resumed 60 s later
                r["_timestamp"] += 60
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        config = yaml.safe_load((path / "config.yaml").read_text())
        config["data"] = {"train": [{"files": [f"/data/{name}/shard-{i:04d}.jsonl" for i in range(30)]}]}
        (path / "config.yaml").write_text(yaml.safe_dump(config))
        runs.append(load_run(path))
    keys = ("train/entropy", "train/lr", "eval/bpb")
    table = format_table([summarize(r, keys) for r in runs], keys).splitlines()
    assert table[2].split()[-3] == "2.5000011" and table[3].split()[-3] == "2.5000012"
    assert table[2].split()[-2] == "0.001"  # equal values keep 4 significant digits
    # steps 1..20 end at 1002..1040 plus the 60 s pause; step 1 itself took 1.5 s
    assert summarize(runs[0])["wall_time_s"] == pytest.approx(38.0 + 60 + 1.5)
    diff = format_config_diff(runs, config_diff(runs))
    assert "shard-0029.jsonl" in diff and max(len(line) for line in diff.splitlines()) < 2 * 60 + 40
    png = plot_runs(runs, tmp_path / "p.png", keys)
    width, height = (int.from_bytes(png.read_bytes()[i : i + 4], "big") for i in (16, 20))
    assert (width, height) == (1800, 900)  # train loss, eval loss and the 3 keys: 2 rows of 3 panels


def with_blocks(
    path: Path, losses: list[float], targets: list[int], bytes_: list[int], step: int = 20
) -> Path:
    """Give a run dir's final evaluation (step 20) these per-block losses, as the evaluator records them:
    eval/loss, eval/bpb and their standard errors in metrics.jsonl, the blocks in eval_blocks.jsonl."""
    from lmpretrain.observe.evaluation import ratio_and_se

    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    loss, loss_se = ratio_and_se(losses, targets)
    bits, bits_se = ratio_and_se(losses, bytes_)
    rows[step - 1].update(
        {
            "eval/loss": loss,
            "eval/loss_se": loss_se,
            "eval/bpb": bits / math.log(2),
            "eval/bpb_se": bits_se / math.log(2),
            "eval/tokens": sum(targets),
        }
    )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    blocks = {"step": step, "loss": losses, "targets": targets, "bytes": bytes_}
    (path / "eval_blocks.jsonl").write_text(
        json.dumps({**blocks, "step": 5}) + "\n" + json.dumps(blocks) + "\n"
    )
    return path


def test_the_standard_error_of_a_held_out_mean_is_the_ratio_estimators():
    from lmpretrain.observe.evaluation import ratio_and_se

    # 4 blocks of 10 targets: mean 2.5; residuals -15, -5, 5, 15; sqrt(500 * 4/3) / 40
    loss, se = ratio_and_se([10.0, 20.0, 30.0, 40.0], [10, 10, 10, 10])
    assert loss == 2.5 and se == pytest.approx(math.sqrt(500 * 4 / 3) / 40) == pytest.approx(
        0.64550, abs=1e-5
    )
    # equal block losses: no spread, no error; one block: unknown
    assert ratio_and_se([3.0, 3.0, 3.0], [2, 2, 2]) == (1.5, 0.0)
    assert math.isnan(ratio_and_se([3.0], [2])[1])


def test_compare_states_the_held_out_size_and_marks_differences_within_noise(tmp_path):
    """b's blocks are a's plus 1, 3, 1, 3: +0.2 nats, paired se sqrt(4 * 4/3) / 40 = 0.0577, 3.5 se: beyond
    noise, though each run's own se is about 0.65 (unpaired, the same +0.2 would be within noise). c scored
    other blocks: unpaired. e is a's plus 1, -1, 1, -1: +0 +- 0.0577, within noise."""
    a_losses = [10.0, 20.0, 30.0, 40.0]
    targets, bytes_ = [10, 10, 10, 10], [35, 35, 35, 35]
    runs = {}
    for name, losses, tgt in (
        ("a", a_losses, targets),
        ("b", [x + d for x, d in zip(a_losses, [1, 3, 1, 3], strict=True)], targets),
        ("c", [x + d for x, d in zip(a_losses, [1, 3, 1, 3], strict=True)], [10, 10, 10, 11]),
        ("e", [x + d for x, d in zip(a_losses, [1, -1, 1, -1], strict=True)], targets),
    ):
        runs[name] = with_blocks(make_run_dir(tmp_path / name, lr=1e-3), losses, tgt, bytes_)
    result = compare(*runs.values(), "--plot", tmp_path / "p.png")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = lines[0]
    assert "eval loss se" in header and "eval bpb se" in header and "held-out tokens" in header
    assert lines[2].split()[:1] == ["a"] and "0.6455" in lines[2] and " 40" in lines[2]
    noise = {tuple(line.split()[:4]): line for line in lines if line.startswith("  ")}
    paired_se = math.sqrt(4 * 4 / 3) / 40
    b_loss = noise[("b", "-", "a", "eval/loss")]
    assert (
        f"+0.2000 ± {paired_se:.4f} (paired over the same 4 blocks, 40 tokens): beyond noise, 3.5 standard"
        in b_loss
    )
    b_bpb = noise[("b", "-", "a", "eval/bpb")]
    assert f"+{8 / 140 / math.log(2):.4f} ± {math.sqrt(4 * 4 / 3) / 140 / math.log(2):.4f} (paired" in b_bpb
    c_loss = noise[("c", "-", "a", "eval/loss")]
    se_c = math.hypot(0.6455, ratio_and_se_of([11.0, 23.0, 31.0, 43.0], [10, 10, 10, 11]))
    assert "(unpaired: not the same held-out blocks): within noise" in c_loss and f"± {se_c:.3f}" in c_loss
    e_loss = noise[("e", "-", "a", "eval/loss")]
    assert (
        f"+0.0000 ± {paired_se:.4f} (paired over the same 4 blocks, 40 tokens): within noise, 0.0" in e_loss
    )
    assert "not seed-to-seed variation" in result.stdout


def ratio_and_se_of(losses, targets) -> float:
    from lmpretrain.observe.evaluation import ratio_and_se

    return ratio_and_se(losses, targets)[1]


def test_runs_without_standard_errors_say_so(tmp_path):
    a = make_run_dir(tmp_path / "a", lr=1e-3)  # a run from before eval/loss_se
    b = with_blocks(make_run_dir(tmp_path / "b", lr=1e-3), [1.0, 2.0], [4, 4], [9, 9])
    result = compare(a, b, "--plot", tmp_path / "p.png")
    assert "no standard error: a logged no eval/loss_se" in result.stdout
