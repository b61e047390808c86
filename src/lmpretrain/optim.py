"""AdamW with weight-decay groups by parameter shape, and the warmup + cosine schedule."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = False) -> list[dict]:
    """Matrices decay; biases and norm scales (dim < 2) never do; embeddings are a choice.

    Chosen by shape and module type, not by name strings, which silently miss e.g. Llama's RMSNorm.
    """
    embedding_params = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is not None
    }
    decay, no_decay = [], []
    for _, param in model.named_parameters():  # shared (tied) parameters are listed once
        if not param.requires_grad:
            continue
        is_embedding = id(param) in embedding_params
        if param.dim() >= 2 and (decay_embeddings or not is_embedding):
            decay.append(param)
        else:
            no_decay.append(param)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    grouped = [id(p) for p in decay + no_decay]
    assert len(grouped) == len(set(grouped)) and set(grouped) == trainable, (
        "every trainable parameter must be in exactly one optimizer group"
    )
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def describe_groups(groups: list[dict]) -> str:
    parts = []
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        parts.append(
            f"{g['name']}: {len(g['params'])} tensors, {n:,} params, weight_decay={g['weight_decay']}"
        )
    return "; ".join(parts)


def build_optimizer(model: nn.Module, optim_cfg) -> torch.optim.AdamW:
    """AdamW; its moments are fp32 because the parameters are fp32 (autocast only lowers compute)."""
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.decay_embeddings)
    return torch.optim.AdamW(
        groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps
    )


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then cosine to min_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, max_steps: int) -> LambdaLR:
    factor = partial(
        lr_factor,
        warmup_steps=optim_cfg.warmup_steps,
        max_steps=max_steps,
        min_ratio=optim_cfg.min_lr / optim_cfg.lr,
    )
    return LambdaLR(optimizer, factor)
