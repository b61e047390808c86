"""Muon's orthogonalisation: a quintic Newton-Schulz iteration approximating U V^T for an update U S V^T,
run on every matrix of one shape at once (one batched matmul chain per shape, not one per matrix).

The coefficients and eps are torch.optim.Muon's (Keller Jordan's quintic); the iteration dtype is chosen by
`ns_dtype` (optim.muon_ns_dtype): bfloat16 where matmuls are fast in it (CUDA), float32 on CPUs (bf16
matmul is slow on CPUs without AMX), and float64 parameters keep float64 so the equality tests stay exact.
"""

from __future__ import annotations

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

QUINTIC = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def iteration_dtype(ns_dtype: str, param_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """optim.muon_ns_dtype resolved: auto = the parameters' dtype when float64, bfloat16 on CUDA, else float32."""
    if ns_dtype != "auto":
        return getattr(torch, ns_dtype)
    if param_dtype == torch.float64:
        return torch.float64
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The iteration on a batch (n, rows, cols) of wide matrices (rows <= cols: the Gram matrix is the
    smaller one), each normalised to spectral norm <= 1 first."""
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)
    a, b, c = QUINTIC
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def orthogonalise_all(mats: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each (n, rows, cols) stack orthogonalised matrix by matrix, in `dtype`, returned in its own dtype.
    Matrices of one shape (a tall one counts as its transpose) go through one batched iteration."""
    by_shape: dict[tuple, list[tuple[int, bool]]] = {}
    for i, m in enumerate(mats):
        wide = m.size(-2) <= m.size(-1)
        shape = tuple(m.shape[-2:]) if wide else tuple(m.shape[-2:])[::-1]
        by_shape.setdefault(shape, []).append((i, wide))
    out: list = [None] * len(mats)
    for members in by_shape.values():
        x = torch.cat([(mats[i] if wide else mats[i].mT).to(dtype) for i, wide in members])
        x = newton_schulz(x, steps)
        for (i, wide), y in zip(members, x.split([mats[i].size(0) for i, _ in members]), strict=True):
            out[i] = (y if wide else y.mT).to(mats[i].dtype)
    return out


def batches(shapes: list[tuple[int, int]]) -> int:
    """How many batched iterations matrices of these (rows, cols) shapes take."""
    return len({(min(s), max(s)) for s in shapes})
