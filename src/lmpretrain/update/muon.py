"""Muon for the weight matrices inside the transformer blocks, AdamW for every other parameter, in one
torch optimizer, so that accelerate's prepare, the fp16 GradScaler, the guard's skipped steps and every
checkpoint format (full, sharded DCP, async) handle it as they handle AdamW.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; Liu et al. 2025, "Muon is Scalable for
LLM Training") keeps a Nesterov momentum per matrix and replaces the update by its orthogonalisation,
approximated by a quintic Newton-Schulz iteration. The momentum, the iteration's coefficients and eps and
the per-matrix lr adjustment (`_adjust_lr`) are torch.optim.Muon's; its step is not called because it
rounds every update to bfloat16 (slow on CPUs without bf16 matmul, and too coarse for the float64 tests that
prove FSDP2 equals DDP), refuses 3-D expert stacks and cannot orthogonalise a DTensor shard. Here the
iteration runs in float32 (float64 for float64 parameters) on whole matrices:

* plain tensors (one process, DDP): every rank orthogonalises every matrix, the same update everywhere;
* DTensor shards (FSDP2): each matrix's update is gathered whole, rank i % world orthogonalises matrix i
  (rounds of `world` matrices, so no rank holds more than `world` whole updates at once), broadcasts it,
  and every rank keeps its own shard of the result;
* MoE expert weights (E, rows, cols) are a batch of E matrices; a projection that fuses Q, K and V in one
  matrix (GPT-2's c_attn, split by its attention's `split_size`) is orthogonalised per projection.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr
from transformers.pytorch_utils import Conv1D

from lmpretrain.errors import ConfigError


def orthogonalise(update: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton-Schulz approximation of U V^T for update = U S V^T, over the last two dims (a leading dim is
    a batch of matrices), in float32 or wider."""
    x = update.to(torch.promote_types(update.dtype, torch.float32))
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = DEFAULT_A * x + (DEFAULT_B * gram + DEFAULT_C * gram @ gram) @ x
    return (x if wide else x.mT).to(update.dtype)


def fused_projections(block: nn.Module) -> dict[int, int]:
    """id(weight) -> number of projections, for a Conv1D whose output a module splits in equal parts of its
    `split_size` (GPT-2's attention computes Q, K and V with one c_attn and splits it by split_size)."""
    fused = {}
    for module in block.modules():
        size = getattr(module, "split_size", None)
        if not isinstance(size, int) or size <= 0:
            continue
        for child in module.children():
            if isinstance(child, Conv1D) and child.nf % size == 0 and child.nf > size:
                fused[id(child.weight)] = child.nf // size
    return fused


def block_matrices(model: nn.Module) -> dict[int, tuple[int, int]]:
    """id(param) -> (projections, output dim) for every weight matrix inside the transformer blocks: 2-D,
    or 3-D as a batch (MoE experts), both last dims > 1, not an embedding's or a convolution's kernel.
    The output dim (0: rows as nn.Linear, 1: columns as transformers' Conv1D) orients the lr adjustment."""
    from lmpretrain.model.speed import transformer_blocks  # here: it loads transformers' model registry

    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(
            [
                f"optim.name=muon: found no transformer blocks in {type(model).__name__} (its _no_split_modules "
                "names none), so there are no block matrices for Muon; use optim.name=adamw"
            ]
        )
    not_matrices = (nn.Embedding, nn.modules.conv._ConvNd)
    matrices = {}
    for block in blocks:
        fused = fused_projections(block)
        for module in block.modules():
            if isinstance(module, not_matrices):
                continue
            for p in module.parameters(recurse=False):
                if p.requires_grad and p.dim() in (2, 3) and min(p.shape[-2:]) > 1:
                    matrices[id(p)] = (fused.get(id(p), 1), 1 if isinstance(module, Conv1D) else 0)
    if not matrices:
        raise ConfigError(
            [
                f"optim.name=muon: the {type(blocks[0]).__name__} blocks hold no weight matrix; use optim.name=adamw"
            ]
        )
    return matrices


def muon_hyperparameters(optim_cfg) -> dict:
    """The Muon group settings the config decides (set at build and again at resume)."""
    original = optim_cfg.muon_lr_scale == "original"
    return {
        "momentum": optim_cfg.muon_momentum,
        "ns_steps": optim_cfg.muon_ns_steps,
        "lr_scale": optim_cfg.muon_lr_scale,
        # The schedule sets every group's lr to optim.lr times its factor; this makes it muon_lr times it.
        "lr_ratio": optim_cfg.muon_lr / optim_cfg.lr if original else 1.0,
        "weight_decay": optim_cfg.weight_decay,
    }


def muon_groups(model: nn.Module, optim_cfg) -> list[dict]:
    """One Muon group per matrix layout (projections, output dim), parameters in model order."""
    layouts = block_matrices(model)
    by_layout: dict[tuple[int, int], list] = {}
    for p in model.parameters():
        if id(p) in layouts:
            by_layout.setdefault(layouts[id(p)], []).append(p)
    groups = []
    for (pieces, out_dim), params in sorted(by_layout.items()):
        name = "muon" + ("_conv1d" if out_dim else "") + (f"_fused{pieces}" if pieces > 1 else "")
        groups.append(
            {
                "params": params,
                "name": name,
                "kind": "muon",
                "pieces": pieces,
                "out_dim": out_dim,
                "lr": optim_cfg.lr,
                **muon_hyperparameters(optim_cfg),
            }
        )
    return groups


