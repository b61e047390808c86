"""μP (Yang et al., "Tensor Programs V") by width for any transformers decoder: model.mup.base_width.

Applied to the built model, not by editing its code. With m = width / base_width (width: the config's
hidden size):

* hidden matrices (every weight of two or more dimensions except the input and output embeddings) are
  initialised with variance 1/m of transformers' own init: their values are scaled by 1/sqrt(m) after it
  (variance proportional to 1/fan_in, equal to the model's own init at the base width);
* the logits are scaled by 1/m: the final norm's output (the hidden states every loss implementation, the
  model's own forward and generation read) is multiplied by 1/m, so the chunked and Liger losses and the
  exported model see it alike; the export folds it into the final norm's weight (and bias);
* attention scores are scaled 1/d_head instead of 1/sqrt(d_head) where the head width grows with the model
  width: the attention modules' own `scaling` becomes sqrt(base d_head) / d_head (unchanged when the head
  width is fixed and the heads multiply, the usual way to widen); the export folds the change into the
  query projection (or Qwen3's query norm);
* AdamW's lr of the hidden matrices is lr / m (`LR_MULT` in their optimizer group, which the schedule
  applies); embeddings, norms, biases and the output layer keep lr;
* Muon: an orthogonalised update has spectral norm ~1, so `optim.muon_lr_scale=original`
  (sqrt(max(1, rows/cols)): sqrt(fan_out / fan_in) for the wide matrices, 1 for square ones) already meets
  μP's spectral condition and needs no change; `match_rms_adamw` (0.2 sqrt(max(rows, cols))) grows as
  sqrt(m), so its lr is multiplied by 1/sqrt(m) (docs/mup.md).

By depth (model.mup.depth, with base_depth; L: the config's num_hidden_layers), with d = base_depth / L:

* each decoder layer's attention and MLP branch is multiplied by d^alpha before it joins the residual
  stream (alpha = 1: CompleteP, Dey et al. 2025; 1/2: Depth-μP, Yang et al., "Tensor Programs VI"): a forward
  hook scales the output of the branch's last projection (o_proj, down_proj), which is linear, so the export
  folds d^alpha into that projection's weight and bias;
* every parameter of the decoder layers (matrices, norms, biases) is trained at lr x d^(1 - alpha), with
  AdamW and Muon alike: 1 under CompleteP; init, weight decay and AdamW's eps are left (docs/mup.md).

At m = 1 and L = base_depth nothing changes: the run is bit-identical to one without model.mup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from lmpretrain.errors import ConfigError
from lmpretrain.model.meta_init import zeroed_host_copy

ATTR = "_lmpretrain_mup"  # the model's μP record, read by the optimizer builder and the export
LR_MULT = "lr_mult"  # an optimizer group's multiplier of the scheduled lr (update/schedule.py: set_lr)
DEPTH_ALPHA = {"completep": 1.0, "sqrt": 0.5}  # model.mup.depth: the exponent of base_depth / L


@dataclass
class Mup:
    width: int
    base_width: int
    hidden: set[int] = field(default_factory=set)  # ids of the hidden matrices
    norm_name: str = ""  # the final norm's module name
    one_plus: bool = False  # the final norm computes (1 + weight) x ... (Gemma)
    queries: dict[str, float] = field(
        default_factory=dict
    )  # query module name -> the score factor folded at export
    depth: int = 1  # the number of decoder layers
    base_depth: int = 1  # = depth without model.mup.depth
    depth_rule: str = ""
    branches: list[str] = field(default_factory=list)  # the residual branches' last projections' names
    blocks: set[int] = field(default_factory=set)  # ids of the decoder layers' parameters

    @property
    def mult(self) -> float:
        return self.width / self.base_width

    @property
    def branch_mult(self) -> float:
        """(base_depth / L)^alpha: each residual branch's output multiplier."""
        return (self.base_depth / self.depth) ** DEPTH_ALPHA[self.depth_rule] if self.depth_rule else 1.0

    def depth_lr_mult(self) -> float:
        """(base_depth / L)^(1 - alpha): the decoder layers' lr multiplier (1 under CompleteP)."""
        return (
            (self.base_depth / self.depth) ** (1 - DEPTH_ALPHA[self.depth_rule]) if self.depth_rule else 1.0
        )

    def adamw_lr_mult(self) -> float:
        return self.base_width / self.width

    def muon_lr_mult(self, lr_scale: str) -> float:
        return math.sqrt(self.base_width / self.width) if lr_scale == "match_rms_adamw" else 1.0

    def describe(self) -> str:
        m = self.mult
        attention = (
            f"attention scores 1/d_head in {len(self.queries)} layers"
            if self.queries
            else "attention unchanged (the head width does not grow with the width)"
        )
        depth = (
            f"; depth {self.depth} over base {self.base_depth} ({self.depth_rule}): residual branches x "
            f"{self.branch_mult:.4g} ({len(self.branches)} o_proj/down_proj outputs), the decoder layers' "
            f"{len(self.blocks)} parameters trained at lr x {self.depth_lr_mult():.4g}"
            if self.depth_rule
            else ""
        )
        return (
            f"μP: width {self.width} over base {self.base_width} (m = {m:g}): {len(self.hidden)} hidden matrices "
            f"initialised x {1 / math.sqrt(m):.4g} and trained at AdamW lr x {1 / m:.4g}; logits x {1 / m:.4g} "
            f"(the final norm {self.norm_name}); {attention}{depth}"
        )

    def fold_for_export(self, weights: dict) -> dict:
        """The state dict of a plain model that computes what this μP model computes."""
        if self.mult == 1 and self.branch_mult == 1:
            return weights
        weights = dict(weights)
        scale = 1 / self.mult
        weight = f"{self.norm_name}.weight"
        if self.one_plus:
            weights[weight] = (1 + weights[weight]) * scale - 1
        else:
            weights[weight] = weights[weight] * scale
        if f"{self.norm_name}.bias" in weights:
            weights[f"{self.norm_name}.bias"] = weights[f"{self.norm_name}.bias"] * scale
        branches = dict.fromkeys(self.branches, self.branch_mult) if self.branch_mult != 1 else {}
        for name, factor in {**self.queries, **branches}.items():
            for suffix in ("weight", "bias"):
                if f"{name}.{suffix}" in weights:
                    weights[f"{name}.{suffix}"] = weights[f"{name}.{suffix}"] * factor
        return weights


