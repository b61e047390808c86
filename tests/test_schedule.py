"""The lr schedules against closed forms, torch's schedulers and transformers' get_*_schedule functions."""

import dataclasses
import math

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from transformers import (
    get_constant_schedule_with_warmup,
    get_linear_schedule_with_warmup,
    get_wsd_schedule,
)

from lmpretrain.config import Config, OptimConfig, TrainConfig
from lmpretrain.update.schedule import hyperparameter_changes, learning_rate, set_lr, wsd_decay_start

PEAK, FLOOR, WARMUP, TOTAL = 1e-3, 1e-4, 10, 100


def config(max_steps=TOTAL, **optim) -> Config:
    optim = {"lr": PEAK, "min_lr": FLOOR, "warmup_steps": WARMUP, **optim}
    return Config(optim=OptimConfig(**optim), train=TrainConfig(max_steps=max_steps))


def lrs(cfg, steps=None):
    return [learning_rate(cfg, s) for s in range(steps or cfg.train.max_steps + 5)]


def torch_lrs(make_scheduler, steps, peak=PEAK):
    """The lr a torch / transformers scheduler gives each step (built on a throwaway optimizer)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def test_cosine_closed_form_points():
    f = lrs(config())
    assert f[0] == pytest.approx(PEAK / WARMUP)  # warmup start
    assert f[WARMUP - 1] == pytest.approx(PEAK)  # warmup end reaches the peak
    assert f[WARMUP] == pytest.approx(PEAK)  # the cosine starts at the peak
    assert f[WARMUP + (TOTAL - WARMUP) // 2] == pytest.approx(FLOOR + 0.5 * (PEAK - FLOOR))
    assert f[TOTAL] == f[TOTAL + 4] == pytest.approx(FLOOR)  # floor, and it stays there
    for s in range(WARMUP, TOTAL):
        t = (s - WARMUP) / (TOTAL - WARMUP)
        assert f[s] == pytest.approx(FLOOR + (PEAK - FLOOR) * (1 + math.cos(math.pi * t)) / 2, rel=1e-12)


def test_cosine_matches_torch_sequential_linear_cosine():
    ref = torch_lrs(
        lambda opt: SequentialLR(
            opt,
            [
                LinearLR(opt, start_factor=1 / WARMUP, total_iters=WARMUP - 1),
                CosineAnnealingLR(opt, T_max=TOTAL - WARMUP, eta_min=FLOOR),
            ],
            milestones=[WARMUP],
        ),
        TOTAL,
    )
    assert lrs(config(), TOTAL) == pytest.approx(ref, rel=1e-6)


def test_linear_and_constant_closed_forms_and_transformers_after_warmup():
    linear, constant = lrs(config(schedule="linear")), lrs(config(schedule="constant"))
    for s in range(WARMUP):
        assert linear[s] == constant[s] == pytest.approx(PEAK * (s + 1) / WARMUP)
    for s in range(WARMUP, TOTAL + 5):
        progress = min(1.0, (s - WARMUP) / (TOTAL - WARMUP))
        assert linear[s] == pytest.approx(PEAK - (PEAK - FLOOR) * progress, rel=1e-12)
        assert constant[s] == PEAK
    # transformers' warmup starts at 0 and peaks one step later; after it they agree (linear: min_lr 0)
    hf_linear = torch_lrs(lambda opt: get_linear_schedule_with_warmup(opt, WARMUP, TOTAL), TOTAL)
    hf_constant = torch_lrs(lambda opt: get_constant_schedule_with_warmup(opt, WARMUP), TOTAL)
    assert lrs(config(schedule="linear", min_lr=0.0), TOTAL)[WARMUP:] == pytest.approx(hf_linear[WARMUP:])
    assert constant[WARMUP:TOTAL] == pytest.approx(hf_constant[WARMUP:])


@pytest.mark.parametrize("max_steps,fraction", [(100, 0.2), (37, 0.25), (1000, 0.1), (20, 1.0)])
def test_wsd_closed_form_and_transformers_1_sqrt_decay(max_steps, fraction):
    cfg = config(max_steps, schedule="wsd", decay_fraction=fraction, warmup_steps=min(WARMUP, max_steps // 4))
    warmup = cfg.optim.warmup_steps
    decay_steps = max(1, round(fraction * max_steps))
    start = max(warmup, max_steps - decay_steps)
    assert wsd_decay_start(max_steps, warmup, fraction) == start
    f = lrs(cfg)
    assert f[warmup - 1] == pytest.approx(PEAK)
    assert all(lr == PEAK for lr in f[warmup:start])  # stable
    for s in range(start, max_steps):
        progress = (s - start) / (max_steps - start)
        assert f[s] == pytest.approx(FLOOR + (PEAK - FLOOR) * (1 - math.sqrt(progress)), rel=1e-12)
    assert f[max_steps] == f[-1] == pytest.approx(FLOOR)
    ref = torch_lrs(
        lambda opt: get_wsd_schedule(
            opt,
            num_warmup_steps=warmup,
            num_decay_steps=max_steps - start,
            num_stable_steps=start - warmup,
            decay_type="1-sqrt",
            min_lr_ratio=FLOOR / PEAK,
        ),
        max_steps + 5,
    )
    assert f[warmup:] == pytest.approx(ref[warmup:], rel=1e-12)  # they differ only inside the warmup


def test_annealing_from_a_stable_checkpoint_decays_from_that_step():
    """A wsd run of 1000 steps, resumed at step 400 (stable phase) with max_steps 500: the same lr up to
    the checkpoint, then the 100-step decay (decay_fraction 0.2 of 500) from exactly step 400."""
    run, anneal = config(1000, schedule="wsd"), config(500, schedule="wsd")
    assert lrs(run, 401)[WARMUP:] == lrs(anneal, 401)[WARMUP:] == [PEAK] * (401 - WARMUP)
    assert learning_rate(anneal, 400) == PEAK and learning_rate(run, 401) == PEAK
    assert learning_rate(anneal, 401) == pytest.approx(FLOOR + (PEAK - FLOOR) * (1 - math.sqrt(0.01)))
    assert learning_rate(anneal, 500) == pytest.approx(FLOOR)


def test_set_lr_sets_every_group():
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(3)], lr=1.0)
    assert set_lr(opt, 0.25) == 0.25 and [g["lr"] for g in opt.param_groups] == [0.25] * 3


def test_changed_hyperparameters_are_named_in_one_line():
    saved = config(20, schedule="wsd", lr=3e-3, min_lr=3e-4, warmup_steps=4).to_dict()
    same = config(20, schedule="wsd", lr=3e-3, min_lr=3e-4, warmup_steps=4)
    assert hyperparameter_changes(saved, same, step=10, updates=10) is None
    new = dataclasses.replace(same, optim=dataclasses.replace(same.optim, lr=3e-4, min_lr=3e-5))
    assert hyperparameter_changes(saved, new, step=10, updates=10) == (
        "resumed with new hyper-parameters from step 10: optim.lr 0.003 -> 0.0003, optim.min_lr 0.0003 -> "
        "3e-05 (lr 0.003 -> 0.0003; wsd decays over updates 16..20)"
    )
    longer = dataclasses.replace(
        same,
        train=dataclasses.replace(same.train, max_steps=30),
        optim=dataclasses.replace(same.optim, weight_decay=0.0),
    )
    line = hyperparameter_changes(saved, longer, step=20, updates=19)
    assert "optim.weight_decay 0.1 -> 0.0, train.max_steps 20 -> 30" in line
    assert f"(lr {learning_rate(same, 19):.3g} -> {learning_rate(longer, 19):.3g};" in line
