"""The speed switches around the model: attention kernel, experts implementation, activation checkpointing,
regional compilation.

They change how the model runs, not what it computes (tests/test_speed.py trains with each one on
and off and compares). `kernel_problems` refuses, before any work, a kernel or loss that cannot run
here; `prepare_model` then, after the objective is installed and before accelerate wraps the model (the
order accelerate's own FSDP2 path uses: checkpointing, then compile, then sharding), runs the tanh-GELU
as one kernel, checkpoints and compiles each transformer block, and returns what really runs, for the log.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers.activations import FastGELUActivation, GELUTanh, NewGELUActivation
from transformers.utils import is_flash_attn_2_available

from lmpretrain.errors import ConfigError
from lmpretrain.model.build import attention_kernel, causal_lm_class
from lmpretrain.model.experts import describe_experts, experts_problems
from lmpretrain.model.fp8 import convert_to_fp8, fp8_problems

# What each kernel needs from the model class (transformers' own flags).
_KERNEL_SUPPORT = {
    "sdpa": "_supports_sdpa",
    "flash_attention_2": "_supports_flash_attn",
    "flex_attention": "_supports_flex_attn",
}


def kernel_problems(cfg, model_config) -> list[str]:
    """Attention kernel and loss implementation that cannot run here (package, device, model class)."""
    p: list[str] = []
    kernel, kind = attention_kernel(model_config), model_config.model_type  # the kernel the model gets
    model_class = causal_lm_class(model_config)
    flag = _KERNEL_SUPPORT.get(kernel)
    if model_class is not None and flag and not getattr(model_class, flag, False):
        p.append(
            f"model.attn_implementation={kernel}: transformers' {model_class.__name__} does not implement it; "
            f"use {'sdpa' if getattr(model_class, '_supports_sdpa', False) else 'eager'}"
        )
    if kernel == "flash_attention_2":
        if not is_flash_attn_2_available():
            where = (
                "no CUDA device here"
                if not torch.cuda.is_available()
                else "the flash-attn package is missing"
            )
            p.append(
                f"model.attn_implementation=flash_attention_2 needs a CUDA GPU and `pip install flash-attn` "
                f"({where}); use sdpa"
            )
        if cfg.train.precision not in ("bf16", "fp16"):
            p.append(
                "model.attn_implementation=flash_attention_2 computes in bf16/fp16 only: set train.precision=bf16"
            )
    if cfg.train.loss_impl == "liger":
        missing = [
            need
            for need, ok in (
                (
                    "the liger-kernel package (pip install -e .[gpu])",
                    importlib.util.find_spec("liger_kernel"),
                ),
                ("a CUDA GPU", torch.cuda.is_available()),
            )
            if not ok
        ]
        if missing:
            p.append(
                f"train.loss_impl=liger needs {' and '.join(missing)}; use train.loss_impl=chunked (same memory "
                f"saving, plain PyTorch)"
            )
    p += fp8_problems(cfg.train.fp8)
    p += experts_problems(cfg, model_config, model_class)
    takes_positions = (
        model_class is None or "position_ids" in inspect.signature(model_class.forward).parameters
    )
    if cfg.data.document_masking and not takes_positions:
        p.append(
            f"data.document_masking=true: a {kind} model takes no position_ids, through which documents are "
            f"masked; set data.document_masking=false"
        )
    return p


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, by the class names transformers lists in `_no_split_modules` (as FSDP wraps)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


# transformers' Python forms of GELU's tanh approximation (GPT-2's gelu_new, gelu_fast): 0.5 x (1 + tanh(...))
# is eight elementwise kernels forward and more backward, each a pass over the MLP's widest activation.
PYTHON_GELU_TANH = (NewGELUActivation, FastGELUActivation)


def fuse_gelu_tanh(model: nn.Module) -> str | None:
    """Swap the Python tanh-GELUs for torch's single kernel of the same function (transformers' own
    `gelu_pytorch_tanh`): ~7x faster forward + backward on the CPU, equal to float rounding (2.4e-7 at
    most in float32). The model's config is untouched, so exports and checkpoints are unchanged.
    Returns the log line, or None when the model has none."""
    swapped: dict[str, int] = {}
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) in PYTHON_GELU_TANH:
                setattr(parent, name, GELUTanh())
                swapped[type(child).__name__] = swapped.get(type(child).__name__, 0) + 1
    if not swapped:
        return None
    found = ", ".join(f"{n} {kind}" for kind, n in swapped.items())
    return f"activation: {found} (Python, ~8 kernels) run as torch's gelu(approximate='tanh'), one kernel"


# What selective checkpointing keeps (torchtitan's op-level policy keeps the same kinds): the matmuls (linear
# layers are mm, or addmm with a bias as in GPT-2's Conv1D; eager attention's scores are bmm; fp8 linears
# are _scaled_mm; grouped experts _grouped_mm) and the fused attention kernels, CPU's among them. These are
# the expensive ops; what is left between them (norms, activations, residual adds, softmax, dropout) is
# cheap to run again, so backward recomputes only that.
_SAVED_BY_SELECTIVE = [
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.higher_order.flex_attention,
]


def enable_activation_checkpointing(model: nn.Module, mode: str) -> str:
    """Checkpoint each block by transformers' own per-layer checkpointing, `mode` full or selective
    (train.activation_checkpointing; none leaves the model as it is): non-reentrant, and
    RNG state preserved so the recomputed forward draws the same dropout masks (and training's RNG stream
    is not moved). selective hands torch.utils.checkpoint a `context_fn` of torch's
    `create_selective_checkpoint_contexts`: the ops in _SAVED_BY_SELECTIVE are kept, the rest recomputed.
    Returns the log line, saying what really runs."""
    if mode == "none":
        return "activation checkpointing: none (every activation kept for backward)"
    if mode not in ("full", "selective"):  # the config allows no other; a caller's typo must not mean full
        raise ValueError(f"activation checkpointing mode {mode!r}: expected none, full or selective")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            [
                f"train.activation_checkpointing={mode}: transformers' {type(model).__name__} does not support "
                f"activation checkpointing; set it to none"
            ]
        )
    kwargs = {"use_reentrant": False, "preserve_rng_state": True}  # context_fn needs the non-reentrant path
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _SAVED_BY_SELECTIVE)
    model.activation_checkpointing_enable(kwargs)
    # It also hooks the input embedding to make its output require grad (for frozen embeddings, as in
    # PEFT); ours train, and under no_grad (evaluation) the hook would make compiled blocks recompile.
    model.disable_input_require_grads()
    count = sum(getattr(m, "gradient_checkpointing", False) for m in transformer_blocks(model))
    kept = (
        "only each block's input kept, the block recomputed in backward"
        if mode == "full"
        else "matmul and attention outputs kept, the ops between them recomputed"
    )
    return f"activation checkpointing: {mode}, {count} blocks ({kept}), non-reentrant, RNG preserved"


def compile_blocks(model: nn.Module) -> str:
    """torch.compile each transformer block in place (regional compilation, as torchtitan does).

    In place (`Module.compile`), unlike accelerate's `compile_regions`, which returns a copy whose blocks
    are OptimizedModules: parameter names stay the same (checkpoints and exports are unchanged) and
    hooks added later by FSDP2 still run. Identical blocks share one compiled graph.
    """
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(
            [
                f"train.compile=true: found no transformer blocks in {type(model).__name__} (its _no_split_modules "
                f"is empty); set train.compile=false"
            ]
        )
    for block in blocks:
        block.compile()
    return f"compile: {len(blocks)} {type(blocks[0]).__name__} blocks (torch.compile, inductor; compiled on first use)"


def compile_seconds() -> float:
    """Wall time torch.compile has spent so far in this process (forward and backward graphs)."""
    from torch._dynamo.utils import calculate_time_spent  # dynamo's own accounting

    return calculate_time_spent()["total_wall_time"]


def prepare_model(model: nn.Module, train_cfg, accelerator=None) -> list[str]:
    """Activation checkpointing and compile; returns the log lines (the attention kernel and the experts
    implementation first).

    Call it after `objective.install(model)` and before `accelerator.prepare` (the accelerator's FSDP
    plugin must not checkpoint too).
    """
    fsdp_plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    if getattr(fsdp_plugin, "activation_checkpointing", False):
        raise ConfigError(
            [
                "the FSDP launch config sets fsdp_activation_checkpointing: true, whose checkpointing does not "
                "preserve the RNG state (dropout would be recomputed with other masks): set it to false and use "
                "train.activation_checkpointing=full or selective"
            ]
        )
    kernel = model.config._attn_implementation
    if kernel == "eager" and not getattr(model, "_supports_sdpa", False):
        kernel += f" ({type(model).__name__} has no sdpa path)"
    lines = [f"attention: {kernel}"]
    experts = describe_experts(model, train_cfg.precision)  # before sharding and compile: one module alone
    if experts:
        lines.append(experts)
    fused = fuse_gelu_tanh(model)
    if fused:
        lines.append(fused)
    lines.append(enable_activation_checkpointing(model, train_cfg.activation_checkpointing))
    if train_cfg.fp8 != "none":  # before compile (torchao's casts compile into the blocks) and sharding
        lines.append(convert_to_fp8(model, train_cfg.fp8, sharded=fsdp_plugin is not None))
    if train_cfg.compile:
        lines.append(compile_blocks(model))
    return lines
