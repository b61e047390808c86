"""Muon for the weight matrices inside the transformer blocks, AdamW for every other parameter, in one
torch optimizer, so that accelerate's prepare, the fp16 GradScaler, the guard's skipped steps and every
checkpoint format (full, sharded DCP, async) handle it as they handle AdamW.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; Liu et al. 2025, "Muon is Scalable for
LLM Training") keeps a Nesterov momentum per matrix and replaces the update by its orthogonalisation,
approximated by a quintic Newton-Schulz iteration. The momentum, the iteration's coefficients and eps and
the per-matrix lr adjustment (`_adjust_lr`) are torch.optim.Muon's; its step is not called because it
always iterates in bfloat16 (slow on CPUs without bf16 matmul, too coarse for the float64 tests that prove
FSDP2 equals DDP), refuses 3-D expert stacks and cannot orthogonalise a DTensor shard. Here:

* momentum, decay and the update are `torch._foreach_*` kernels over each group;
* the iteration (newton_schulz.py) runs once per matrix shape on the whole batch of that shape, in
  optim.muon_ns_dtype (auto: bfloat16 on CUDA, float32 on CPUs, float64 for float64 parameters);
* at world size > 1 the matrices are spread over the ranks (muon_spread.py, optim.muon_spread): under
  FSDP2 each matrix's rows go to the one rank that orthogonalises it and come back (under HSDP the
  replica groups split that work too); under DDP each rank does its share and the results are
  all-gathered;
* MoE expert weights (E, rows, cols) are a batch of E matrices; a projection that fuses Q, K and V in one
  matrix (GPT-2's c_attn, split by its attention's `split_size`) is orthogonalised per projection, and so
  is an expert's fused gate_up_proj (its gate and up halves, or alternate outputs where the experts module
  is not concatenated, as GPT-OSS's), each with its own lr adjustment; a router (one row per expert) goes
  to AdamW with the embeddings and the head;
* under expert parallelism (model.ep_size) each rank holds whole experts and orthogonalises only those.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr
from transformers.pytorch_utils import Conv1D

from lmpretrain.errors import ConfigError
from lmpretrain.layout import Layout
from lmpretrain.model.experts import experts_modules
from lmpretrain.update.muon_spread import (
    SpreadRates,
    holds_whole_experts,
    orthogonalised,
    replica_count,
    spread_decision,
)
from lmpretrain.update.newton_schulz import batches, iteration_dtype
from lmpretrain.update.normuon import SECOND_MOMENT, normalise_neurons, second_moment_like


def fused_projections(block: nn.Module) -> dict[int, tuple[int, bool]]:
    """id(weight) -> (number of projections, interleaved), for a weight that computes several projections
    side by side: a Conv1D whose output a module splits in equal parts of its `split_size` (GPT-2's
    attention computes Q, K and V with one c_attn), and a mixture of experts' gate_up_proj stack (each
    expert's gate and up projections: halves, or every other output where the experts module says its
    layout is not concatenated, as GPT-OSS's)."""
    fused = {}
    for module in block.modules():
        size = getattr(module, "split_size", None)
        if isinstance(size, int) and size > 0:
            for child in module.children():
                if isinstance(child, Conv1D) and child.nf % size == 0 and child.nf > size:
                    fused[id(child.weight)] = (child.nf // size, False)
    for experts in experts_modules(block):
        stack = getattr(experts, "gate_up_proj", None)
        if experts.has_gate and isinstance(stack, nn.Parameter) and stack.dim() == 3:
            fused[id(stack)] = (2, not experts.is_concatenated)
    return fused


def routers(block: nn.Module) -> set[int]:
    """id(weight) of each router: a matrix of one row per expert beside an experts module (its output is
    the logits over the experts, a classifier like the LM head, which AdamW updates too)."""
    found, stacks = set(), experts_modules(block)
    for parent in block.modules():
        for e in (m for m in parent.children() if any(m is s for s in stacks)):
            # (experts, hidden): the global count, also when expert parallelism holds a part of the stack
            shape = (next(p for p in e.parameters() if p.dim() == 3).shape[0], e.config.hidden_size)
            for child in parent.children():
                if child is not e:
                    found |= {id(p) for p in child.parameters() if tuple(p.shape) == shape}
    return found


def block_matrices(model: nn.Module) -> dict[int, tuple[int, int, bool]]:
    """id(param) -> (projections, output dim, interleaved) for every weight matrix inside the transformer
    blocks: 2-D, or 3-D as a batch (MoE experts), both last dims > 1, not an embedding's or a convolution's
    kernel, not a per-expert bias stack, not a router. The output dim (0: rows as nn.Linear, 1: columns as
    transformers' Conv1D and transposed expert stacks) orients the lr adjustment."""
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
        fused, to_adamw = fused_projections(block), routers(block)
        for module in block.modules():
            if isinstance(module, not_matrices):
                continue
            own = list(module.parameters(recurse=False))
            # Beside expert stacks (E, rows, cols), a 2-D parameter is a stack of per-expert bias vectors
            # (GPT-OSS's gate_up_proj_bias), not a matrix.
            experts = any(p.dim() == 3 for p in own)
            # transformers' experts modules state their layout: is_transposed = (E, in, out) (GPT-OSS).
            transposed = bool(getattr(module, "is_transposed", False))
            for p in own:
                if not (p.requires_grad and p.dim() in (2, 3) and min(p.shape[-2:]) > 1) or (
                    (experts and p.dim() == 2) or id(p) in to_adamw
                ):
                    continue
                in_out = isinstance(module, Conv1D) or (p.dim() == 3 and transposed)
                pieces, interleaved = fused.get(id(p), (1, False))
                matrices[id(p)] = (pieces, int(in_out), interleaved)
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
        "ns_dtype": optim_cfg.muon_ns_dtype,
        "spread": optim_cfg.muon_spread,
        "coefficients": optim_cfg.muon_coefficients,
        "normuon": optim_cfg.name == "normuon",
        "normuon_beta2": optim_cfg.normuon_beta2,
    }


