"""AdamW with weight-decay groups by parameter shape (the lr schedule is in schedule.py)."""

from __future__ import annotations

import torch
from torch import nn


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


def apply_hyperparameters(optimizer: torch.optim.Optimizer, optim_cfg) -> None:
    """Set betas, eps and the decay group's weight decay from the config: a loaded optimizer state
    brings back the values it was saved with, and a resume must follow the current config."""
    for group in optimizer.param_groups:
        group["betas"] = (optim_cfg.beta1, optim_cfg.beta2)
        group["eps"] = optim_cfg.eps
        if group.get("name") == "decay":
            group["weight_decay"] = optim_cfg.weight_decay
