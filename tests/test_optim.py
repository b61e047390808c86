"""Parameter groups and optimizer hyper-parameters (the schedule is tested in test_schedule.py)."""

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from lmpretrain.config import OptimConfig
from lmpretrain.update.optim import apply_hyperparameters, build_optimizer, param_groups


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


def test_apply_hyperparameters_overrides_a_loaded_optimizer_state():
    """A resumed run takes betas, eps and weight decay from its config, not from the checkpoint."""
    model = tiny("gpt2", n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    saved = build_optimizer(model, OptimConfig(weight_decay=0.1, beta2=0.95, eps=1e-8)).state_dict()
    opt = build_optimizer(model, OptimConfig())
    opt.load_state_dict(saved)
    apply_hyperparameters(opt, OptimConfig(weight_decay=0.01, beta1=0.8, beta2=0.99, eps=1e-6))
    assert [(g["name"], g["weight_decay"], g["betas"], g["eps"]) for g in opt.param_groups] == [
        ("decay", 0.01, (0.8, 0.99), 1e-6),
        ("no_decay", 0.0, (0.8, 0.99), 1e-6),
    ]
