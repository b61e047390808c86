"""AdamW with weight-decay groups by parameter shape, and the warmup + cosine schedule."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices


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


def build_optimizer(model: nn.Module, optim_cfg, device: torch.device | None = None) -> torch.optim.AdamW:
    """AdamW; its moments are fp32 because the parameters are fp32 (autocast only lowers compute).

    `optim.fused`: torch's fused kernel when `device` (where training runs; default: the parameters')
    supports it, else the foreach implementation. Same update rule, so checkpoints load across the two
    (`keep_implementation` stops a loaded checkpoint from switching it).
    """
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.decay_embeddings)
    device = device or next(model.parameters()).device
    fused = optim_cfg.fused and device.type in _get_fused_kernels_supported_devices()
    optimizer = torch.optim.AdamW(
        groups,
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
        fused=fused,
        foreach=not fused,
    )
    optimizer.register_load_state_dict_post_hook(partial(keep_implementation, fused=fused))
    return optimizer


def keep_implementation(optimizer: torch.optim.Optimizer, *, fused: bool) -> None:
    """Loading a state dict copies its groups' `fused`/`foreach` flags; keep the ones this run chose."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fused, not fused


def describe_implementation(optimizer: torch.optim.Optimizer, optim_cfg, device: torch.device) -> str:
    """Which AdamW kernel runs, and why when it is not the one asked for."""
    fused = optimizer.param_groups[0]["fused"]
    why = ""
    if optim_cfg.fused and not fused:
        why = f" (no fused AdamW kernel for {device.type})"
    elif not optim_cfg.fused:
        why = " (optim.fused=false)"
    return f"AdamW implementation: {'fused' if fused else 'foreach'}{why}"


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
