"""The update guard: which steps skip their update, that a skip changes nothing (weights, Adam moments)
while the fp16 scaler still backs off, the stop after too many skips in a row, and its saved state."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import one_layer_llama_config
from transformers import AutoModelForCausalLM

from lmpretrain.config import TrainConfig
from lmpretrain.errors import ConfigError, TrainingDiverged
from lmpretrain.model.precision import MixedPrecision
from lmpretrain.update.guard import NONFINITE, OVERFLOW, SPIKE, LossWindow, UpdateGuard

NAN, INF = float("nan"), float("inf")


def guard(**train) -> UpdateGuard:
    return UpdateGuard(TrainConfig(**train))


def test_why_a_step_is_skipped():
    g = guard(skip_spikes=True, spike_window=4, spike_sigma=2.0)
    assert g.check(3.0, 1.0) is None
    assert g.check(NAN, 1.0) == g.check(INF, 1.0) == NONFINITE
    assert g.check(3.0, NAN) == g.check(3.0, INF) == NONFINITE  # no loss scaling: divergence
    assert g.check(3.0, INF, scaler_backs_off=True) == OVERFLOW  # the fp16 scaler's to handle
    assert g.check(NAN, INF, scaler_backs_off=True) == NONFINITE
    for loss in (3.0, 3.1):  # half a window (2 losses) before any spike is judged
        assert g.check(50.0, 1.0) is None
        g.record(1, loss, 1.0, None)
    mean, std = 3.05, 0.05
    assert g.window.stats() == pytest.approx((mean, std))
    assert g.check(mean + 2.0 * std + 1e-9, 1.0) == SPIKE
    assert g.check(mean + 2.0 * std - 1e-9, 1.0) is None
    plain = guard()  # without train.skip_spikes the same loss goes through
    plain.window.load_state_dict([3.0, 3.1])
    assert plain.check(50.0, 1.0) is None


def test_too_many_skips_in_a_row_stop_with_a_clear_message():
    g = guard(max_skipped_steps=3)
    g.record(1, 3.0, 1.0, None)
    g.record(2, NAN, NAN, NONFINITE)
    g.record(3, 3.0, INF, OVERFLOW)  # neither counts nor resets
    g.record(4, 9.0, 1.0, SPIKE)
    g.record(5, 3.0, 1.0, None)  # an applied update resets the count
    g.record(6, NAN, NAN, NONFINITE)
    g.record(7, NAN, NAN, NONFINITE)
    assert g.consecutive == 2
    with pytest.raises(TrainingDiverged) as err:
        g.record(8, NAN, NAN, NONFINITE)
    assert err.value.exit_code == 2
    message = str(err.value)
    assert "the updates of steps 6-8 (3 in a row, train.max_skipped_steps=3) were all skipped" in message
    assert "Lower optim.lr" in message and "checkpoint written before step 6" in message


def test_state_round_trip_gives_the_same_decisions():
    losses = [5.0, 4.8, 4.7, 4.75, 4.6, 4.9, 4.5, 5.6, 4.4, 4.45, 6.0]
    straight = guard(skip_spikes=True, spike_window=4, spike_sigma=1.0)
    decisions = []
    for step, loss in enumerate(losses, start=1):
        decisions.append(straight.check(loss, 1.0))
        straight.record(step, loss, 1.0, decisions[-1])
        if step == 7:
            saved = straight.state_dict()
    assert SPIKE in decisions[7:] and decisions.count(SPIKE) >= 2, decisions
    resumed, fresh = (guard(skip_spikes=True, spike_window=4, spike_sigma=1.0) for _ in range(2))
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved and isinstance(saved["losses"][0], float)
    for who in (resumed, fresh):
        who.decisions = []
        for step, loss in enumerate(losses[7:], start=8):
            who.decisions.append(who.check(loss, 1.0))
            who.record(step, loss, 1.0, who.decisions[-1])
    assert resumed.decisions == decisions[7:]
    assert fresh.decisions != decisions[7:]  # the window is what makes it exact
    old = guard()
    old.load_state_dict(None)  # a checkpoint from before the guard
    assert old.state_dict() == {"consecutive": 0, "nonfinite": 0, "losses": []}


def test_loss_window_keeps_the_last_losses():
    w = LossWindow(3, min_count=2)
    assert w.stats() is None and not w.is_spike(100.0, 1.0)
    for x in (1.0, 2.0, 3.0, 4.0):
        w.push(x)
    assert w.state_dict() == [2.0, 3.0, 4.0]
    assert w.stats() == pytest.approx((3.0, math.sqrt(2 / 3)))
    assert w.is_spike(3.0 + 2 * math.sqrt(2 / 3) + 1e-6, 2.0)


def test_spike_skipping_is_refused_under_deepspeed():
    with pytest.raises(ConfigError, match="train.skip_spikes cannot run under DeepSpeed"):
        UpdateGuard(TrainConfig(skip_spikes=True), engine_steps=True)
    assert UpdateGuard(TrainConfig(), engine_steps=True).sigma is None  # the non-finite guard still runs


def _tiny_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(one_layer_llama_config(64, num_key_value_heads=1))


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    moments = [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return params, moments


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True))


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_a_skipped_update_changes_no_weight_or_moment_and_the_scaler_still_backs_off(precision):
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp = MixedPrecision(precision, torch.device("cpu"), init_scale=1024.0)
    g = guard(skip_spikes=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))

    def step(poison: float = 1.0, force_skip: bool = False):
        with mp.autocast():
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        mp.scale(loss * poison).backward()  # poison: inf/nan gradients with a finite loss
        mp.unscale_(opt)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
        skipped = g.check(loss.item(), norm, mp.backs_off_overflows) or (SPIKE if force_skip else None)
        stepped = mp.step(opt, skip=skipped is not None)
        opt.zero_grad(set_to_none=True)
        return skipped, stepped

    assert step() == (None, True)  # a real update creates the moments
    before, scale = _snapshot(model, opt), mp.loss_scale
    skipped, stepped = step(poison=INF)
    assert not stepped and skipped == (OVERFLOW if precision == "fp16" else NONFINITE)
    assert _same(before, _snapshot(model, opt))
    if precision == "fp16":
        assert mp.loss_scale == scale / 2  # the overflow still reached the scaler: it backed off
        tracker = mp.scaler._get_growth_tracker()
    skipped, stepped = step(force_skip=True)  # finite gradients, skipped (as a spike would be)
    assert (skipped, stepped) == (SPIKE, False) and _same(before, _snapshot(model, opt))
    if precision == "fp16":
        assert mp.loss_scale == scale / 2 and mp.scaler._get_growth_tracker() == tracker + 1
    assert step() == (None, True) and not _same(before, _snapshot(model, opt))


def test_which_loss_scalers_back_off_overflows():
    cpu = torch.device("cpu")
    assert not MixedPrecision("no", cpu).backs_off_overflows
    assert not MixedPrecision("bf16", cpu).backs_off_overflows
    assert MixedPrecision("fp16", cpu, engine=True).backs_off_overflows  # DeepSpeed's own scaler
    mp = MixedPrecision("fp16", cpu, init_scale=1.0)
    assert mp.backs_off_overflows
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    mp.scale(p.sum() * INF).backward()
    mp.unscale_(opt)
    assert not mp.step(opt) and mp.loss_scale == 0.5
    assert not mp.backs_off_overflows  # below 1, inf gradients are beyond fp16 at their true size


def test_a_run_ends_refused_only_while_its_skips_are_non_finite():
    """A skipped spike at the last step is the guard at work; a non-finite streak there is a stalled run."""
    spiky = guard(skip_spikes=True)
    spiky.record(1, 2.0, 1.0, None)
    spiky.record(2, 9.0, 1.0, SPIKE)
    assert spiky.consecutive == 1 and not spiky.stalled
    spiky.check_finished(2, 2.5)  # no error
    stalled = guard()
    stalled.record(1, 2.0, 1.0, None)
    stalled.record(2, float("nan"), float("nan"), NONFINITE)
    assert stalled.stalled
    with pytest.raises(TrainingDiverged, match="the run reached its last step 2 while skipping updates"):
        stalled.check_finished(2, 2.5)
    stalled.record(3, 2.0, 1.0, None)
    stalled.check_finished(3, 2.0)
    with pytest.raises(TrainingDiverged, match="the final evaluation at step 3 has loss nan"):
        stalled.check_finished(3, float("nan"))


def test_checkpoints_are_held_back_while_updates_are_skipped_and_at_an_end_that_stalled():
    """Periodic saves pause during any skip streak; the final save only while the streak is non-finite."""
    g = guard(skip_spikes=True)
    g.record(1, 2.0, 1.0, None)
    assert g.checkpoint_due(10, every=5, final=False) and not g.checkpoint_due(11, every=5, final=False)
    assert not g.checkpoint_due(10, every=0, final=False) and g.checkpoint_due(11, every=0, final=True)
    g.record(2, 9.0, 1.0, SPIKE)  # a skipped spike: no periodic save, but the run may end saved
    assert not g.checkpoint_due(10, every=5, final=False) and g.checkpoint_due(10, every=5, final=True)
    g.record(3, NAN, NAN, NONFINITE)  # non-finite: neither
    assert not g.checkpoint_due(10, every=5, final=True)
    g.record(4, 2.0, 1.0, None)
    assert g.checkpoint_due(10, every=5, final=False)
