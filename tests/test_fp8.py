"""train.fp8 on CPU: which layers of llama-1b (built on the meta device) would be float8, and the one
message that refuses fp8 where it cannot run (no CUDA here) or without compile."""

from pathlib import Path

import torch

from lmpretrain.config import config_problems, load_config
from lmpretrain.model.build import build_model, build_model_config
from lmpretrain.model.fp8 import converted_modules, large_enough
from lmpretrain.model.speed import kernel_problems

LLAMA_1B = str(Path(__file__).resolve().parents[1] / "configs" / "llama-1b.yaml")
BLOCK = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def llama_1b_on_meta():
    with torch.device("meta"):
        return build_model(build_model_config(load_config([LLAMA_1B]).model))


def test_tensorwise_converts_every_projection_of_every_block_and_never_the_head():
    model = llama_1b_on_meta()
    names = converted_modules(model, "tensorwise")
    # hidden 2048, 8 KV heads of 64: q/o 2048x2048, k/v 2048->512, gate/up 2048->8192, down 8192->2048
    assert names == [
        f"model.layers.{i}.{kind}.{p}"
        for i in range(16)
        for kind, p in [("self_attn", p) for p in BLOCK[:4]] + [("mlp", p) for p in BLOCK[4:]]
    ]
    assert "lm_head" not in names and model.lm_head.out_features == 49152  # large, but the head: never


def test_rowwise_converts_only_the_down_projections():
    """Rowwise's casts cost more: of llama-1b's shapes only 8192 -> 2048 is large enough."""
    assert converted_modules(llama_1b_on_meta(), "rowwise") == [
        f"model.layers.{i}.mlp.down_proj" for i in range(16)
    ]


def test_the_size_rule():
    assert not large_enough("tensorwise", 1024, 4096) and large_enough("tensorwise", 1040, 256)
    assert large_enough("tensorwise", 256, 4112) and not large_enough("tensorwise", 2040, 2048)  # 2040 % 16
    assert not large_enough("rowwise", 2048, 8192) and large_enough("rowwise", 4112, 2048)
    assert not large_enough("rowwise", 8192, 1024) and large_enough("rowwise", 4096, 2064)


def test_fp8_is_refused_without_cuda_and_without_compile():
    cfg = load_config([LLAMA_1B, "--train.fp8=tensorwise"])
    problems = kernel_problems(cfg, build_model_config(cfg.model))
    if torch.cuda.is_available():  # the probe the check asks: on a GPU the device decides
        assert len(problems) <= 1 and all("compute capability >= 8.9" in p for p in problems)
    else:
        assert problems == [
            "train.fp8=tensorwise needs a CUDA GPU of compute capability >= 8.9 (H100/H200, L4, RTX 4090) and "
            "torchao; there is no CUDA device here. Use train.fp8=none (bf16)"
        ]
    cfg = load_config([LLAMA_1B, "--train.fp8=rowwise", "--train.compile=false"])
    assert any("train.fp8=rowwise needs train.compile=true" in p for p in config_problems(cfg, 8))
    assert not any("fp8" in p for p in config_problems(load_config([LLAMA_1B, "--train.fp8=rowwise"]), 8))
