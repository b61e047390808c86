"""AdamW with weight-decay groups by parameter shape, or Muon for the block matrices with AdamW for the
rest (optim.name=muon, muon.py); the lr schedule is in schedule.py."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from lmpretrain.gpus import GPU
from lmpretrain.layout import Layout
from lmpretrain.model import mup
from lmpretrain.update.muon import (
    MuonAdamW,
    describe_muon,
    describe_muon_implementation,
    muon_groups,
    muon_hyperparameters,
)
from lmpretrain.update.muon_spread import spread_rates
from lmpretrain.update.normuon import SECOND_MOMENT


def param_groups(
    model: nn.Module, weight_decay: float, decay_embeddings: bool = False, exclude: frozenset = frozenset()
) -> list[dict]:
    """Matrices decay; biases and norm scales (dim < 2) never do; embeddings are a choice. Parameters
    whose id is in `exclude` (Muon's) are left out.

    Chosen by shape and module type, not by name strings, which silently miss e.g. Llama's RMSNorm.
    """
    embedding_params = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is not None
    }
    decay, no_decay = [], []
    for _, param in model.named_parameters():  # shared (tied) parameters are listed once
        if not param.requires_grad or id(param) in exclude:
            continue
        is_embedding = id(param) in embedding_params
        if param.dim() >= 2 and (decay_embeddings or not is_embedding):
            decay.append(param)
        else:
            no_decay.append(param)
    trainable = {id(p) for p in model.parameters() if p.requires_grad} - exclude
    grouped = [id(p) for p in decay + no_decay]
    assert len(grouped) == len(set(grouped)) and set(grouped) == trainable, (
        "every trainable parameter must be in exactly one optimizer group"
    )
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def describe_groups(optimizer: torch.optim.Optimizer) -> str:
    """What each group updates; with Muon, its matrices first, then AdamW's groups."""
    parts = []
    if isinstance(optimizer, MuonAdamW):
        parts.append(describe_muon(optimizer))
    for g in optimizer.param_groups:
        if g.get("kind") == "muon":
            continue
        n = sum(p.numel() for p in g["params"])
        parts.append(
            f"{'AdamW ' if isinstance(optimizer, MuonAdamW) else ''}{g['name']}: {len(g['params'])} tensors, {n:,} params, weight_decay={g['weight_decay']}"
        )
    return "; ".join(parts)


def build_optimizer(
    model: nn.Module,
    optim_cfg,
    device: torch.device | None = None,
    layout: Layout | None = None,
    gpu: GPU | None = None,
) -> torch.optim.Optimizer:
    """AdamW, or with optim.name=muon Muon for the block matrices and AdamW for the rest (muon.py); moments
    are fp32 because the parameters are fp32 (autocast only lowers compute).

    `optim.fused`: torch's fused kernel when `device` (where training runs; default: the parameters')
    supports it, else the foreach implementation. Same update rule, so checkpoints load across the two
    (`keep_implementation` stops a loaded checkpoint from switching it). Muon's optim.muon_spread=auto weighs
    the roofline of `gpu` (the planner's target; default: `device`'s) over the launch's `layout`.
    """
    muon = muon_groups(model, optim_cfg) if optim_cfg.name in ("muon", "normuon") else []
    matrices = frozenset(id(p) for g in muon for p in g["params"])
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.decay_embeddings, exclude=matrices)
    groups, muon = mup.optimizer_groups(
        model, groups, muon, optim_cfg.muon_lr_scale
    )  # model.mup's lr per group
    device = device or next(model.parameters()).device
    fused = optim_cfg.fused and device.type in _get_fused_kernels_supported_devices()
    adamw = dict(
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        eps=optim_cfg.eps,
        fused=fused,
        foreach=not fused,
    )
    if muon:
        groups = [{**g, "lr": optim_cfg.lr} for g in groups if g["params"]]
        optimizer = MuonAdamW(muon + groups, adamw, spread_rates(device, layout, gpu))
    else:
        optimizer = torch.optim.AdamW(groups, **adamw)
    optimizer.register_load_state_dict_post_hook(partial(keep_implementation, fused=fused))
    return optimizer


def keep_implementation(optimizer: torch.optim.Optimizer, *, fused: bool) -> None:
    """Loading a state dict copies its groups' `fused`/`foreach` flags; keep the ones this run chose."""
    for group in optimizer.param_groups:
        if group.get("kind") != "muon":
            group["fused"], group["foreach"] = fused, not fused


def describe_implementation(
    optimizer: torch.optim.Optimizer,
    optim_cfg,
    device: torch.device,
    world_size: int = 1,
    sharded: bool = False,
    replicas: int = 1,
) -> str:
    """Which AdamW kernel runs, and why when it is not the one asked for; with Muon, how its iteration runs
    (dtype, batches) and whether it is spread over the `world_size` ranks (`sharded`: FSDP2; `replicas`:
    HSDP's replica groups)."""
    fused = next(g["fused"] for g in optimizer.param_groups if g.get("kind") != "muon")
    why = ""
    if optim_cfg.fused and not fused:
        why = f" (no fused AdamW kernel for {device.type})"
    elif not optim_cfg.fused:
        why = " (optim.fused=false)"
    line = f"AdamW implementation: {'fused' if fused else 'foreach'}{why}"
    if isinstance(optimizer, MuonAdamW):
        line += "; " + describe_muon_implementation(optimizer, device, world_size, sharded, replicas)
    return line


def apply_hyperparameters(optimizer: torch.optim.Optimizer, optim_cfg) -> None:
    """Set betas, eps, the decay group's weight decay and Muon's settings from the config: a loaded optimizer
    state brings back the values it was saved with, and a resume must follow the current config."""
    for group in optimizer.param_groups:
        if group.get("kind") == "muon":
            group.update(muon_hyperparameters(optim_cfg))
            if not group["normuon"]:  # a NorMuon checkpoint resumed as Muon: its second moments go
                for p in group["params"]:
                    optimizer.state.get(p, {}).pop(SECOND_MOMENT, None)
            continue
        group["betas"] = (optim_cfg.beta1, optim_cfg.beta2)
        group["eps"] = optim_cfg.eps
        if group.get("name") == "decay":
            group["weight_decay"] = optim_cfg.weight_decay
