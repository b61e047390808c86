"""NorMuon's per-neuron normalisation of Muon's orthogonalised update (optim.name=normuon).

NorMuon (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491; used in the
modded-nanogpt speedrun records and nanochat) keeps, per output neuron of each matrix, an exponential
moving average (optim.normuon_beta2) of the mean square of the orthogonalised update's entries for that
neuron, divides the neuron's entries by its square root, and rescales the matrix back to the Frobenius
norm it had before. Orthogonalisation equalises the singular values but leaves neurons' update sizes
uneven; this evens them out, as Adam does per entry, with one number per neuron of state.

A neuron is an output feature: a row of nn.Linear's (out, in) weight, a column of transformers' Conv1D
(in, out) and of transposed expert stacks. A fused projection (GPT-2's c_attn, an expert's gate and up) is
rescaled per projection, an expert stack per expert. The state (`second_moment`, (.., rows, 1) or (.., 1, cols)) is a DTensor laid
out like its parameter under FSDP2 (row shards; replicated for a Conv1D's per-column vector), so every
checkpoint format saves and reshards it like the momentum.

Under FSDP2 each rank holds some rows of each update: a per-row statistic is local, a per-column one and
the Frobenius norms are sums over the rows, so each needs a sum over the shard group — one all-reduce of
per-column sums, then one of per-projection norms (sizes from shapes only, as the other collectives).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lmpretrain.update.muon_spread import _shard_dim, holds_whole_experts, shard_rows

EPS = 1e-10  # a neuron whose update is all zero keeps a zero update
# The state entry of each NorMuon matrix. A Muon checkpoint has none: resumed as NorMuon, they start at
# zero, as in a fresh run; a NorMuon checkpoint resumed as Muon drops them.
SECOND_MOMENT = "second_moment"


def second_moment_like(p: torch.Tensor, out_dim: int) -> torch.Tensor:
    """A zero second-moment state for parameter `p`: one entry per output neuron, laid out like `p`."""
    shape = (*p.shape[:-1], 1) if out_dim == 0 else (*p.shape[:-2], 1, p.shape[-1])
    if not isinstance(p, DTensor):
        return p.new_zeros(shape)
    assert _shard_dim(p) is not None or holds_whole_experts(p), (
        f"NorMuon needs a parameter sharded on dim 0, not {p.placements}"
    )
    local = p.to_local()
    if out_dim == 0 or p.dim() == 3:  # rows (or whole experts) sharded as the parameter's
        local_shape = (*local.shape[:-1], 1) if out_dim == 0 else (*local.shape[:-2], 1, local.shape[-1])
        placements = p.placements
    else:  # one row of per-column values: every rank holds it
        local_shape, placements = shape, [Replicate()] * len(p.placements)
    return DTensor.from_local(
        local.new_zeros(local_shape),
        p.device_mesh,
        placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


class _View:
    """One update's local entries as (batch, rows, cols), and where its rows sit among the whole's."""

    def __init__(self, update: torch.Tensor, group: dict):
        self.out_dim, self.pieces, self.interleaved = (
            group["out_dim"],
            group["pieces"],
            group.get("interleaved"),
        )
        local = update.to_local() if isinstance(update, DTensor) else update
        self.local = local if local.dim() == 3 else local.unsqueeze(0)
        rows, cols = update.shape[-2:]
        self.total_rows, self.cols = rows, cols
        self.group, self.row_offset = None, 0
        if isinstance(update, DTensor) and update.dim() == 2:  # rows split over the shard group
            dim = _shard_dim(update)
            mesh = update.device_mesh
            self.group = mesh.get_group(dim)
            self.row_offset = sum(shard_rows(rows, mesh.size(dim))[: mesh.get_local_rank(dim)])

    def neuron_sums(self) -> torch.Tensor:
        """Per-neuron sums of squares (batch, neurons here): complete, or partial over split rows."""
        sq = self.local * self.local
        return sq.sum(dim=-1) if self.out_dim == 0 else sq.sum(dim=-2)

    def pieces_of(self, per_neuron: torch.Tensor) -> torch.Tensor:
        """The projection each neuron here belongs to (fused projections sit side by side on the outputs, or
        take every `pieces`-th output in turn)."""
        neurons = self.total_rows if self.out_dim == 0 else self.cols
        offset = self.row_offset if self.out_dim == 0 else 0
        ids = torch.arange(per_neuron.size(-1), device=per_neuron.device) + offset
        if self.interleaved:
            return ids % self.pieces
        return torch.div(ids, neurons // self.pieces, rounding_mode="floor")

    def piece_sums(self, per_neuron: torch.Tensor) -> torch.Tensor:
        """(batch, pieces) sums of a per-neuron quantity over each projection's neurons (here)."""
        zeros = per_neuron.new_zeros(per_neuron.size(0), self.pieces)
        return zeros.index_add_(1, self.pieces_of(per_neuron), per_neuron)


def _all_reduce(parts: list[torch.Tensor], groups: list) -> list[torch.Tensor]:
    """Sum each tensor over its process group (None: nothing to sum), one all-reduce per group."""
    out = list(parts)
    for pg in dict.fromkeys(g for g in groups if g is not None):
        idx = [i for i, g in enumerate(groups) if g is pg]
        flat = torch.cat([parts[i].reshape(-1) for i in idx])
        dist.all_reduce(flat, group=pg)
        for i, chunk in zip(idx, flat.split([parts[i].numel() for i in idx]), strict=True):
            out[i] = chunk.view_as(parts[i])
    return out


def normalise_neurons(updates: list, groups: list[dict], states: list[torch.Tensor]) -> None:
    """Each orthogonalised update (plain or DTensor) normalised per neuron in place; `states` (its
    second-moment tensors) move one step of their average."""
    views = [_View(u, g) for u, g in zip(updates, groups, strict=True)]
    sums = [v.neuron_sums() for v in views]
    # Per-column sums over split rows need the other ranks' rows; per-row sums are complete here.
    split_columns = [v.group if v.out_dim == 1 else None for v in views]
    sums = _all_reduce(sums, split_columns)
    scales, norms = [], []
    for view, s, state, group in zip(views, sums, states, groups, strict=True):
        local_state = state.to_local() if isinstance(state, DTensor) else state
        moment = local_state.view(s.shape)  # (batch, neurons here), the state's own storage
        count = view.cols if view.out_dim == 0 else view.total_rows
        moment.lerp_(s / count, 1 - group["normuon_beta2"])
        scale = 1 / (moment.sqrt() + EPS)
        scales.append(scale)
        # The Frobenius norm of each projection before and after the per-neuron scaling
        norms.append(torch.stack([view.piece_sums(s), view.piece_sums(s * scale * scale)]))
    norms = _all_reduce(norms, [v.group if v.out_dim == 0 else None for v in views])
    for view, scale, (before, after) in zip(views, scales, norms, strict=True):
        ratio = (before / after.clamp(min=EPS * EPS)).sqrt()  # (batch, pieces)
        factor = scale * ratio[:, view.pieces_of(scale)]
        view.local.mul_(factor.unsqueeze(-1) if view.out_dim == 0 else factor.unsqueeze(-2))