def muon_groups(model: nn.Module, optim_cfg) -> list[dict]:
    """One Muon group per matrix layout (projections, output dim, interleaved), parameters in model order."""
    layouts = block_matrices(model)
    by_layout: dict[tuple[int, int, bool], list] = {}
    for p in model.parameters():
        if id(p) in layouts:
            by_layout.setdefault(layouts[id(p)], []).append(p)
    groups = []
    for (pieces, out_dim, interleaved), params in sorted(by_layout.items()):
        name = "muon" + ("_in_out" if out_dim else "") + (f"_fused{pieces}" if pieces > 1 else "")
        groups.append(
            {
                "params": params,
                "name": name + ("_interleaved" if interleaved else ""),
                "kind": "muon",
                "pieces": pieces,
                "out_dim": out_dim,
                "interleaved": interleaved,
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

    def __init__(self, groups: list[dict], adamw: dict, spread_rates: SpreadRates | None = None):
        # the roofline optim.muon_spread=auto weighs (muon_spread.spread_rates; None: the device type's)
        self.spread_rates = spread_rates
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
        work = []  # per group: (group, params, Nesterov updates)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None] if group["kind"] == "muon" else []
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
            work.append((group, params, torch._foreach_lerp(grads, bufs, group["momentum"])))
        if not work:
            return
        params = [p for _, ps, _ in work for p in ps]
        groups = [g for g, ps, _ in work for _ in ps]
        updates = [u for _, _, us in work for u in us]
        spread = spread_decision(
            params,
            groups,
            _world_size(),
            isinstance(updates[0], DTensor),
            _local_device(updates[0]),
            replica_count(updates[0]),
            self.spread_rates,
        )
        orthos = orthogonalised(updates, groups, spread.ranks, spread.replicas)
        normed = [i for i, g in enumerate(groups) if g["normuon"]]
        if normed:  # NorMuon: per neuron, on each rank's part of the results (normuon.py)
            for i in normed:
                if SECOND_MOMENT not in self.state[params[i]]:
                    self.state[params[i]][SECOND_MOMENT] = second_moment_like(params[i], groups[i]["out_dim"])
            normalise_neurons(
                [orthos[i] for i in normed],
                [groups[i] for i in normed],
                [self.state[params[i]][SECOND_MOMENT] for i in normed],
            )
        orthos = iter(orthos)
        for group, params, _ in work:
            lr = group["lr"] * group["lr_ratio"]
            ortho = [next(orthos) for _ in params]
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])  # decoupled, as AdamW's
            torch._foreach_mul_(
                ortho, [-_adjust_lr(lr, group["lr_scale"], _out_in(p, group)) for p in params]
            )
            torch._foreach_add_(params, ortho)


