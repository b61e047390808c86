"""FLOPs per token against hand counts and the real models' weights; peak FLOP/s; MFU."""

import math
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lmpretrain.config import load_config
from lmpretrain.gpus import table
from lmpretrain.layout import Layout
from lmpretrain.observe.flops import (
    counted_flops_per_token,
    flops_per_token,
    gpu_peak,
    gpu_table_key,
    matmul_params_per_token,
    measure_peak_flops,
    mfu,
    parameter_flops_per_token,
    peak_flops,
    table_dtype,
    table_peak,
    train_flops_per_token,
)
from lmpretrain.plan.hardware import load_gpu
from lmpretrain.plan.planner import make_plan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

GPT2_124M = GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)
# Llama 3.2 1B shape: GQA with 32 query heads and 8 key/value heads of 64 dims, tied embeddings.
LLAMA_1B = LlamaConfig(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=128256,
    tie_word_embeddings=True,
)


def test_gpt2_124m_hand_count():
    d, layers, seq = 768, 12, 1024
    # per layer: c_attn 768 x 2304 = 1,769,472; attn c_proj 768 x 768 = 589,824;
    #            c_fc 768 x 3072 = 2,359,296;  mlp c_proj 3072 x 768 = 2,359,296  -> 7,077,888
    per_layer = 1_769_472 + 589_824 + 2_359_296 + 2_359_296
    assert per_layer == 7_077_888
    lm_head = 768 * 50257  # 38,597,376 (tied with wte, but still a matmul per token)
    params = 12 * per_layer + lm_head  # 84,934,656 + 38,597,376
    assert params == 123_532_032
    attention = 2 * 2 * layers * seq * d  # QK^T and AV over 1024 keys: 37,748,736
    forward = 2 * params + attention  # 247,064,064 + 37,748,736 = 284,812,800
    assert forward == 284_812_800
    assert train_flops_per_token(GPT2_124M, seq) == 3 * forward == 854_438_400
    assert matmul_params_per_token(GPT2_124M) == (params, layers, d)
    # PaLM's closed form 6N + 12 L H Q T says the same
    assert train_flops_per_token(GPT2_124M, seq) == 6 * params + 12 * layers * 12 * 64 * seq


def test_llama_gqa_hand_count():
    seq = 2048
    # per layer: q 2048 x 2048 = 4,194,304; k and v 2048 x 512 = 1,048,576 each; o 4,194,304
    attn = 4_194_304 + 2 * 1_048_576 + 4_194_304  # 10,485,760
    mlp = 3 * 2048 * 8192  # gate, up, down: 50,331,648
    per_layer = attn + mlp
    assert per_layer == 60_817_408
    params = 16 * per_layer + 2048 * 128256  # 973,078,528 + 262,668,288
    assert params == 1_235_746_816
    attention = 2 * 2 * 16 * seq * (32 * 64)  # query heads x head_dim = 2048: 268,435,456
    assert train_flops_per_token(LLAMA_1B, seq) == 3 * (2 * params + attention) == 8_219_787_264


@pytest.mark.parametrize("config", [GPT2_124M, LLAMA_1B], ids=["gpt2", "llama"])
def test_matmul_params_equal_the_real_models_matmul_weights(config):
    with torch.device("meta"):
        model = GPT2LMHeadModel(config) if config.model_type == "gpt2" else LlamaForCausalLM(config)
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    # every >= 2-D weight except embedding tables is a matmul per token; the LM head always is one
    weights = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings)
    head = model.lm_head.weight.numel()
    tied = id(model.lm_head.weight) in embeddings
    assert matmul_params_per_token(config)[0] == weights + (head if tied else 0)


def test_causal_counting_and_dict_configs_and_unsupported_types():
    full = train_flops_per_token(GPT2_124M, 1024)
    causal = train_flops_per_token(GPT2_124M, 1024, causal=True)
    assert full - causal == pytest.approx(3 * 2 * 2 * 12 * (1024 - 1025 / 2) * 768)
    as_dict = {"model_type": "llama", **LLAMA_1B.to_dict()}
    assert train_flops_per_token(as_dict, 2048) == train_flops_per_token(LLAMA_1B, 2048)
    no_head_dim = {**as_dict, "head_dim": None}  # falls back to hidden_size // heads = 64
    assert train_flops_per_token(no_head_dim, 2048) == train_flops_per_token(LLAMA_1B, 2048)
    with pytest.raises(ValueError, match="supported are 'gpt2'"):
        train_flops_per_token({"model_type": "mixtral", "hidden_size": 8}, 16)
    with pytest.raises(ValueError, match="lacks"):
        train_flops_per_token({"model_type": "gpt2", "n_embd": 8}, 16)


# torch.cuda.get_device_name() of each GPU of the one table (lmpretrain/gpus.yaml), and two it lacks
DEVICE_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 96GB HBM2e": "h100-96gb",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H200": "h200",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA B200": "b200",
    "NVIDIA A100-SXM4-80GB": "a100",
    "NVIDIA A100 80GB PCIe": "a100",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A10G": "a10g",
    "NVIDIA A10": "a10",
    "NVIDIA L4": "l4",
    "NVIDIA L40S": "l40s",
    "NVIDIA L40": "l40",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "Tesla V100-SXM2-16GB": "v100-sxm",
    "Tesla V100-PCIE-32GB": "v100-pcie",
    "Tesla T4": "t4",
    "NVIDIA GeForce RTX 3060": None,
    "AMD Instinct MI300X": None,
}