def width_overrides(width: int, head_dim: int = 32) -> dict:
    """A Llama-style model at `width` for sweeps and coordinate checks: the MLP 8/3 x wide (rounded to 64) and
    heads of `head_dim` (set, so the head width stays fixed and the heads multiply)."""
    heads = max(1, width // head_dim)
    return {
        "hidden_size": width,
        "intermediate_size": max(64, round(8 * width / 3 / 64) * 64),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
    }


def of(model: nn.Module) -> Mup | None:
    return getattr(model, ATTR, None)


def optimizer_groups(model: nn.Module, adamw_groups: list[dict], muon_groups: list[dict], lr_scale: str):
    """The optimizer's groups under μP: each AdamW group split into its hidden matrices (lr / m), the decoder
    layers' other parameters (the depth rule's lr) and the rest; each Muon group's lr multiplied as its lr
    adjustment needs (module doc) and by the depth rule's (Muon's matrices are the decoder layers'). Unchanged
    without μP or where every multiplier is 1."""
    mup = of(model)
    if mup is None or (mup.mult == 1 and mup.depth_lr_mult() == 1):
        return adamw_groups, muon_groups
    width, depth = mup.adamw_lr_mult(), mup.depth_lr_mult()

    def part(p) -> tuple[bool, bool]:  # (trained at the width's lr, at the depth's)
        return id(p) in mup.hidden and width != 1, id(p) in mup.blocks and depth != 1

    split = []
    for group in adamw_groups:
        parts: dict[tuple[bool, bool], list] = {}
        for p in group["params"]:
            parts.setdefault(part(p), []).append(p)
        if (False, False) in parts or not parts:  # an empty group stays as it was
            split.append({**group, "params": parts.pop((False, False), [])})
        for (hidden, block), params in sorted(parts.items()):
            name = group["name"] + "_mup" + ("_hidden" if hidden else "") + ("_depth" if block else "")
            mult = (width if hidden else 1.0) * (depth if block else 1.0)
            split.append({**group, "params": params, "name": name, LR_MULT: mult})
    muon = [{**g, LR_MULT: mup.muon_lr_mult(lr_scale) * depth} for g in muon_groups]
    return split, muon


def apply(
    model: nn.Module,
    base_width: int,
    head_dim_fixed: bool = False,
    depth_rule: str | None = None,
    base_depth: int | None = None,
) -> Mup:
    """μP on a freshly initialised `model` (module doc); returns its record (also kept on the model).
    `head_dim_fixed`: the config sets head_dim (model.overrides), so it does not follow the width.
    `depth_rule` (completep, sqrt) with `base_depth`: the residual branches scaled by depth."""
    config = model.config
    width = getattr(config, "hidden_size", None)
    if not isinstance(width, int):
        raise ConfigError(
            [f"model.mup: a {config.model_type} config has no hidden_size to read the width from"]
        )
    if base_width < 1:
        raise ConfigError([f"model.mup.base_width={base_width} must be >= 1 (the width the lr was tuned at)"])
    mup = Mup(width, base_width)
    mup.norm_name, mup.one_plus = _final_norm(model)
    embeddings = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        embeddings.add(id(head.weight))
    mup.hidden = {id(p) for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings}
    mup.queries = _attention_scaling(model, config, width, base_width, head_dim_fixed)
    if depth_rule:
        _depth_scaling(model, mup, depth_rule, base_depth)
    setattr(model, ATTR, mup)
    if mup.branch_mult != 1:
        for name in mup.branches:
            model.get_submodule(name).register_forward_hook(_scale_output(mup.branch_mult))
    if mup.mult == 1:
        return mup
    with torch.no_grad():
        for p in model.parameters():
            if id(p) in mup.hidden:
                p.mul_(1 / math.sqrt(mup.mult))
    norm = model.get_submodule(mup.norm_name)
    norm.register_forward_hook(_scale_output(1 / mup.mult))
    return mup


def _depth_scaling(model: nn.Module, mup: Mup, rule: str, base_depth: int | None) -> None:
    """Fill `mup`'s depth fields: L from the config, the decoder layers (the blocks transformers names in
    `_no_split_modules`) and each one's residual branches' last projections: the attention's o_proj and the
    MLP's down_proj, linear layers whose output goes straight into the residual stream, so that scaling it
    (and, at export, its weight and bias) scales the branch."""
    depth = getattr(model.config, "num_hidden_layers", None)
    if rule not in DEPTH_ALPHA or not isinstance(base_depth, int) or base_depth < 1:
        raise ConfigError(
            [
                f"model.mup.depth={rule} with base_depth={base_depth}: the rule is one of "
                f"{', '.join(DEPTH_ALPHA)} and base_depth a number of layers >= 1"
            ]
        )
    from lmpretrain.model.speed import transformer_blocks  # here: it loads transformers' model registry

    blocks = set(transformer_blocks(model))
    layers = [(n, m) for n, m in model.named_modules() if m in blocks]
    kind = type(model).__name__
    if not isinstance(depth, int) or len(layers) != depth:
        raise ConfigError(
            [
                f"model.mup.depth: found {len(layers)} decoder layers in {kind} (its _no_split_modules) but "
                f"its config has num_hidden_layers={depth}; the depth rule needs the model's decoder layers"
            ]
        )
    for name, layer in layers:
        if hasattr(layer, "post_feedforward_layernorm"):  # Gemma 2/3, OLMo 2
            raise ConfigError(
                [
                    f"model.mup.depth: {type(layer).__name__} normalises each branch's output before the residual "
                    "add, which would undo a scaled o_proj/down_proj; this model type is not supported"
                ]
            )
        for last in ("o_proj", "down_proj"):
            found = [n for n, m in layer.named_modules() if n.rsplit(".", 1)[-1] == last]
            linear = [n for n in found if isinstance(layer.get_submodule(n), nn.Linear)]
            stacked = [n for n, _ in layer.named_parameters() if last in n.split(".")[-1]]  # fused experts
            if not linear or len(linear) != len(found) or stacked:
                raise ConfigError(
                    [
                        f"model.mup.depth: {type(layer).__name__} has no linear {last} ending each of its "
                        f"{'attention' if last == 'o_proj' else 'MLP'} branches (found: {found + stacked or 'none'}) "
                        "to scale the branch by; this model type is not supported"
                    ]
                )
            mup.branches += [f"{name}.{n}" for n in linear]
        mup.blocks |= {id(p) for p in layer.parameters()}
    mup.depth, mup.base_depth, mup.depth_rule = depth, base_depth, rule


def _scale_output(scale: float):
    def hook(module, args, output):
        return output * scale

    return hook


def _final_norm(model: nn.Module) -> tuple[str, bool]:
    """The base model's last norm (llama's model.norm, GPT-2's transformer.ln_f), which the logits read, and
    whether it computes (1 + weight) x (Gemma's), found by a probe: a copy of the norm run with its weight set to 2
    and to 1."""
    base_name = model.base_model_prefix
    base = getattr(model, base_name, None)
    norms = (
        [(n, c) for n, c in base.named_children() if "norm" in type(c).__name__.lower()]
        if base is not None
        else []
    )
    if not norms or getattr(norms[-1][1], "weight", None) is None:
        raise ConfigError(
            [
                f"model.mup: no final norm with a weight found in {type(model).__name__} (the logits' 1/m is folded into it)"
            ]
        )
    name, norm = norms[-1]
    # On a host copy of the norm with a fixed probe: the model's own may be on the meta device (model/meta_init.py),
    # and a probe drawn from the generator would shift the draws of what is built after it.
    twin = zeroed_host_copy(norm)
    width = norm.weight.shape[-1]
    probe = torch.linspace(-2.0, 2.0, 2 * width, device="cpu").reshape(2, width).to(norm.weight.dtype)
    with torch.no_grad():
        twin.weight.fill_(2.0)
        doubled = twin(probe)
        twin.weight.fill_(1.0)
        single = twin(probe)
    one_plus = not torch.allclose(doubled, 2 * single, rtol=1e-3, atol=1e-6)
    return f"{base_name}.{name}", one_plus


def _attention_scaling(
    model: nn.Module, config, width: int, base_width: int, fixed: bool
) -> dict[str, float]:
    """1/d_head scores where the head width grows with the width; the query modules and the factor their
    export folds in. A head width fixed by the config (head_dim set, or heads growing with the width) is left."""
    attention = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    heads = getattr(config, "num_attention_heads", None)
    queries = {}
    for name, module in attention:
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(getattr(module, "scaling", None), float) or head_dim is None:
            raise ConfigError(
                [
                    f"model.mup: {type(module).__name__} has no `scaling` attribute for its attention scores "
                    "(μP scores them 1/d_head); this model type is not supported"
                ]
            )
        derived = heads and head_dim * heads == width and not fixed
        base_dim = base_width // heads if derived else head_dim
        if base_dim == head_dim:
            continue
        factor = math.sqrt(base_dim / head_dim)  # sqrt(base_d) / d = factor / sqrt(d)
        module.scaling = math.sqrt(base_dim) / head_dim
        target = "q_norm" if hasattr(module, "q_norm") else "q_proj"
        if not hasattr(module, target):
            raise ConfigError(
                [
                    f"model.mup: the head width grows with the width ({base_dim} -> {head_dim}) and "
                    f"{type(module).__name__} has no q_proj to fold 1/d_head into for the export; keep the head "
                    "width fixed (set head_dim, or scale num_attention_heads with the width)"
                ]
            )
        queries[f"{name}.{target}"] = factor
    return queries
