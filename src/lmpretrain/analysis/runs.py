"""Compare finished runs locally: summary table, config diff, loss plots, curve closeness.

A run directory holds ``metrics.jsonl`` (written by :class:`lmpretrain.observe.tracking.Tracker`),
``config.yaml`` (the resolved config, nested sections) and, unless W&B was disabled, ``wandb/``.
``scripts/compare_runs.py`` is the command-line front end.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmpretrain.analysis.wandb_offline import read_offline_history
from lmpretrain.observe.tracking import read_jsonl

LOSS_KEY = "train/loss"
EVAL_KEY = "eval/loss"
BPB_KEY = "eval/bpb"  # bits per byte: comparable across tokenizers, unlike the loss per token
TOKENS_KEY = "train/tokens_seen"


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
            {"step": r["_step"], **{k: v for k, v in r.items() if not k.startswith("_")}}
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


def summarize(run: Run, keys: tuple[str, ...] = ()) -> dict:
    """Steps, final train loss, final/best eval loss, final eval bpb, median tokens/s, wall time of a run,
    and the last logged value of each of `keys` (any metric: a fork's `train/<term>`, `eval/...`)."""
    train, evals, bpb = _series(run, LOSS_KEY), _series(run, EVAL_KEY), _series(run, BPB_KEY)
    ema = _series(run, "eval/ema/loss")  # train.ema_decay: the average's held-out loss
    tps = [v for _, v in _series(run, "perf/tokens_per_s")]
    stamps = [r["_timestamp"] for r in run.rows if "_timestamp" in r]
    return {
        "run": run.name,
        "steps": run.rows[-1]["step"] if run.rows else 0,
        "final_train_loss": train[-1][1] if train else None,
        "final_eval_loss": evals[-1][1] if evals else None,
        "best_eval_loss": min(v for _, v in evals) if evals else None,
        "final_eval_bpb": bpb[-1][1] if bpb else None,
        "final_ema_loss": ema[-1][1] if ema else None,
        "best_ema_loss": min(v for _, v in ema) if ema else None,
        "tokens_per_s_median": statistics.median(tps) if tps else None,
        # first to last logged step; includes any pause between a stop and its resume
        "wall_time_s": stamps[-1] - stamps[0] if len(stamps) > 1 else None,
        **{key: (_series(run, key) or [(None, None)])[-1][1] for key in keys},
    }


def format_table(summaries: list[dict], keys: tuple[str, ...] = ()) -> str:
    """A fixed-width text table of :func:`summarize` results (`keys`: the extra metrics asked for)."""
    cols = [
        ("run", "run", "{}"),
        ("steps", "steps", "{}"),
        ("final_train_loss", "final train loss", "{:.4f}"),
        ("final_eval_loss", "final eval loss", "{:.4f}"),
        ("best_eval_loss", "best eval loss", "{:.4f}"),
        ("final_eval_bpb", "final eval bpb", "{:.4f}"),
        ("final_ema_loss", "final ema loss", "{:.4f}"),
        ("best_ema_loss", "best ema loss", "{:.4f}"),
        ("tokens_per_s_median", "tokens/s (median)", "{:.0f}"),
        ("wall_time_s", "wall time (s)", "{:.1f}"),
        *((key, key, "{:.4g}") for key in keys),
    ]
    optional = ("final_ema_loss", "best_ema_loss")  # shown when a run has them
    cols = [c for c in cols if c[0] not in optional or any(s.get(c[0]) is not None for s in summaries)]
    cells = [[title for _, title, _ in cols]]
    for s in summaries:
        cells.append(["-" if s[k] is None else fmt.format(s[k]) for k, _, fmt in cols])
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    ]
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
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells)


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


def plot_runs(runs: list[Run], out: str | Path) -> Path:
    """PNG with train loss (left) and eval loss (right) vs tokens seen, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    x_is_tokens = all(any(TOKENS_KEY in r for r in run.rows) for run in runs)
    for run in runs:
        tokens, last = {}, 0
        for r in run.rows:  # eval rows without tokens seen take the last value before them
            last = r.get(TOKENS_KEY, last)
            tokens[r["step"]] = last
        for ax, key in zip(axes, (LOSS_KEY, EVAL_KEY), strict=True):
            pts = _series(run, key)
            if pts:
                xs = [tokens[s] if x_is_tokens else s for s, _ in pts]
                ax.plot(
                    xs,
                    [v for _, v in pts],
                    marker="o" if key == EVAL_KEY else None,
                    markersize=3,
                    label=run.name,
                )
    for ax, title in zip(axes, ("train loss", "eval loss"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("tokens seen" if x_is_tokens else "step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