def test_gpu_table_lookup():
    for name, key in DEVICE_NAMES.items():
        assert gpu_table_key(name) == key, name
    assert set(DEVICE_NAMES.values()) - {None} == set(table())  # every entry is reached by a device name
    assert (
        table_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    )  # dense, not the 1979 sparse figure
    assert table_peak("NVIDIA H100 80GB HBM3", "no") == 67e12
    assert table_peak("NVIDIA H100 80GB HBM3", "no", allow_tf32=True) == 494.7e12
    assert table_peak("NVIDIA A100-SXM4-40GB", "bf16") == 312e12
    assert table_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores -> measured
    assert table_peak("NVIDIA B200", "bf16") == 2250e12


def test_the_recipe_and_the_planner_read_one_peak_for_every_gpu_and_an_fp8_run_gets_the_fp8_peak():
    """The recipe's MFU peak (by device name) and the planner's (by --gpu key) are one number for every GPU
    and matmul dtype; a train.fp8 run is measured against the fp8 peak of the kernels it runs, in the recipe's
    MFU and in the plan's."""
    compared = 0
    for name, key in DEVICE_NAMES.items():
        if key is None:
            continue
        gpu = load_gpu(key)
        for precision in ("no", "bf16", "fp16"):
            for fp8 in (False, True):
                planned = gpu.peak_flops(table_dtype(precision, fp8=fp8))
                assert table_peak(name, precision, fp8=fp8) == planned, (name, precision, fp8)
                compared += planned is not None
    assert compared > 40
    assert gpu_peak("NVIDIA H100 80GB HBM3", torch.bfloat16, fp8=True) == (1978.9e12, "table:h100:fp8")
    assert gpu_peak("NVIDIA B200", torch.bfloat16) == (2250e12, "table:b200:bf16")
    assert gpu_peak("NVIDIA B200", torch.bfloat16, fp8=True) == (4500e12, "table:b200:fp8")
    assert gpu_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16, fp8=True) is None  # no fp8: measured instead
    fp8 = ["--train.precision=bf16", "--train.compile=true", "--train.fp8=tensorwise"]
    plan = make_plan(load_config([str(CONFIGS / "smoke.yaml"), *fp8]), Layout(), load_gpu("h100"))
    assert plan.peak_dtype == "fp8"
    assert plan.mfu == pytest.approx(
        plan.tokens_per_s_per_gpu * plan.model_flops_per_token / 1978.9e12, rel=1e-12
    )


def test_cpu_peak_is_measured_once_positive_and_finite():
    t0 = time.perf_counter()
    peak, source = peak_flops("cpu", torch.float32)
    first = time.perf_counter() - t0
    assert source == "measured:cpu:float32"
    assert math.isfinite(peak) and 1e8 < peak < 1e14
    assert first < 5
    t0 = time.perf_counter()
    assert peak_flops("cpu", "no") == (peak, source)  # cached for the run
    assert time.perf_counter() - t0 < 0.01
    assert measure_peak_flops.cache_info().hits >= 1
    bf16, src = peak_flops("cpu", "bf16")
    assert src == "measured:cpu:bfloat16" and math.isfinite(bf16) and bf16 > 0
    with pytest.raises(ValueError, match="unsupported dtype"):
        peak_flops("cpu", torch.int8)


def test_mfu():
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert mfu(8000.0, 1e9, 1e13, num_devices=8) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)


# --------------------------------------------------------------------------------------------
# Fallbacks for model types without a formula
# --------------------------------------------------------------------------------------------

SMALL_LLAMA = LlamaConfig(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    tie_word_embeddings=True,
)
SMALL_GPT2 = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=512)


@pytest.mark.parametrize("config", [SMALL_LLAMA, SMALL_GPT2], ids=["llama", "gpt2"])
def test_flop_counter_and_6n_agree_with_the_formula(config):
    """torch's FLOP counter (forward + backward on the meta device) and 6N + attention count what the
    hand formula counts, to the FLOP (GPT-2's tied head and Llama's GQA included)."""
    formula = train_flops_per_token(config, 96)
    assert counted_flops_per_token(config, 96) == pytest.approx(formula, rel=1e-3)  # + rotary's tiny matmul
    assert parameter_flops_per_token(config, 96) == formula
    assert flops_per_token(config, 96) == (formula, "architecture formula")


def test_mixture_of_experts_counts_the_routed_experts_only():
    config = AutoConfig.for_model(
        "mixtral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=512,
    )
    # per layer: q, o 64x64; k, v 64x32; router 64x8; 2 of 8 experts, each gate+up 64x256 and down 128x64
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 64 * 8 + 2 * (64 * 256 + 128 * 64)
    params = 2 * per_layer + 64 * 512  # + the untied LM head
    expected = 3 * (2 * params + 2 * 2 * 2 * 96 * 64)
    assert parameter_flops_per_token(config, 96) == expected
    with pytest.raises(ValueError, match="mixture of experts"):
        counted_flops_per_token(config, 96)
    assert flops_per_token(config, 96) == (expected, "6N + attention from the parameters")


def test_counter_for_types_without_a_formula_and_never_an_exception():
    neox = AutoConfig.for_model(
        "gpt_neox", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    value, source = flops_per_token(neox, 64)
    assert source == "torch FLOP counter on the meta device"
    assert value == pytest.approx(parameter_flops_per_token(neox, 64), rel=1e-3)
    value, source = flops_per_token({"model_type": "not-a-model"}, 64)  # nothing can count it
    assert value is None
    assert source.startswith("could not count training FLOPs per token, so perf/mfu is not logged (")
    assert "architecture formula: ValueError" in source and len(source) < 1000
