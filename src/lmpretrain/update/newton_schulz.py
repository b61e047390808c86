"""Muon's orthogonalisation: a quintic Newton-Schulz iteration approximating U V^T for an update U S V^T,
run on every matrix of one shape at once (one batched matmul chain per shape, not one per matrix).

Two coefficient sets (optim.muon_coefficients):

* quintic: torch.optim.Muon's (Keller Jordan's) (a, b, c) at every step, after scaling to Frobenius norm 1;
* polar_express: a different (a, b, c) at each step, each the minimax-optimal odd quintic for the interval
  the singular values can still be in (Amsel, Persson, Musco and Gower 2025, "The Polar Express: Optimal
  Matrix Sign Methods and Their Application to the Muon Algorithm", arXiv:2505.16932). The five tuples are
  the paper's method computed for 5 steps with safety factor 2e-2 and cushion 2, as published in the
  modded-nanogpt speedrun and nanochat; they expect the input scaled by 1.02 x its Frobenius norm. Steps
  beyond the fifth repeat the last tuple (the iteration has converged to where it keeps singular values
  near 1).

The iteration dtype is chosen by `ns_dtype` (optim.muon_ns_dtype): bfloat16 where matmuls are fast in it
(CUDA), float32 on CPUs (bf16 matmul is slow on CPUs without AMX), and float64 parameters keep float64 so
the equality tests stay exact.
"""

from __future__ import annotations

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

QUINTIC = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# The input's Frobenius norm is scaled up by this much before Polar Express (its safety factor): rounding
# in bfloat16 must not push a singular value above the interval the coefficients were optimised for.
POLAR_EXPRESS_SAFETY = 1.02
COEFFICIENTS = ("quintic", "polar_express")


def coefficients(name: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` iterations for optim.muon_coefficients=`name`."""
    if name == "quintic":
        return [QUINTIC] * steps
    return [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]


def iteration_dtype(ns_dtype: str, param_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """optim.muon_ns_dtype resolved: auto = the parameters' dtype when float64, bfloat16 on CUDA, else float32."""
    if ns_dtype != "auto":
        return getattr(torch, ns_dtype)
    if param_dtype == torch.float64:
        return torch.float64
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(x: torch.Tensor, steps: int, name: str = "quintic") -> torch.Tensor:
    """The iteration on a batch (n, rows, cols) of wide matrices (rows <= cols: the Gram matrix is the
    smaller one), each normalised to spectral norm <= 1 first (by its Frobenius norm, an upper bound)."""
    norm = x.norm(dim=(-2, -1), keepdim=True)
    if name == "polar_express":
        norm = norm * POLAR_EXPRESS_SAFETY
    x = x / norm.clamp(min=EPS)
    for a, b, c in coefficients(name, steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def orthogonalise_all(
    mats: list[torch.Tensor], steps: int, dtype: torch.dtype, name: str = "quintic"
) -> list[torch.Tensor]:
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
        x = newton_schulz(x, steps, name)
        for (i, wide), y in zip(members, x.split([mats[i].size(0) for i, _ in members]), strict=True):
            out[i] = (y if wide else y.mT).to(mats[i].dtype)
    return out


def batches(shapes: list[tuple[int, int]]) -> int:
    """How many batched iterations matrices of these (rows, cols) shapes take."""
    return len({(min(s), max(s)) for s in shapes})
