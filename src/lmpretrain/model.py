"""Build any transformers causal LM from a model type + overrides, or from a pretrained checkpoint."""

from __future__ import annotations

import difflib

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from lmpretrain.config import ConfigError


def build_model_config(model_cfg) -> PretrainedConfig:
    """AutoConfig for `model.type` (or `model.pretrained`) with `model.overrides` applied and checked.

    AutoConfig accepts any keyword silently; an override that is not a field of the model's config
    would be ignored, so it is an error naming the nearest field instead.
    """
    if model_cfg.pretrained:
        config = AutoConfig.from_pretrained(model_cfg.pretrained)
    else:
        try:
            config = AutoConfig.for_model(model_cfg.type)
        except ValueError as err:
            raise ConfigError([f"model.type={model_cfg.type!r} is not a transformers model type: {err}"]) from None
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    unknown = []
    for key in model_cfg.overrides:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            unknown.append(f"model.overrides.{key}" + (f" (did you mean '{near[0]}'?)" if near else ""))
    if unknown:
        raise ConfigError([f"unknown field(s) for a {config.model_type} config: {', '.join(unknown)}"])
    for key, value in model_cfg.overrides.items():
        setattr(config, key, value)
    config.use_cache = False  # training never reuses a KV cache; generation asks for one explicitly
    return config


def build_model(config: PretrainedConfig, pretrained: str | None = None, dtype: str = "float32") -> nn.Module:
    """Weights from `pretrained`, else a fresh init from the (seeded) global RNG.

    Parameters stay in `dtype` (fp32 master weights); autocast lowers only the compute.
    """
    dtype = getattr(torch, dtype)
    if pretrained:
        return AutoModelForCausalLM.from_pretrained(pretrained, config=config, dtype=dtype)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def parameter_counts(model: nn.Module) -> dict:
    """Total / trainable / embedding parameters (tied weights counted once)."""
    params = {id(p): p for p in model.parameters()}
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total = sum(p.numel() for p in params.values())
    return {
        "params_total": total,
        "params_trainable": sum(p.numel() for p in params.values() if p.requires_grad),
        "params_embedding": sum(params[i].numel() for i in embedding if i in params),
        "params_non_embedding": total - sum(params[i].numel() for i in embedding if i in params),
    }
