"""The learning-rate schedule: a pure function of the number of updates applied and the current config.

Nothing about the schedule is saved in checkpoints: a resumed run recomputes the lr from its step
counters and the config it was started with, so `optim.lr`, `optim.min_lr`, `optim.warmup_steps`,
`optim.schedule`, `optim.decay_fraction` and `train.max_steps` given at resume take effect at once
(extending a finished run, annealing a wsd run from a checkpoint of its stable phase).

Every schedule warms up linearly over `warmup_steps` (reaching the peak on the last warmup step), then:

* cosine:   half a cosine from the peak down to `min_lr` at `max_steps`;
* linear:   a straight line from the peak down to `min_lr` at `max_steps`;
* constant: the peak until the end;
* wsd:      warmup-stable-decay: the peak until the last `round(decay_fraction * max_steps)` steps, which
            decay to `min_lr` along 1 - sqrt(progress) -- the cooldown shape Hägele et al. (2024, "Scaling
            Laws and Compute-Optimal Training Beyond Fixed Training Durations") found better than
            linear or cosine. It is transformers' `get_wsd_schedule(decay_type="1-sqrt")` after warmup.
"""

from __future__ import annotations

import dataclasses
import math

SCHEDULES = ("cosine", "wsd", "linear", "constant")
# The optim fields a resume takes from the current config (the schedule's, and those optim.apply_hyperparameters
# sets over the checkpoint's optimizer state); each one that changed is reported.
_OPTIM_FIELDS = (
    "name",
    "lr",
    "min_lr",
    "warmup_steps",
    "schedule",
    "decay_fraction",
    "weight_decay",
    "beta1",
    "beta2",
    "eps",
    "muon_momentum",
    "muon_ns_steps",
    "muon_lr_scale",
    "muon_ns_dtype",
    "muon_spread",
    "muon_lr",
    "muon_coefficients",
    "normuon_beta2",
)


# What a resume that switches optim.name does to the optimizer state (adamw <-> muon is refused by the
# checkpoint load: the parameter groups differ).
_SWITCH_NOTES = {
    (
        "muon",
        "normuon",
    ): " (momentum kept; NorMuon's per-neuron second moments, absent from a Muon checkpoint, "
    "start at zero as in a fresh run)",
    ("normuon", "muon"): " (momentum kept; the checkpoint's NorMuon second moments are dropped)",
}


def wsd_decay_start(max_steps: int, warmup_steps: int, decay_fraction: float) -> int:
    """First step of a wsd schedule's decay: the last round(decay_fraction * max_steps) steps decay."""
    decay_steps = max(1, round(decay_fraction * max_steps))
    return max(warmup_steps, max_steps - decay_steps)


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    max_steps: int,
    min_ratio: float,
    schedule: str = "cosine",
    decay_fraction: float = 0.2,
) -> float:
    """Multiplier of the peak lr for update `step` (0-based); see the module docstring for the shapes."""
    if step < warmup_steps:  # a ramped step (in final-batch steps, fractional) can end past the warmup
        return min(1.0, (step + 1) / warmup_steps)
    if schedule == "constant":
        return 1.0
    start = warmup_steps
    if schedule == "wsd":
        start = wsd_decay_start(max_steps, warmup_steps, decay_fraction)
        if step < start:
            return 1.0
    progress = min(1.0, (step - start) / max(1, max_steps - start))
    if schedule == "cosine":
        return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    if schedule == "wsd":
        return min_ratio + (1.0 - min_ratio) * (1.0 - math.sqrt(progress))
    raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def learning_rate(cfg, updates: int, ramp=None) -> float:
    """The lr of the next update, after `updates` applied ones, under config `cfg` (optim.*, train.max_steps).

    With a batch ramp (data/batch_ramp.py) the schedule counts tokens, in steps of the final batch, and the
    lr is scaled by the ramp's factor for the batch of update `updates`."""
    o = cfg.optim
    step, max_steps, scale = updates, cfg.train.max_steps, 1.0
    if ramp is not None and ramp.stages:  # update n ends at schedule_steps(n + 1) final-batch steps
        step, max_steps = ramp.schedule_steps(updates + 1) - 1, ramp.schedule_steps(max_steps)
        scale = ramp.lr_scale(updates)
    factor = lr_factor(
        step,
        warmup_steps=o.warmup_steps,
        max_steps=max_steps,
        min_ratio=o.min_lr / o.lr,
        schedule=o.schedule,
        decay_fraction=o.decay_fraction,
    )
    return o.lr * scale * factor


def set_lr(optimizer, lr: float) -> float:
    """Give every parameter group `lr` (the schedule scales all groups alike), times the group's own
    multiplier where it has one (μP's hidden matrices: model/mup.py); returns `lr`."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
    return lr


def hyperparameter_changes(saved_cfg: dict, cfg, step: int, updates: int, ramp=None) -> str | None:
    """One line naming each optimizer hyper-parameter (and train.max_steps) that differs from the
    checkpoint's config, and the lr the run continues with at `step` (after `updates` applied updates);
    None when nothing changed."""
    saved_optim = {k: v for k, v in saved_cfg.get("optim", {}).items() if k in _OPTIM_FIELDS}
    old_max_steps = saved_cfg.get("train", {}).get("max_steps", cfg.train.max_steps)
    old = dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, **saved_optim),
        train=dataclasses.replace(cfg.train, max_steps=old_max_steps),
    )
    changed = [
        f"optim.{name} {getattr(old.optim, name)} -> {getattr(cfg.optim, name)}"
        + (_SWITCH_NOTES.get((old.optim.name, cfg.optim.name), "") if name == "name" else "")
        for name in _OPTIM_FIELDS
        if getattr(old.optim, name) != getattr(cfg.optim, name)
    ]
    if old_max_steps != cfg.train.max_steps:
        changed.append(f"train.max_steps {old_max_steps} -> {cfg.train.max_steps}")
    if not changed:
        return None
    was, now = learning_rate(old, updates, ramp), learning_rate(cfg, updates, ramp)
    line = (
        f"resumed with new hyper-parameters from step {step}: {', '.join(changed)} (lr {was:.3g} -> {now:.3g}"
    )
    if cfg.optim.schedule == "wsd":
        start = wsd_decay_start(cfg.train.max_steps, cfg.optim.warmup_steps, cfg.optim.decay_fraction)
        line += f"; wsd decays over updates {start}..{cfg.train.max_steps}"
    return line + ")"
