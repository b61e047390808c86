"""The tiny float64 mixture of experts tests/test_expert_parallel.py and its gloo workers share: a 2-layer
Qwen3-MoE with 4 experts, 2 per token, routed as it comes (uneven: some experts get more tokens than
others) or skewed so that every token picks experts 0 and 1, which the first rank of each ep group holds:
the other ranks' experts then receive no token at all."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lmpretrain.config import OptimConfig

VOCAB = 64
QWEN3_MOE = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
ROUTINGS = ("natural", "skewed")


def build(routing: str = "natural", experts: str = "batched_mm") -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", vocab_size=VOCAB, **QWEN3_MOE)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation=experts)
    if routing == "skewed":
        with torch.no_grad():
            # Every token's residual stream carries a large positive first feature, which each router reads
            # as +1 for experts 0 and 1 and -1 for experts 2 and 3.
            model.model.embed_tokens.weight[:, 0] += 100
            for layer in model.model.layers:
                layer.mlp.gate.weight.zero_()
                layer.mlp.gate.weight[:2, 0], layer.mlp.gate.weight[2:, 0] = 1.0, -1.0
    return model


def batch(step: int, rows: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, 12), generator=torch.Generator().manual_seed(100 + step))


def muon_cfg(**kw) -> OptimConfig:
    return OptimConfig(**{"name": "muon", "lr": 0.01, "weight_decay": 0.1, "muon_momentum": 0.9, **kw})


# (routing, experts implementation, layout) of the gloo runs; at 4 ranks also HSDP (2 replica groups x 2)
CASES = (("natural", "batched_mm", "fsdp2"), ("skewed", "batched_mm", "fsdp2"), ("skewed", "eager", "fsdp2"))
HSDP_CASES = (("natural", "batched_mm", "hsdp"), ("skewed", "batched_mm", "hsdp"))


def cases(world: int) -> tuple:
    return CASES + (HSDP_CASES if world == 4 else ())
