"""Compare finished runs locally: summary table, config diff, loss plots, curve closeness.

A run directory holds ``metrics.jsonl`` (written by :class:`lmpretrain.observe.tracking.Tracker`),
``config.yaml`` (the resolved config, nested sections) and, unless W&B was disabled, ``wandb/``.
``scripts/compare_runs.py`` is the command-line front end.
"""

from __future__ import annotations

import itertools
import math
import statistics
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmpretrain.analysis.wandb_offline import read_offline_history
from lmpretrain.observe.tracking import read_jsonl

LOSS_KEY = "train/loss"
EVAL_KEY = "eval/loss"
BPB_KEY = "eval/bpb"  # bits per byte: comparable across tokenizers, unlike the loss per token
TOKENS_KEY = "train/tokens_seen"
WRAP = 60  # characters of a table cell or config value per line; longer ones wrap onto more lines


@dataclass
class Run:
    name: str
    path: Path
    rows: list[dict]  # one dict per step, "step" + metric keys, ascending steps
    config: dict = field(default_factory=dict)  # flattened: {"optim.lr": 3e-4, ...}


def flatten(tree: Any, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    if not isinstance(tree, dict):
        return {prefix: tree} if prefix else {}
    out: dict = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _merge_same_steps(rows: list[dict]) -> list[dict]:
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(int(row["step"]), {}).update(row)
    return [merged[s] for s in sorted(merged)]


def load_run(run_dir: str | Path, source: str = "metrics") -> Run:
    """A run from ``metrics.jsonl`` (``source="metrics"``) or its offline W&B files (``"wandb"``);
    the config from ``config.yaml`` when present, else from W&B."""
    run_dir = Path(run_dir)
    wandb_run = None
    if source == "metrics":
        path = run_dir / "metrics.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found (use --wandb to read the offline W&B files instead)")
        rows = read_jsonl(path)
    elif source == "wandb":
        wandb_run = read_offline_history(run_dir)
        rows = [
            {"step": r["_step"], **{k: v for k, v in r.items() if not k.startswith("_") or k == "_timestamp"}}
            for r in wandb_run["history"]
            if "_step" in r
        ]
    else:
        raise ValueError(f"source must be 'metrics' or 'wandb', got {source!r}")
    config_path = run_dir / "config.yaml"
    if config_path.exists():
        import yaml

        config = yaml.safe_load(config_path.read_text(encoding="utf-8")) or {}
    else:
        if wandb_run is None:
            try:
                wandb_run = read_offline_history(run_dir)
            except FileNotFoundError:
                wandb_run = {"config": {}}
        config = wandb_run["config"]
    return Run(name=run_dir.name, path=run_dir, rows=_merge_same_steps(rows), config=flatten(config))


def load_runs(run_dirs: list[str | Path], source: str = "metrics") -> list[Run]:
    """:func:`load_run` for each directory; runs with the same folder name are named by their path."""
    runs = [load_run(d, source) for d in run_dirs]
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = str(run.path)
    return runs


def _series(run: Run, key: str) -> list[tuple[int, float]]:
    return [(r["step"], float(r[key])) for r in run.rows if r.get(key) is not None]


def _numeric_series(run: Run, key: str) -> list[tuple[int, float]]:
    """The (step, value) points of a metric whose values are numbers (booleans count as 0/1)."""
    return [
        (r["step"], float(r[key]))
        for r in run.rows
        if isinstance(r.get(key), (int, float)) and r[key] is not None
    ]


def summarize(run: Run, keys: tuple[str, ...] = ()) -> dict:
    """Steps, final train loss, final/best eval loss, final eval bpb (and their standard errors, the held-out
    set's targets), median tokens/s, wall time of a run, and the last logged value of each of `keys` (any
    metric: a fork's `train/<term>`, `eval/...`)."""
    train, evals, bpb = _series(run, LOSS_KEY), _series(run, EVAL_KEY), _series(run, BPB_KEY)
    ema = _series(run, "eval/ema/loss")  # train.ema_decay: the average's held-out loss
    tps = [v for _, v in _series(run, "perf/tokens_per_s")]
    return {
        "run": run.name,
        "steps": run.rows[-1]["step"] if run.rows else 0,
        "final_train_loss": train[-1][1] if train else None,
        "final_eval_loss": evals[-1][1] if evals else None,
        "best_eval_loss": min(v for _, v in evals) if evals else None,
        "final_eval_bpb": bpb[-1][1] if bpb else None,
        "heldout_tokens": _last(run, "eval/tokens"),
        "final_eval_loss_se": _last(run, "eval/loss_se"),
        "final_eval_bpb_se": _last(run, "eval/bpb_se"),
        "final_ema_loss": ema[-1][1] if ema else None,
        "best_ema_loss": min(v for _, v in ema) if ema else None,
        "tokens_per_s_median": statistics.median(tps) if tps else None,
        "wall_time_s": wall_time(run),
        **{key: _last(run, key) for key in keys},
    }


