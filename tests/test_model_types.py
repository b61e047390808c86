"""Any transformers causal LM: tiny configs of twelve model types the pinned transformers ships (a
mixture of experts, a state-space model and an RNN among them) each train 3 steps with the recipe,
export, reload with the Auto classes and generate. FLOPs per token come from the formula, torch's
FLOP counter or 6N + attention, as logged; a model nothing can count (rwkv) trains without perf/mfu."""

import math

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import recipe_runner as rr
from lmpretrain.config import ModelConfig, load_config
from lmpretrain.model.build import build_model, build_model_config
from lmpretrain.preflight import model_problems

pytestmark = pytest.mark.slow  # end-to-end: launches the recipe in subprocesses

TINY = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 64}
LLAMA_LIKE = {**TINY, "intermediate_size": 64, "num_key_value_heads": 2}
MODEL_TYPES = {
    "llama": LLAMA_LIKE,
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64},
    "qwen2": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "gemma": {**LLAMA_LIKE, "head_dim": 8},
    "olmo2": LLAMA_LIKE,
    "phi3": LLAMA_LIKE,
    "gpt_neox": {**TINY, "intermediate_size": 64},
    "starcoder2": LLAMA_LIKE,
    "mixtral": {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2},
    # Not transformers: a state-space model and an RNN
    "mamba": {"num_hidden_layers": 2, "hidden_size": 32, "state_size": 8},
    "rwkv": {"num_hidden_layers": 2, "hidden_size": 32, "attention_hidden_size": 32, "intermediate_size": 64},
}
# Where FLOPs per token come from: the hand formula where there is one, else torch's FLOP counter on
# the meta device, which cannot count a mixture of experts' grouped matmuls (6N + attention then).
FLOPS_SOURCE = {
    **dict.fromkeys(["llama", "gpt2", "qwen2", "mistral", "gemma", "olmo2"], "architecture formula"),
    **dict.fromkeys(["phi3", "gpt_neox", "starcoder2", "mamba"], "torch FLOP counter on the meta device"),
    "mixtral": "6N + attention from the parameters",
    "rwkv": None,  # nothing counts them (autograd refuses the counter's meta backward; no attention heads)
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stdlib_cache):
    """One process trains every type in turn (3 steps, micro-batch 4, 32-token blocks, eval at the end)."""
    tmp = tmp_path_factory.mktemp("types")
    smoke = yaml.safe_load(rr.SMOKE.read_text())
    arg_lists = []
    for model_type, overrides in MODEL_TYPES.items():
        config = {
            **smoke,
            "model": {"type": model_type, "overrides": {**overrides, "vocab_size": 8192}},
            "train": {**smoke["train"], "max_steps": 3, "grad_accum_steps": 1},
            "optim": {**smoke["optim"], "warmup_steps": 1},
            "data": {**smoke["data"], "seq_len": 32},
            "eval": {**smoke["eval"], "every": 0, "batches": 1, "batch_size": 4, "sample_tokens": 0},
            "checkpoint": {**smoke["checkpoint"], "every": 0},
            "logging": {**smoke["logging"], "wandb_mode": "disabled"},
        }
        path = tmp / f"{model_type}.yaml"
        path.write_text(yaml.safe_dump(config))
        arg_lists.append([str(path), f"--run.output_dir={tmp / model_type}"])
    outputs = rr.run_each(arg_lists)
    return {t: (tmp / t, out) for t, out in zip(MODEL_TYPES, outputs, strict=True)}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_trains_exports_and_generates(runs, model_type):
    out, log = runs[model_type]
    rows = [r for r in rr.read_metrics(out) if "train/loss" in r]
    losses = [r["train/loss"] for r in rows]
    assert len(losses) == 3 and losses[0] == pytest.approx(math.log(8192), abs=0.3), losses
    assert losses[2] < losses[0], losses  # it learns
    if FLOPS_SOURCE[model_type]:
        assert "training FLOPs per token: " in log and f"({FLOPS_SOURCE[model_type]})" in log
        assert all(r["perf/mfu"] > 0 for r in rows)
    else:  # a metric never stops a run
        assert "WARNING: could not count training FLOPs per token, so perf/mfu is not logged (" in log
        assert not any("perf/mfu" in r for r in rows)
    # the default kernel, sdpa, is eager where a model has no sdpa path (no attention at all here)
    kernel = "eager (MambaForCausalLM has no sdpa path)" if model_type == "mamba" else "sdpa"
    kernel = "eager (RwkvForCausalLM has no sdpa path)" if model_type == "rwkv" else kernel
    assert f"[lmpretrain] attention: {kernel}\n" in log

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert model.config.model_type == model_type
    # special tokens are the tokenizer's, in the model config and the generation config alike
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == ids
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == ids
    prompt = tokenizer("def main():", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert generated.shape[1] == prompt.input_ids.shape[1] + 6
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_a_model_built_from_a_config_takes_the_tokenizers_special_tokens(small_tokenizer, tmp_path):
    """phi3's defaults (eos = pad = 32000) are another tokenizer's ids, outside this 320-token vocabulary."""
    ours = (small_tokenizer.bos_token_id, small_tokenizer.eos_token_id, small_tokenizer.pad_token_id)
    shape = {"vocab_size": 320, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}

    def ids(config):
        return config.bos_token_id, config.eos_token_id, config.pad_token_id

    assert ids(build_model_config(ModelConfig(type="phi3", overrides=shape))) == (1, 32000, 32000)
    config = build_model_config(ModelConfig(type="phi3", overrides=shape), small_tokenizer)
    assert ids(config) == ours == (0, 1, 2)
    model = build_model(config)
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == ours
    assert model.get_input_embeddings().padding_idx == 2
    overridden = build_model_config(
        ModelConfig(type="phi3", overrides={**shape, "eos_token_id": 3}), small_tokenizer
    )
    assert ids(overridden) == (0, 3, 2)  # model.overrides still wins
    model.config.bos_token_id = 7  # a pretrained model keeps its own ids
    model.save_pretrained(tmp_path / "pretrained")
    assert (
        build_model_config(ModelConfig(pretrained=str(tmp_path / "pretrained")), small_tokenizer).bos_token_id
        == 7
    )


def test_router_logits_without_the_load_balancing_term_are_refused_not_dropped(small_tokenizer):
    cfg = load_config([str(rr.SMOKE), "--model.type=mixtral", "--train.moe_balance=none"])
    cfg.model.overrides = {"output_router_logits": True, "vocab_size": 8192}
    problems = model_problems(cfg, build_model_config(cfg.model, small_tokenizer), small_tokenizer)
    assert problems == [
        "model.overrides.output_router_logits=true asks for the router's load-balancing loss, which "
        "train.moe_balance=none leaves out; set train.moe_balance=aux_loss (the recipe then asks for the router "
        "logits itself) or drop the override"
    ]
    cfg.train.moe_balance = "aux_loss"  # the default: the term is trained (tests/test_routing.py)
    assert model_problems(cfg, build_model_config(cfg.model, small_tokenizer), small_tokenizer) == []