def matrix_count(group: dict) -> int:
    """Matrices Muon orthogonalises in a group: one per projection, one per expert."""
    return sum(group["pieces"] * (p.shape[0] if p.dim() == 3 else 1) for p in group["params"])


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups tagged kind=muon, torch's AdamW (`adamw` keyword arguments) on the others.

    The AdamW runs as an inner torch.optim.AdamW over the same group dicts and the same state, so the
    schedule's lr, a resumed config's hyper-parameters and a loaded checkpoint reach both."""

    def __init__(self, groups: list[dict], adamw: dict):
        for group in groups:
            group.setdefault("kind", "adamw")
        super().__init__(groups, defaults={})
        self._adamw = torch.optim.AdamW(self._adamw_groups(), **adamw)
        self._share_state()
        self.register_load_state_dict_post_hook(MuonAdamW._share_state)

    def _adamw_groups(self) -> list[dict]:
        return [g for g in self.param_groups if g["kind"] == "adamw"]

    def _share_state(self) -> None:
        """Loading a state dict replaces the group dicts and the state: point the inner AdamW at them."""
        self._adamw.param_groups = self._adamw_groups()
        self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step()
        self._adamw.step()
        return loss

    def _muon_step(self) -> None:
        work = []  # (param, group, Nesterov update)
        for group in self.param_groups:
            if group["kind"] != "muon":
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                work.append((p, group, p.grad.lerp(buf, group["momentum"])))
        for (p, group, _), ortho in zip(work, _orthogonalised(work), strict=True):
            lr = group["lr"] * group["lr_ratio"]
            rows, cols = p.shape[-2:]
            if group["out_dim"]:  # (in, out) storage: the lr adjustment reads (out, in)
                rows, cols = cols, rows
            p.mul_(1 - lr * group["weight_decay"])  # decoupled, as AdamW's
            p.add_(ortho, alpha=-_adjust_lr(lr, group["lr_scale"], (rows // group["pieces"], cols)))


def _orthogonalise_layout(update: torch.Tensor, group: dict) -> torch.Tensor:
    if group["pieces"] == 1:
        return orthogonalise(update, group["ns_steps"])
    dim = update.dim() - 2 + group["out_dim"]  # fused projections lie side by side along the outputs
    parts = update.chunk(group["pieces"], dim=dim)
    return torch.cat([orthogonalise(x, group["ns_steps"]) for x in parts], dim=dim)


def _orthogonalised(work: list) -> list[torch.Tensor]:
    """Every update orthogonalised whole; DTensor shards come back as shards of the same placement."""
    out: list = [None] * len(work)
    sharded = []
    for i, (_, group, update) in enumerate(work):
        if isinstance(update, DTensor):
            sharded.append(i)
        else:
            out[i] = _orthogonalise_layout(update, group)
    if not sharded:
        return out
    mesh = work[sharded[0]][2].device_mesh
    if mesh.ndim != 1:  # e.g. HSDP: every rank orthogonalises every matrix (correct, not spread)
        for i in sharded:
            _, group, update = work[i]
            full = _orthogonalise_layout(update.full_tensor(), group)
            out[i] = distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)
        return out
    pg, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    for start in range(0, len(sharded), world):
        chunk = sharded[start : start + world]
        whole = [work[i][2].full_tensor().contiguous() for i in chunk]
        for owner, (i, full) in enumerate(zip(chunk, whole, strict=True)):
            if owner == me:
                full.copy_(_orthogonalise_layout(full, work[i][1]))
        for owner, full in enumerate(whole):
            dist.broadcast(full, src=dist.get_global_rank(pg, owner), group=pg)
        for i, full in zip(chunk, whole, strict=True):
            update = work[i][2]
            out[i] = distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)
    return out


def muon_problems(optim_cfg, sharding: str) -> list[str]:
    """Muon needs each whole matrix on some rank: DeepSpeed ZeRO and FSDP1 hold flat 1-D partitions."""
    if optim_cfg.name != "muon" or not sharding.startswith(("deepspeed", "fsdp1")):
        return []
    return [
        f"optim.name=muon cannot run under {sharding.split()[0]}: it flattens the parameters into 1-D "
        "partitions, so no rank holds a weight matrix to orthogonalise; launch with FSDP2 "
        "(configs/accelerate/fsdp.yaml, cpu-fsdp.yaml) or DDP, or use optim.name=adamw"
    ]


def describe_muon(optimizer: MuonAdamW) -> str:
    groups = [g for g in optimizer.param_groups if g["kind"] == "muon"]
    g = groups[0]
    n = sum(p.numel() for group in groups for p in group["params"])
    lr = (
        "0.2*sqrt(max(rows, cols)) x optim.lr"
        if g["lr_scale"] == "match_rms_adamw"
        else f"sqrt(max(1, rows/cols)) x optim.muon_lr={g['lr'] * g['lr_ratio']:.3g}"
    )
    fused = sum(len(group["params"]) for group in groups if group["pieces"] > 1)
    fused_note = f", {fused} fused QKV split per projection" if fused else ""
    return (
        f"Muon: {sum(map(matrix_count, groups))} matrices in {sum(len(x['params']) for x in groups)} tensors"
        f"{fused_note}, {n:,} params (Nesterov momentum {g['momentum']}, {g['ns_steps']} Newton-Schulz "
        f"steps, lr {lr}, weight_decay={g['weight_decay']})"
    )