def wall_time(run: Run) -> float | None:
    """Seconds from the start of the first logged step to the end of the last one, over every stop and
    resume (metrics.jsonl keeps the rows up to the resumed step): the rows' timestamps are taken at the end
    of each step, so the first step's own time is added."""
    stamps = [(r["_timestamp"], r) for r in run.rows if "_timestamp" in r]
    if len(stamps) < 2:
        return None
    first, last = min(stamps, key=lambda x: x[0]), max(stamps, key=lambda x: x[0])
    return last[0] - first[0] + float(first[1].get("perf/step_time_s") or 0.0)


def _last(run: Run, key: str):
    """The last logged value of a metric (any type), None when never logged."""
    values = [r[key] for r in run.rows if r.get(key) is not None]
    return values[-1] if values else None


def _digits(values: list, kind: str) -> int:
    """Digits (decimals for kind "f", significant ones for "g") that tell the distinct numbers of a column
    apart: at least 4, at most 12."""
    numbers = [v for v in values if isinstance(v, float)]
    for digits in range(4, 13):
        if len({f"{v:.{digits}{kind}}" for v in numbers}) == len(set(numbers)):
            return digits
    return 12


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    return fmt.format(value) if isinstance(value, float) else str(value)


def format_table(summaries: list[dict], keys: tuple[str, ...] = ()) -> str:
    """A fixed-width text table of :func:`summarize` results (`keys`: the extra metrics asked for). Numbers
    get the digits that tell the runs apart (at least 4 significant); long values wrap onto more lines."""
    fixed = {"tokens_per_s_median": "{:.0f}", "wall_time_s": "{:.1f}", "run": "{}", "steps": "{}"}
    fixed.update(heldout_tokens="{:,}", final_eval_loss_se="{:.4f}", final_eval_bpb_se="{:.4f}")
    cols = [
        ("run", "run"),
        ("steps", "steps"),
        ("final_train_loss", "final train loss"),
        ("final_eval_loss", "final eval loss"),
        ("best_eval_loss", "best eval loss"),
        ("final_eval_loss_se", "eval loss se"),
        ("final_eval_bpb", "final eval bpb"),
        ("final_eval_bpb_se", "eval bpb se"),
        ("heldout_tokens", "held-out tokens"),
        ("final_ema_loss", "final ema loss"),
        ("best_ema_loss", "best ema loss"),
        ("tokens_per_s_median", "tokens/s (median)"),
        ("wall_time_s", "wall time (s)"),
        *((key, key) for key in keys),
    ]
    # shown when a run has them (the standard errors and held-out size: runs from 2026-12-04 on)
    optional = (
        "final_ema_loss",
        "best_ema_loss",
        "final_eval_loss_se",
        "final_eval_bpb_se",
        "heldout_tokens",
    )
    cols = [c for c in cols if c[0] not in optional or any(s.get(c[0]) is not None for s in summaries)]
    rows = [[[title] for _, title in cols]]
    formats = dict(fixed)
    for k, _ in cols:
        if k not in fixed:  # the losses in decimals, a fork's metrics in significant digits
            kind = "g" if k in keys else "f"
            formats[k] = f"{{:.{_digits([s[k] for s in summaries], kind)}{kind}}}"
    for s in summaries:
        row = []
        for k, _ in cols:
            text = _cell(s[k], formats[k])
            row.append(textwrap.wrap(text, WRAP) or [text])
        rows.append(row)
    widths = [max(len(line) for row in rows for line in row[i]) for i in range(len(cols))]
    lines = []
    for row in rows:
        for n in range(max(len(cell) for cell in row)):  # a wrapped cell takes more lines
            parts = [cell[n] if n < len(cell) else "" for cell in row]
            lines.append(
                "  ".join(
                    c.ljust(w) if i == 0 or len(row[i]) > 1 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(parts, widths, strict=True))
                ).rstrip()
            )
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


