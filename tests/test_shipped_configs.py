"""Every YAML in configs/ loads, validates and builds its model on the meta device."""

from pathlib import Path

import pytest
import torch
import yaml

from lmpretrain.config import config_problems, load_config
from lmpretrain.model.build import build_model, build_model_config, parameter_counts
from lmpretrain.observe.flops import flops_per_token

ROOT = Path(__file__).resolve().parents[1]
TRAINING = sorted((ROOT / "configs").glob("*.yaml"))
LAUNCH = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
EXPECTED_PARAMS = {  # order of magnitude each recipe promises in its name/comment
    "smoke": (1e5, 1e6),
    "default": (1e6, 1e7),
    "wsd-masked": (1e6, 1e7),
    "gpt2-124m": (1.2e8, 1.3e8),
    "llama-1b": (1.0e9, 1.4e9),
    "llama-8b": (7.9e9, 8.1e9),  # Llama-3.1-8B: 8.03B
    "moe": (5e6, 1e7),
    "qwen3-30b-a3b": (
        3.0e10,
        3.1e10,
    ),  # Qwen3-30B-A3B: 30.5B, 3.35B active  # the default's width as 8 experts of 256, top-2: 6.7M, 3.2M active
}


def test_the_four_recipes_are_shipped():
    assert {p.stem for p in TRAINING} >= set(EXPECTED_PARAMS)


@pytest.mark.parametrize("path", TRAINING, ids=lambda p: p.stem)
def test_config_loads_validates_and_builds_on_meta(path):
    cfg = load_config([str(path)])
    assert config_problems(cfg, world_size=1) == []
    if any(source.hub for source in cfg.data.train):  # GPU recipes: their comments launch 8 ranks
        assert config_problems(cfg, world_size=8) == []
    model_config = build_model_config(cfg.model)
    assert cfg.data.seq_len <= model_config.max_position_embeddings
    with torch.device("meta"):
        model = build_model(model_config)
    n = parameter_counts(model)["params_total"]
    low, high = EXPECTED_PARAMS.get(path.stem, (1, float("inf")))
    assert low <= n <= high, f"{path.stem}: {n:,} parameters"
    # The run's FLOPs per token count the experts a token is routed to (k of E), not every expert.
    flops, source = flops_per_token(model_config, cfg.data.seq_len)
    non_embedding = parameter_counts(model)["params_non_embedding"]
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    if experts:
        top_k, count = model_config.num_experts_per_tok, model_config.num_experts
        active = non_embedding - experts * (1 - top_k / count)
        assert 6 * active < flops < 6 * non_embedding, source
    else:
        assert flops > 6 * non_embedding, source


@pytest.mark.parametrize("path", LAUNCH, ids=lambda p: p.stem)
def test_launch_configs_are_parsed_by_accelerate(path):
    from accelerate.commands.config.config_args import load_config_from_file

    launch = load_config_from_file(str(path))
    raw = yaml.safe_load(path.read_text())
    assert launch.num_processes == raw["num_processes"]
    assert launch.distributed_type.value == raw["distributed_type"]
