"""One pre-flight pass: every problem that can be found before any work, reported together.

The config's own rules (config.config_problems), the model config built from it, what the model and the
tokenizer must agree on, the kernels and losses this machine can run, what the model class must offer for
the switches that are on (docs/models.md), and what the launch backend cannot host. Checks that need the
built model (its logits and masks on a few tokens) run right after the build (LMObjective.install).
"""

from __future__ import annotations

from lmpretrain.checkpoint.checkpointer import checkpoint_problems
from lmpretrain.config import Config, config_problems, fork_sections
from lmpretrain.errors import ConfigError
from lmpretrain.layout import Layout
from lmpretrain.model.build import build_model_config, causal_lm_class, contract_problems
from lmpretrain.model.speed import kernel_problems
from lmpretrain.run.expert_parallel import ep_problems
from lmpretrain.run.fingerprint import allow_mismatch_problems
from lmpretrain.update.guard import guard_problems
from lmpretrain.update.muon import muon_problems


def preflight(cfg: Config, layout: Layout, tokenizer):
    """The model config of the run laid out as `layout`, or one ConfigError listing every problem found."""
    problems = config_problems(cfg, layout.num_processes)
    problems += allow_mismatch_problems(
        [n for n in cfg.run.allow_mismatch if n is not None], sections=fork_sections(cfg)
    )
    model_config = None
    try:
        model_config = build_model_config(cfg.model, tokenizer)
    except ConfigError as err:
        problems += err.problems
    if model_config is not None:
        problems += model_problems(cfg, model_config, tokenizer)
        problems += kernel_problems(cfg, model_config)
        problems += contract_problems(cfg, causal_lm_class(model_config), layout)
        problems += ep_problems(cfg, model_config, layout)
    problems += backend_problems(cfg, layout) + auto_batch_problems(cfg, layout)
    if problems:
        raise ConfigError(problems, source=cfg.config_path or "config")
    return model_config


def model_problems(cfg: Config, model_config, tokenizer) -> list[str]:
    """Rules that need the model config and tokenizer: context length and vocabulary."""
    p: list[str] = []
    positions = getattr(model_config, "max_position_embeddings", None)
    if positions is not None and cfg.data.seq_len > positions:
        p.append(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's {positions} positions "
            f"(raise model.overrides.max_position_embeddings / n_positions, or lower data.seq_len)"
        )
    vocab = len(tokenizer)
    if vocab > model_config.vocab_size:
        p.append(
            f"tokenizer '{cfg.data.tokenizer}' has {vocab} tokens but the model's vocab_size is "
            f"{model_config.vocab_size}; set model.overrides.vocab_size >= {vocab}"
        )
    if tokenizer.eos_token_id is None:
        p.append(f"tokenizer '{cfg.data.tokenizer}' has no EOS token; documents cannot be separated")
    if getattr(model_config, "output_router_logits", False) and cfg.train.moe_balance != "aux_loss":
        p.append(
            "model.overrides.output_router_logits=true asks for the router's load-balancing loss, which "
            f"train.moe_balance={cfg.train.moe_balance} leaves out; set train.moe_balance=aux_loss (the "
            "recipe then asks for the router logits itself) or drop the override"
        )
    return p


def backend_problems(cfg: Config, layout: Layout) -> list[str]:
    """Settings the launch backend (accelerate config) cannot host."""
    deepspeed = layout.kind == "deepspeed"
    engine = [  # the engine owns its weights (ZeRO partitions) and a fixed accumulation
        f"{key} is not supported under DeepSpeed ({why}): use DDP or FSDP2, or leave it off"
        for key, on, why in (
            ("train.ema_decay", cfg.train.ema_decay is not None, "its engine partitions the weights"),
            ("train.batch_ramp", bool(cfg.train.batch_ramp), "its engine fixes the accumulation steps"),
        )
        if deepspeed and on
    ]
    sync_each = (
        [
            f"train.sync_each_micro_batch=true saves memory under FSDP2 only (under {layout.kind} every rank holds "
            "whole gradients anyway; it would only reduce them more often): remove it"
        ]
        if cfg.train.sync_each_micro_batch and layout.kind != "fsdp2"
        else []
    )
    return (
        engine
        + sync_each
        + guard_problems(cfg.train, engine_steps=deepspeed)
        + checkpoint_problems(cfg.checkpoint.format, cfg.checkpoint.async_save, deepspeed=deepspeed)
        + muon_problems(cfg.optim, layout)
    )


def auto_batch_problems(cfg: Config, layout: Layout) -> list[str]:
    """train.micro_batch_size=auto: the pre-flight plan of this run on its GPU picks it (plan/preflight.py)."""
    import torch

    if cfg.train.micro_batch_size != "auto":
        return []
    why = [
        (not torch.cuda.is_available(), "it is the largest micro-batch the plan fits in a GPU's memory, and this "
         "machine has no CUDA GPU"),
        (not cfg.train.preflight_plan, "the pre-flight plan picks it: set train.preflight_plan=true"),
        (layout.kind == "deepspeed", "DeepSpeed's engine fixes its micro-batch when it is built"),
        (bool(cfg.train.batch_ramp), "train.batch_ramp's stages need one micro-batch that divides each of them"),
    ]  # fmt: skip
    return [
        f"train.micro_batch_size=auto cannot run here ({reason}): set a number, e.g. --train.micro_batch_size=8"
        for bad, reason in why
        if bad
    ]