_MISSING = object()


def config_diff(runs: list[Run]) -> dict[str, list[Any]]:
    """Flattened config keys whose values differ between runs -> the value in each run."""
    keys = sorted(set().union(*(r.config for r in runs)))
    diff = {}
    for key in keys:
        values = [r.config.get(key, _MISSING) for r in runs]
        if any(v != values[0] for v in values[1:]):
            diff[key] = ["<missing>" if v is _MISSING else v for v in values]
    return diff


def format_config_diff(runs: list[Run], diff: dict[str, list[Any]]) -> str:
    if not diff:
        return "configs: identical"
    cells = [["key", *(r.name for r in runs)]] + [[k, *(repr(v) for v in vals)] for k, vals in diff.items()]
    wrapped = [[textwrap.wrap(c, WRAP) or [c] for c in row] for row in cells]  # long values: more lines
    widths = [max(len(line) for row in wrapped for line in row[i]) for i in range(len(cells[0]))]
    lines = []
    for row in wrapped:
        for n in range(max(len(cell) for cell in row)):
            parts = [cell[n] if n < len(cell) else "" for cell in row]
            lines.append("  ".join(c.ljust(w) for c, w in zip(parts, widths, strict=True)).rstrip())
    return "\n".join(lines)


def curve_distance(a: Run, b: Run, key: str = LOSS_KEY) -> tuple[float, int]:
    """Max |a - b| of ``key`` over the steps both runs logged, and how many steps that is.
    NaN in one run but not the other counts as an infinite difference."""
    xa, xb = dict(_series(a, key)), dict(_series(b, key))
    common = sorted(set(xa) & set(xb))
    worst = 0.0
    for s in common:
        va, vb = xa[s], xb[s]
        if math.isnan(va) and math.isnan(vb):
            continue
        d = abs(va - vb)
        worst = max(worst, math.inf if math.isnan(d) else d)
    return worst, len(common)


def check_close(runs: list[Run], tol: float, key: str = LOSS_KEY) -> list[str]:
    """Problems (empty when fine): any pair of runs whose ``key`` curves differ by more than ``tol``
    at a common step, or that share no step to compare."""
    problems = []
    for a, b in itertools.combinations(runs, 2):
        worst, n = curve_distance(a, b, key)
        if n == 0:
            problems.append(f"{a.name} vs {b.name}: no common steps with {key}")
        elif worst > tol:
            problems.append(
                f"{a.name} vs {b.name}: max |diff| of {key} = {worst:.3g} > {tol:g} over {n} steps"
            )
    return problems


def plot_runs(runs: list[Run], out: str | Path, keys: tuple[str, ...] = ()) -> Path:
    """PNG with train loss and eval loss vs tokens seen, then one panel per metric of `keys`, one line per
    run (three panels a row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [LOSS_KEY, EVAL_KEY, *(k for k in keys if k not in (LOSS_KEY, EVAL_KEY))]
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(6 * columns, 4.5 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    x_is_tokens = all(any(TOKENS_KEY in r for r in run.rows) for run in runs)
    for run in runs:
        tokens, last = {}, 0
        for r in run.rows:  # eval rows without tokens seen take the last value before them
            last = r.get(TOKENS_KEY, last)
            tokens[r["step"]] = last
        for ax, key in zip(axes, panels, strict=False):
            pts = _numeric_series(run, key)
            if pts:
                xs = [tokens[s] if x_is_tokens else s for s, _ in pts]
                ax.plot(
                    xs,
                    [v for _, v in pts],
                    marker="o" if key.startswith("eval/") or len(pts) < 30 else None,
                    markersize=3,
                    label=run.name,
                )
    for ax, key in zip(axes, panels, strict=False):
        ax.set_title({LOSS_KEY: "train loss", EVAL_KEY: "eval loss"}.get(key, key))
        ax.set_xlabel("tokens seen" if x_is_tokens else "step")
        ax.set_ylabel("loss" if key in (LOSS_KEY, EVAL_KEY) else key.rsplit("/", 1)[-1])
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
