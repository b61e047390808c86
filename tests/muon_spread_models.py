"""The tiny float64 models, batches and Muon settings tests/test_muon_spread.py and its gloo workers share:
uneven shards (45 MLP rows on 2 and 4 ranks, 3 experts), an odd number of matrices (7 in a Llama layer),
GPT-2's fused QKV and Mixtral's 3-D expert stacks."""

import torch
from conftest import TINY_MIXTRAL
from transformers import AutoConfig, AutoModelForCausalLM

from lmpretrain.config import OptimConfig

VOCAB = 64
TINY = {
    "llama": {
        "hidden_size": 32,
        "intermediate_size": 45,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    "gpt2": {"n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 16, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "attn_pdrop": 0.0},
    "mixtral": TINY_MIXTRAL,
}  # fmt: skip
MODELS = tuple(TINY)


def build(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **TINY[model_type])
    config._attn_implementation = "eager"
    extra = {"experts_implementation": "eager"} if model_type == "mixtral" else {}  # float64
    return AutoModelForCausalLM.from_config(config, **extra).double()


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + step))


def muon_cfg(**kw) -> OptimConfig:
    return OptimConfig(**{"name": "muon", "lr": 0.01, "weight_decay": 0.1, "muon_momentum": 0.9, **kw})


# The optimizers the gloo runs compare with one process, and the (layout, optim.muon_spread, optimizer) runs
OPTIMIZERS = {
    "muon": {},
    "normuon": {"name": "normuon", "muon_coefficients": "polar_express", "normuon_beta2": 0.8},
}
CASES = (
    *((layout, spread, "muon") for layout in ("fsdp2", "ddp") for spread in ("always", "never")),
    ("fsdp2", "always", "normuon"),
    ("ddp", "always", "normuon"),
)
# At 4 ranks also HSDP, 2 replica groups x 2 shards: Muon spread over both (always) and not at all
# (never), NorMuon spread over both
HSDP_CASES = (("hsdp", "always", "muon"), ("hsdp", "never", "muon"), ("hsdp", "always", "normuon"))


def cases(world: int) -> tuple:
    return CASES + (HSDP_CASES if world == 4 else ())
