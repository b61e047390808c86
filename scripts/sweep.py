"""Sweep one config field (the lr by default) over values, widths and depths: each (width, depth, value) a run of
the recipe, as parallel processes on this machine or as a SLURM array job; then each run's final held-out loss
(read by the run-comparison code) as a table, the best value per model shape, and a loss-vs-value plot with a
line per shape.

    python scripts/sweep.py configs/default.yaml --values 1e-3,2e-3,4e-3,8e-3,1.6e-2 --widths 64,128,256 \\
        --out runs/sweep-adamw-mup --parallel 2 -- --model.mup.base_width=64 --train.max_steps=150

Everything after `--` goes to every run. A width sets the model's hidden size, its MLP (8/3 x, rounded to 64)
and heads of 32 (`model/mup.py: width_overrides`); a depth (`--depths 2,4,8`) its num_hidden_layers (without
`--depths`, the config's own). Resumable: a run whose final/ exists is not redone, so
the same command after an interruption finishes the rest and then reports. `--slurm` writes
`<out>/sweep.sbatch` (one array task per run, each `srun` of the same command line) and submits it with
`sbatch`; run the command again without `--slurm` once the jobs are done to get the report."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from lmpretrain.analysis.runs import load_run, summarize
from lmpretrain.model.mup import width_overrides

ROOT = Path(__file__).resolve().parents[1]


Shape = tuple[int, int | None]  # (width, depth); depth None: the config's own number of layers


def label(shape: Shape) -> str:
    """The shape's key in sweep.json and its run directories' prefix: "64", or "64-d2" with a depth."""
    width, depth = shape
    return f"{width}" if depth is None else f"{width}-d{depth}"


def describe(shape: Shape) -> str:
    width, depth = shape
    return f"width {width:5d}" if depth is None else f"width {width:5d}, depth {depth:2d}"


def run_dir(out: Path, shape: Shape, field: str, value: str) -> Path:
    return out / f"w{label(shape)}-{field.rsplit('.', 1)[-1]}{value}"


def command(
    config: str, shape: Shape, field: str, value: str, out: Path, extra: list[str], launch: str
) -> list[str]:
    width, depth = shape
    model = [f"--model.overrides.{k}={v}" for k, v in width_overrides(width).items()]
    if depth is not None:
        model.append(f"--model.overrides.num_hidden_layers={depth}")
    return [
        sys.executable, "-m", "lmpretrain.launch", "--config_file", launch, str(ROOT / "recipes" / "pretrain.py"),
        config, *model, f"--{field}={value}", f"--run.output_dir={run_dir(out, shape, field, value)}",
        "--run.threads=1", "--logging.wandb_mode=disabled", "--eval.tasks=[]", "--eval.sample_tokens=0",
        "--checkpoint.every=0", *extra,
    ]  # fmt: skip


def pending(runs: list[tuple[Shape, str]], out: Path, field: str) -> list[tuple[Shape, str]]:
    return [(s, v) for s, v in runs if not (run_dir(out, s, field, v) / "final").exists()]


def run_local(jobs: list[list[str]], logs: list[Path], parallel: int) -> list[Path]:
    """Each command as its own process, `parallel` at a time; returns the logs of those that failed."""
    failed: list[Path] = []
    running: list[tuple[subprocess.Popen, Path]] = []
    queue = list(zip(jobs, logs, strict=True))
    while queue or running:
        while queue and len(running) < parallel:
            cmd, log = queue.pop(0)
            log.parent.mkdir(parents=True, exist_ok=True)
            print(f"[sweep] start {log.parent.name}", flush=True)
            running.append((subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT), log))
        time.sleep(1)
        for proc, log in [r for r in running if r[0].poll() is not None]:
            running.remove((proc, log))
            if proc.returncode:
                failed.append(log)
    return failed


def submit_slurm(jobs: list[list[str]], logs: list[Path], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(
        f"  {i}) {shlex.join(cmd)} > {shlex.quote(str(log))} 2>&1 ;;"
        for i, (cmd, log) in enumerate(zip(jobs, logs, strict=True))
    )
    script = out / "sweep.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --array=0-{len(jobs) - 1}\n#SBATCH --job-name=sweep\n#SBATCH --output={out}/slurm-%A_%a.out\n"
        f'mkdir -p {shlex.quote(str(out))}\ncase "$SLURM_ARRAY_TASK_ID" in\n{lines}\nesac\n'
    )
    for log in logs:
        log.parent.mkdir(parents=True, exist_ok=True)
    print(subprocess.run(["sbatch", str(script)], check=True, capture_output=True, text=True).stdout.strip())


def report(out: Path, runs: list[tuple[Shape, str]], field: str) -> dict:
    """{shape: {value: final eval loss}} of the finished runs, printed with each shape's best value."""
    table: dict[Shape, dict[str, float]] = {}
    for shape, value in runs:
        path = run_dir(out, shape, field, value)
        if (path / "final").exists():
            table.setdefault(shape, {})[value] = summarize(load_run(path))["final_eval_loss"]
    for shape, losses in table.items():
        best = min(losses, key=losses.get)
        cells = "  ".join(f"{v}: {loss:.4f}" for v, loss in losses.items())
        print(f"{describe(shape)}: {cells}  | best {field}={best} ({losses[best]:.4f})")
    (out / "sweep.json").write_text(json.dumps({label(s): t for s, t in table.items()}, indent=1))
    return table


def plot(table: dict, field: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for shape, losses in table.items():
        xs = sorted(losses, key=float)
        ax.plot(
            [float(x) for x in xs],
            [losses[x] for x in xs],
            marker="o",
            label=" ".join(describe(shape).split()),
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel(field)
    ax.set_ylabel("final held-out loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    else:
        extra = []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--field", default="optim.lr")
    parser.add_argument("--values", required=True, help="comma-separated")
    parser.add_argument("--widths", default="64,128,256")
    parser.add_argument("--depths", help="comma-separated num_hidden_layers (default: the config's own)")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--parallel", type=int, default=os.cpu_count() or 1, help="runs at once (one thread each)"
    )
    parser.add_argument("--launch", default=str(ROOT / "configs" / "accelerate" / "cpu.yaml"))
    parser.add_argument("--slurm", action="store_true", help="submit the missing runs as one SLURM array job")
    args = parser.parse_args(argv)
    out = Path(args.out)
    values = args.values.split(",")
    if any(not math.isfinite(float(v)) for v in values):
        parser.error(f"--values={args.values}: every value must be a number")
    depths = sorted(int(d) for d in args.depths.split(",")) if args.depths else [None]
    if any(d is not None and d < 1 for d in depths):
        parser.error(f"--depths={args.depths}: every depth must be a number of layers >= 1")
    shapes = list(itertools.product(sorted(int(w) for w in args.widths.split(",")), depths))
    runs = list(itertools.product(shapes, values))
    todo = pending(runs, out, args.field)
    jobs = [command(args.config, s, args.field, v, out, extra, args.launch) for s, v in todo]
    logs = [run_dir(out, s, args.field, v) / "sweep.log" for s, v in todo]
    print(
        f"[sweep] {len(runs)} runs, {len(runs) - len(todo)} already finished, {len(todo)} to run", flush=True
    )
    if args.slurm:
        if todo:
            submit_slurm(jobs, logs, out)
        return 0
    failed = run_local(jobs, logs, args.parallel)
    table = report(out, runs, args.field)
    if table:
        plot(table, args.field, out / "sweep.png")
    for log in failed:
        print(f"[sweep] failed: {log.parent.name} (its log: {log})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