def _out_in(p: torch.Tensor, group: dict) -> tuple[int, int]:
    """(outputs, inputs) of one of the tensor's matrices, for the lr adjustment."""
    rows, cols = p.shape[-2:]
    if group["out_dim"]:  # (in, out) storage
        rows, cols = cols, rows
    return rows // group["pieces"], cols


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _local_device(t: torch.Tensor) -> torch.device:
    return t.to_local().device if isinstance(t, DTensor) else t.device


def muon_problems(optim_cfg, layout: Layout) -> list[str]:
    """Muon needs each whole matrix on some rank: DeepSpeed ZeRO and FSDP1 hold flat 1-D partitions."""
    if optim_cfg.name not in ("muon", "normuon") or layout.kind not in ("deepspeed", "fsdp1"):
        return []
    return [
        f"optim.name={optim_cfg.name} cannot run under {layout.describe()}: it flattens the parameters into 1-D "
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
    fused = [p.dim() for group in groups if group["pieces"] > 1 for p in group["params"]]
    fused_note = f", {fused.count(2)} fused QKV split per projection" if 2 in fused else ""
    if 3 in fused:
        fused_note += f", {fused.count(3)} expert gate_up stacks split into gate and up per expert"
    coefficients = "" if g["coefficients"] == "quintic" else " (Polar Express coefficients)"
    normuon = f", per-neuron normalisation beta2={g['normuon_beta2']}" if g["normuon"] else ""
    return (
        f"{'NorMuon' if g['normuon'] else 'Muon'}: {sum(map(matrix_count, groups))} matrices in "
        f"{sum(len(x['params']) for x in groups)} tensors{fused_note}, {n:,} params (Nesterov momentum "
        f"{g['momentum']}, {g['ns_steps']} Newton-Schulz steps{coefficients}{normuon}, lr {lr}, "
        f"weight_decay={g['weight_decay']})"
    )


def describe_muon_implementation(
    optimizer: MuonAdamW, device: torch.device, world_size: int, sharded: bool, replicas: int = 1
) -> str:
    """The iteration's dtype and batches, and where it runs (the spread decision and its reason)."""
    pairs = [(p, g) for g in optimizer.param_groups if g["kind"] == "muon" for p in g["params"]]
    params, groups = [p for p, _ in pairs], [g for _, g in pairs]
    g = groups[0]
    dtype = iteration_dtype(g["ns_dtype"], params[0].dtype, device)
    shapes = [_out_in(p, group) for p, group in pairs]
    where = spread_decision(
        params, groups, world_size, sharded, device, replicas, optimizer.spread_rates
    ).where
    held = [(p, group) for p, group in pairs if holds_whole_experts(p)]
    if held:  # expert parallelism: orthogonalised where they are, whatever the spread
        mine = sum(p.to_local().shape[0] * group["pieces"] for p, group in held)
        where += (
            f"; expert stacks held by expert parallelism: each rank orthogonalises only its own experts' "
            f"matrices ({mine} of {sum(map(matrix_count, [{**gr, 'params': [p]} for p, gr in held]))} here)"
        )
    if g["normuon"]:
        sums = (
            " (its sums over the row shards: all-reduces of a few numbers per matrix)"
            if sharded and world_size > 1
            else ""
        )
        where += f"; then NorMuon normalises each rank's part of the results{sums}"
    return (
        f"Muon: Newton-Schulz in {str(dtype).removeprefix('torch.')} (optim.muon_ns_dtype={g['ns_dtype']}, "
        f"optim.muon_coefficients={g['coefficients']}), {batches(shapes)} batched iterations a step (one per "
        f"matrix shape), foreach momentum and update; {where}"
    )
