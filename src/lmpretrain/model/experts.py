"""How a mixture of experts runs its experts (model.experts_implementation), chosen before the build and
seen on a probe after it.

transformers 5.24's experts modules (classes decorated with `use_experts_implementation`) dispatch on
their config's `_experts_implementation`: `eager` (the class's own loop over the experts hit, two matmuls
per expert), `batched_mm` (each (token, expert) pair's weights gathered, one batched matmul per
projection), `grouped_mm` (the pairs sorted by expert, torch's grouped matmul `torch._grouped_mm` per
projection; where torch's kernel cannot run, transformers falls back to its own loop,
`transformers::grouped_mm_fallback`, without a word). What torch 2.13's CPU grouped matmul refuses, seen
here: float64 (it takes float32, bfloat16, float16) and strides that are not multiples of 16 bytes (a width
that is not a multiple of 4 float32 values). It has no autocast rule either: transformers casts the tokens
to the weights' dtype, so float32 weights under bf16 autocast compute the experts in float32.

So the choice is made here (auto: grouped_mm, batched_mm for float64 parameters), and `describe_experts`
runs one experts module forward and backward on a few tokens, records the matmul kernels torch dispatches
and their dtype, and reports what runs (or stops the run, naming the setting to change, if it cannot).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lmpretrain.errors import ConfigError
from lmpretrain.model.meta_init import zeroed_host_copy

# The matmul each implementation dispatches (aten or transformers' custom op), in the order a probe's
# record is read: a grouped kernel first (its backward may add plain matmuls), a per-expert loop last.
KERNELS = {
    "_grouped_mm": ("grouped_mm", "torch's grouped matmul"),
    "grouped_mm_fallback": (
        "grouped_mm",
        "transformers' per-expert loop (grouped_mm_fallback: torch's grouped matmul cannot run here)",
    ),
    "bmm": ("batched_mm", "one batched matmul per projection"),
    "mm": ("eager", "two matmuls per expert hit"),
}


def has_experts(model_class: type | None) -> bool:
    """Whether transformers can set this class's experts implementation (its own test: the class's module
    uses `use_experts_implementation`)."""
    check = getattr(model_class, "_can_set_experts_implementation", None)
    return bool(check and check())


def expert_count(model_config) -> int | None:
    """Experts per MoE layer, under the names transformers' configs use."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(model_config, name, None)
        if isinstance(value, int):
            return value
    return None


def experts_problems(cfg, model_config, model_class: type | None) -> list[str]:
    """A mixture of experts that cannot run: more experts per token than per layer (torch's top-k would
    fail in the first forward); model.experts_implementation on a model without experts, grouped_mm in
    float64."""
    experts, top_k = expert_count(model_config), getattr(model_config, "num_experts_per_tok", None)
    if has_experts(model_class) and experts and isinstance(top_k, int) and top_k > experts:
        return [
            f"model.overrides.num_experts_per_tok={top_k} is more than the model's {experts} experts per layer "
            "(a token picks that many): lower it or raise the experts"
        ]
    asked = cfg.model.experts_implementation
    if asked == "auto":
        return []
    if not has_experts(model_class):
        name = model_class.__name__ if model_class else cfg.model.type
        return [f"model.experts_implementation={asked}: {name} has no mixture of experts; leave it at auto"]
    if asked == "grouped_mm" and cfg.train.param_dtype == "float64":
        return [
            "model.experts_implementation=grouped_mm: torch's grouped matmul has no float64 kernel "
            "(train.param_dtype=float64); use batched_mm or eager, or auto"
        ]
    return []


def chosen_implementation(config, dtype: torch.dtype, model_class: type | None) -> str | None:
    """The implementation to build with: the configured one (on the config, set from
    model.experts_implementation), else auto's choice; None for a model without experts."""
    if not has_experts(model_class):
        return None
    asked = config._experts_implementation
    return asked or ("batched_mm" if dtype == torch.float64 else "grouped_mm")


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules (`use_experts_implementation` gives each an `_is_expert_parallel` flag)."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate")]


class _Matmuls(TorchDispatchMode):
    """The matmul kernels dispatched inside it, with the dtypes they computed in."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in KERNELS:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.seen.setdefault(name, set()).add(first.dtype)
        return out


def probe(experts: nn.Module, autocast_dtype: torch.dtype | None = None) -> dict[str, set[torch.dtype]]:
    """Run `experts` forward and backward on 8 tokens routed to every expert in turn (its weights are not
    changed, its gradients are left as they were); returns the matmul kernels seen and their dtypes."""
    weight = next(experts.parameters())
    count, width = experts.num_experts, experts.config.hidden_size
    top_k = min(2, count)
    gen = torch.Generator(device=weight.device).manual_seed(0)
    tokens = torch.randn(8, width, generator=gen, device=weight.device, dtype=weight.dtype)
    tokens.requires_grad_(True)
    index = (
        torch.arange(8, device=weight.device)[:, None] + torch.arange(top_k, device=weight.device)
    ) % count
    weights = torch.full((8, top_k), 1.0 / top_k, device=weight.device, dtype=weight.dtype)
    saved = [p.grad for p in experts.parameters()]
    recorder = _Matmuls()
    try:
        with (
            torch.autocast(weight.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None),
            recorder,
        ):
            experts(tokens, index, weights).sum().backward()
    finally:
        for p, grad in zip(experts.parameters(), saved, strict=True):
            p.grad = grad
    return recorder.seen


def describe_experts(model: nn.Module, precision: str = "no") -> str | None:
    """The start-up line: which experts implementation runs, seen on a probe of the first experts module
    (under `precision`'s autocast), or None for a model without experts. One that cannot run is a
    ConfigError naming the setting to change."""
    modules = experts_modules(model)
    if not modules:
        return None
    asked = model.config._experts_implementation
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    probed = modules[0]
    if any(
        p.is_meta for p in probed.parameters()
    ):  # built on meta: which kernel runs does not need the values
        probed = zeroed_host_copy(probed)
    try:
        seen = probe(probed, autocast)
    except RuntimeError as err:
        raise ConfigError(
            [
                f"model.experts_implementation: {asked} cannot run {type(modules[0]).__name__} here ({err}); "
                "set model.experts_implementation=batched_mm or eager"
            ]
        ) from err
    kernel = next((k for k in KERNELS if k in seen), None)
    first = modules[0]
    what = f"{len(modules)} {type(first).__name__} modules of {first.num_experts} experts"
    if kernel is None:
        return f"experts: {asked} asked; no matmul seen in a probe of {what}"
    runs, how = KERNELS[kernel]
    dtypes = "/".join(sorted(str(d).removeprefix("torch.") for d in seen[kernel]))
    line = f"experts: {runs} ({how}, {dtypes}; seen in a probe) in {what}"
    if runs != asked:
        line = f"experts: {asked} asked but {runs} runs ({how}, {dtypes}; seen in a probe) in {what}"
    if autocast is not None and autocast not in seen[kernel]:
        line += f"; not in train.precision={precision}'s dtype" + (
            ": torch's grouped matmul has no autocast rule" if kernel == "_grouped_mm" else ""
        )
    return line
