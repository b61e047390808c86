"""Schedule, parameter groups, clipping: against closed forms and torch's own implementations."""

import math

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from transformers import AutoConfig, AutoModelForCausalLM

from lmpretrain.config import OptimConfig
from lmpretrain.optim import build_optimizer, build_scheduler, lr_factor, param_groups

PEAK, FLOOR, WARMUP, TOTAL = 1e-3, 1e-4, 10, 100


def lrs_of(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_lr_factor_closed_form_points():
    f = lambda s: PEAK * lr_factor(s, warmup_steps=WARMUP, max_steps=TOTAL, min_ratio=FLOOR / PEAK)  # noqa: E731
    assert f(0) == pytest.approx(PEAK / WARMUP)  # warmup start
    assert f(WARMUP - 1) == pytest.approx(PEAK)  # warmup end reaches the peak
    assert f(WARMUP) == pytest.approx(PEAK)  # cosine starts at the peak
    mid = WARMUP + (TOTAL - WARMUP) // 2
    assert f(mid) == pytest.approx(FLOOR + 0.5 * (PEAK - FLOOR))  # halfway down the cosine
    assert f(TOTAL) == pytest.approx(FLOOR)  # floor
    assert f(TOTAL + 50) == pytest.approx(FLOOR)  # stays at the floor past the end
    for s in range(WARMUP, TOTAL):
        t = (s - WARMUP) / (TOTAL - WARMUP)
        assert f(s) == pytest.approx(FLOOR + (PEAK - FLOOR) * (1 + math.cos(math.pi * t)) / 2, rel=1e-12)


def test_lambda_schedule_matches_torch_sequential_linear_cosine():
    p = torch.nn.Parameter(torch.zeros(1))
    opt_a = torch.optim.AdamW([p], lr=PEAK)
    ours = build_scheduler(opt_a, OptimConfig(lr=PEAK, min_lr=FLOOR, warmup_steps=WARMUP), TOTAL)
    opt_b = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    ref = SequentialLR(
        opt_b,
        [
            LinearLR(opt_b, start_factor=1 / WARMUP, total_iters=WARMUP - 1),
            CosineAnnealingLR(opt_b, T_max=TOTAL - WARMUP, eta_min=FLOOR),
        ],
        milestones=[WARMUP],
    )
    a, b = lrs_of(ours, opt_a, TOTAL), lrs_of(ref, opt_b, TOTAL)
    assert a == pytest.approx(b, rel=1e-6)


def tiny(model_type, **kw):
    cfg = AutoConfig.for_model(model_type, **kw)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_groups_on_llama_never_decay_rmsnorm(decay_embeddings):
    model = tiny(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=False,
    )
    decay, no_decay = param_groups(model, 0.1, decay_embeddings)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert all("norm" in n for n in no_decay_names - {"model.embed_tokens.weight"})
    assert {n for n in names.values() if "norm" in n} <= no_decay_names  # RMSNorm weights never decay
    assert ("model.embed_tokens.weight" in decay_names) == decay_embeddings
    assert "lm_head.weight" in decay_names  # an untied output projection is a matrix like any other
    assert "model.layers.0.self_attn.q_proj.weight" in decay_names
    assert len(decay_names) + len(no_decay_names) == len(list(model.parameters()))


def test_groups_on_gpt2_biases_layernorm_embeddings():
    model = tiny("gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}  # tied lm_head listed once
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert {n for n in names.values() if n.endswith(".bias")} <= no_decay_names
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"} <= no_decay_names
    assert {names[id(p)] for p in decay["params"]} == {
        n for n in names.values() if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
    }
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(s == {} for s in opt.state.values())


def test_frozen_parameters_are_left_out():
    model = tiny("gpt2", n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    model.transformer.wpe.weight.requires_grad_(False)
    decay, no_decay = param_groups(model, 0.1)
    assert all(p is not model.transformer.wpe.weight for p in decay["params"] + no_decay["params"])
