"""The planner (python -m lmpretrain.plan) against a real 2-rank (HSDP: 4-rank) run of the recipe.

A run launched with `--logging.bytes_at_step=N` (recipe_runner.EXACT has it) logs what its step N sent and
held on rank 0 (observe/step_bytes.py, the planner's own byte counter around the recipe's real step). The
plan of the run's resolved config (its config.yaml) under the same launch config must say the same:
parameter, gradient and optimizer-state bytes exactly, each collective kind's bytes within 2%. (This check
found that CPU FSDP2 runs reduce-scattered every micro-batch's gradients, twice the plan's bytes at
accumulation 2: accelerate's FSDP type was reset after prepare, run/runtime.py. Fixed.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lmpretrain.config import load_config
from lmpretrain.model.build import build_model_config
from lmpretrain.observe.collectives import KINDS
from lmpretrain.plan.launch import read_launch
from lmpretrain.plan.simulate import simulate

ACCELERATE = Path(__file__).resolve().parents[1] / "configs" / "accelerate"
# The recipe's own collectives of a step that the plan leaves out (observe/step_bytes.py): the target
# count's all-reduce, the logged numbers' all-gather, under DDP a 76-byte broadcast (not traced): at 2
# ranks tens of bytes.
LOOP_BYTES = 1024


def logged(run) -> dict:
    """The metrics row of the step the run counted."""
    rows = [r for r in run.metrics() if "memory/params_bytes" in r]
    assert len(rows) == 1, "a run with logging.bytes_at_step logs its figures once"
    return rows[0]


def plan_of(run, launch: str, world: int = 2):
    cfg = load_config([str(run.out / "config.yaml")])
    layout = read_launch(str(ACCELERATE / f"{launch}.yaml"), world, 1)
    layout = dataclasses.replace(layout, experts=cfg.model.ep_size)  # as the planner sets it
    return simulate(cfg, build_model_config(cfg.model), layout, cfg.train.micro_batch_size)


# The plan's peak (its micro-batches' or its optimizer step's, whichever is higher) against the real step's
# peak of live tensor bytes on rank 0 (memory/peak_bytes: torch's MemTracker on the real tensors).
PEAK_TOLERANCE = 0.10


def compare(
    run, launch: str, world: int = 2, peak: bool = True
) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """(planned, real) per figure, and the figures off: the bytes held not exactly equal, a collective kind
    not within 2% (kinds under LOOP_BYTES on both sides are the loop's bookkeeping and not compared), the
    peak not within PEAK_TOLERANCE (`peak=False`: not compared)."""
    real, plan = logged(run), plan_of(run, launch, world)
    figures = {k: (getattr(plan, k), real[f"memory/{k}_bytes"]) for k in ("params", "grads", "optimizer")}
    figures |= {k: (plan.comm[k], real[f"comm/{k}_bytes"]) for k in (*KINDS, "muon")}
    if peak:
        figures["peak"] = (plan.total_peak, real["memory/peak_bytes"])
    off = []
    for kind, (planned, measured) in figures.items():
        if kind == "peak":
            if abs(planned - measured) > PEAK_TOLERANCE * measured:
                off.append(kind)
        elif kind in ("params", "grads", "optimizer"):
            if planned != measured:
                off.append(kind)
        elif (measured > LOOP_BYTES or planned > LOOP_BYTES) and abs(planned - measured) > 0.02 * measured:
            off.append(kind)
    return figures, off
