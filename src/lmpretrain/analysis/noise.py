"""How much of a difference between two runs the held-out set's sampling alone could make.

Each run's final `eval/loss` and `eval/bpb` are means over the held-out blocks; the evaluator records the
blocks' own losses (`eval_blocks.jsonl`, observe/evaluation.py). Two runs scored on the same blocks are
compared block by block (paired: the blocks' differences, so what is hard for both cancels); otherwise by
their logged standard errors (unpaired: sqrt(se_a^2 + se_b^2)). A difference under 2 standard errors is
within noise. The errors cover the held-out sampling only: a second seed can move a run by more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from lmpretrain.observe.evaluation import ratio_and_se
from lmpretrain.observe.tracking import EVAL_BLOCKS, read_jsonl

NOISE_SE = 2.0  # a difference under this many standard errors is within noise


@dataclass
class Difference:
    key: str  # eval/loss or eval/bpb
    value: float  # b - a
    se: float | None  # None: not known (a run logged no standard error)
    how: str  # paired over the same blocks, or unpaired, in words

    @property
    def within_noise(self) -> bool | None:
        if self.se is None or math.isnan(self.se):
            return None
        return abs(self.value) < NOISE_SE * self.se


def final_blocks(run_dir: Path, step: int | None) -> dict | None:
    """The per-block losses of the evaluation at `step` (the last row written for it), or None."""
    path = Path(run_dir) / EVAL_BLOCKS
    if step is None or not path.exists():
        return None
    rows = [r for r in read_jsonl(path) if r.get("step") == step]
    return rows[-1] if rows else None


def _final(run, key: str) -> tuple[int | None, float | None, float | None]:
    """(step, value, logged standard error) of the run's last evaluation of `key`."""
    rows = [r for r in run.rows if r.get(key) is not None]
    if not rows:
        return None, None, None
    return rows[-1]["step"], float(rows[-1][key]), rows[-1].get(f"{key}_se")


def difference(a, b, key: str) -> Difference | None:
    """b - a of the final `key` (eval/loss or eval/bpb) with its standard error; None when a run lacks it."""
    step_a, value_a, se_a = _final(a, key)
    step_b, value_b, se_b = _final(b, key)
    if value_a is None or value_b is None:
        return None
    blocks_a, blocks_b = final_blocks(a.path, step_a), final_blocks(b.path, step_b)
    denominator = "targets" if key == "eval/loss" else "bytes"
    same = (
        blocks_a is not None
        and blocks_b is not None
        and blocks_a.get(denominator)
        and blocks_a[denominator] == blocks_b.get(denominator)
        and blocks_a["targets"] == blocks_b["targets"]
    )
    if same:
        diffs = [lb - la for la, lb in zip(blocks_a["loss"], blocks_b["loss"], strict=True)]
        _, se = ratio_and_se(diffs, blocks_a[denominator])
        scale = 1.0 if key == "eval/loss" else math.log(2)
        tokens = sum(blocks_a["targets"])
        how = f"paired over the same {len(diffs)} blocks, {tokens:,} tokens"
        return Difference(key, value_b - value_a, se / scale, how)
    if se_a is None or se_b is None:
        missing = a.name if se_a is None else b.name
        return Difference(key, value_b - value_a, None, f"no standard error: {missing} logged no {key}_se")
    return Difference(
        key, value_b - value_a, math.hypot(se_a, se_b), "unpaired: not the same held-out blocks"
    )


def noise_lines(runs) -> list[str]:
    """Each run's final eval/loss and eval/bpb against the first run's, with standard errors and verdicts."""
    lines = []
    for b in runs[1:]:
        for key in ("eval/loss", "eval/bpb"):
            d = difference(runs[0], b, key)
            if d is None:
                continue
            if d.se is None:
                verdict = f"{d.value:+.4f} ({d.how})"
            else:
                sigmas = abs(d.value) / d.se if d.se > 0 else math.inf
                word = "within noise" if d.within_noise else "beyond noise"
                verdict = f"{d.value:+.4f} ± {d.se:.4f} ({d.how}): {word}, {sigmas:.1f} standard errors"
            lines.append(f"  {b.name} - {runs[0].name}  {key}  {verdict}")
    if not lines:
        return []
    head = (
        f"held-out noise of the final evaluation (a difference under {NOISE_SE:g} standard errors is within "
        "noise; sampling of the held-out set only, not seed-to-seed variation):"
    )
    return [head, *lines]
