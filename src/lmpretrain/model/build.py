"""Build any transformers causal LM from a model type + overrides, or from a pretrained checkpoint."""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import (
    CONFIG_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
)

from lmpretrain.errors import ConfigError
from lmpretrain.layout import Layout
from lmpretrain.model.experts import chosen_implementation

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def build_model_config(model_cfg, tokenizer=None) -> PretrainedConfig:
    """AutoConfig for `model.type` (or `model.pretrained`) with `model.overrides` applied and checked.

    Overrides go to the config's constructor, so derived fields follow them (Llama's head_dim is
    hidden_size / num_attention_heads). AutoConfig accepts any keyword silently; an override that is
    not a field of the model's config would be ignored, so it is an error naming the nearest field.
    A config built from `model.type` takes bos/eos/pad_token_id from `tokenizer` (the model type's
    defaults are another tokenizer's ids), unless model.overrides sets them; a pretrained model keeps its own.
    """
    # use_cache: training never reuses a KV cache; generation asks for one explicitly. The attention
    # kernel rides on the config (not saved with it), so from_config/from_pretrained build with it.
    overrides = {
        "use_cache": False,
        "attn_implementation": model_cfg.attn_implementation,
        **model_cfg.overrides,
    }
    if tokenizer is not None and not model_cfg.pretrained:
        overrides = {**{name: getattr(tokenizer, name) for name in SPECIAL_TOKENS}, **overrides}
    if model_cfg.pretrained:  # one load: from_pretrained hands back the overrides it could not apply
        config, unused = AutoConfig.from_pretrained(
            model_cfg.pretrained,
            return_unused_kwargs=True,
            trust_remote_code=model_cfg.trust_remote_code,
            **overrides,
        )
        _refuse_unknown_overrides(config, unused)
        return _with_experts(config, model_cfg)
    if model_cfg.type not in CONFIG_MAPPING:
        near = difflib.get_close_matches(model_cfg.type, list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
        raise ConfigError(
            [
                f"model.type={model_cfg.type!r} is not a registered model type"
                + (f" (nearest: {', '.join(near)})" if near else "")
                + ". A model of your own: register its config and model class with AutoConfig.register / "
                "AutoModelForCausalLM.register in a module and list it in model.imports (docs/models.md)"
            ]
        )
    _refuse_unknown_overrides(AutoConfig.for_model(model_cfg.type), model_cfg.overrides)
    return _with_experts(AutoConfig.for_model(model_cfg.type, **overrides), model_cfg)


def _with_experts(config: PretrainedConfig, model_cfg) -> PretrainedConfig:
    """model.experts_implementation rides on the config as the attention kernel does (not saved with
    it); auto leaves it unset, for build_model to choose (experts.chosen_implementation)."""
    if model_cfg.experts_implementation != "auto":
        config._experts_implementation = model_cfg.experts_implementation
    return config


def import_model_modules(model_cfg) -> None:
    """Import `model.imports` (a fork's modules, whose AutoConfig/AutoModelForCausalLM.register calls then
    take effect) before the model config is built: module names, or paths of .py files (imported under
    their file name). One that cannot be imported is a ConfigError."""
    problems = []
    for name in model_cfg.imports:
        try:
            if name.endswith(".py"):
                path = Path(name).expanduser().resolve()
                spec = importlib.util.spec_from_file_location(path.stem, path)
                if spec is None or not path.is_file():
                    raise ImportError(f"no such file: {path}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[path.stem] = module  # as an import would: pickles and repeated imports find it
                spec.loader.exec_module(module)
            else:
                importlib.import_module(name)
        except ImportError as err:
            problems.append(
                f"model.imports: cannot import {name!r} ({err}); give a module name on PYTHONPATH or the "
                f"path of a .py file"
            )
    if problems:
        raise ConfigError(problems)


def contract_problems(cfg, model_class: type | None, layout: Layout) -> list[str]:
    """What the model class must offer for the switches that are on (docs/models.md), named by the piece
    that is missing."""
    kind = cfg.model.type if not cfg.model.pretrained else cfg.model.pretrained
    if model_class is None:
        return [
            f"model {kind!r} has no causal LM class registered with AutoModelForCausalLM; register one "
            f"(AutoModelForCausalLM.register(YourConfig, YourForCausalLM)) in a module listed in model.imports"
        ]
    name, p = model_class.__name__, []
    needs_blocks = [why for on, why in ((cfg.train.compile, "train.compile"), (layout.fsdp, "FSDP")) if on]
    if needs_blocks and not getattr(model_class, "_no_split_modules", None):
        p.append(
            f"{name}._no_split_modules is empty: {' and '.join(needs_blocks)} find the transformer blocks by the "
            f"class names it lists"
        )
    checkpointing = cfg.train.activation_checkpointing
    if checkpointing != "none" and not getattr(model_class, "supports_gradient_checkpointing", False):
        p.append(
            f"train.activation_checkpointing={checkpointing}: {name}.supports_gradient_checkpointing is not "
            f"true; set train.activation_checkpointing=none or implement it"
        )
    if cfg.train.loss_impl != "full" and not callable(getattr(model_class, "get_output_embeddings", None)):
        p.append(f"train.loss_impl={cfg.train.loss_impl}: {name} has no get_output_embeddings()")
    return p


def refuse_unfound_embedding(model, cfg, layout: Layout) -> None:
    """Raise (ConfigError) where FSDP2 or μP need the built model's input embedding and transformers'
    `get_input_embeddings()` cannot find it: it looks for `embed_tokens` (or the class's `_input_embed_layer`)
    on the model and its base model and raises NotImplementedError for any other name, which accelerate's
    FSDP2 wrapping would meet only after the build, inside its own code."""
    users = [
        why
        for on, why in (
            (layout.kind == "fsdp2", "FSDP2 (accelerate shards the embedding as a unit of its own)"),
            (cfg.model.mup, "model.mup (the embedding keeps its init and lr)"),
        )
        if on
    ]
    if not users:
        return
    try:
        found = isinstance(model.get_input_embeddings(), nn.Module)
    except NotImplementedError:
        found = False
    if not found:
        name = type(model).__name__
        raise ConfigError(
            [
                f"{name}.get_input_embeddings() does not find the input embedding, which {' and '.join(users)} "
                f"needs: set _input_embed_layer = '<its attribute name>' on the class (transformers looks on the "
                f"model and its base model) or define get_input_embeddings() (docs/models.md)"
            ]
        )


def _refuse_unknown_overrides(config: PretrainedConfig, keys) -> None:
    """Raise naming each of ``keys`` that is not a field of ``config`` (AutoConfig would ignore it)."""
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {})) | _optional_fields(config)
    named = []
    for key in (k for k in keys if k not in known):
        near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        named.append(f"model.overrides.{key}" + (f" (did you mean '{near[0]}'?)" if near else ""))
    if named:
        raise ConfigError([f"unknown field(s) for a {config.model_type} config: {', '.join(named)}"])


def _optional_fields(config: PretrainedConfig) -> set[str]:
    """Fields the model's code reads only when a config has them (`getattr(config, "head_dim", default)`: Qwen3-MoE's
    config class has no head_dim, the Hub's Qwen3-30B-A3B config.json sets 128)."""
    model_class = causal_lm_class(config)
    return _fields_read_by(model_class.__module__) if model_class is not None else set()


@functools.cache
def _fields_read_by(module: str) -> frozenset[str]:
    """The config fields a modeling module reads with getattr (its source read once per process)."""
    source = inspect.getsource(sys.modules[module])
    return frozenset(re.findall(r"getattr\(\s*(?:self\.)?config,\s*[\"'](\w+)[\"']", source))


def causal_lm_class(config: PretrainedConfig) -> type | None:
    """The transformers class AutoModelForCausalLM builds for `config` (None if it has none)."""
    return MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)


def attention_kernel(config: PretrainedConfig) -> str:
    """The attention kernel a model of `config` is built with: the configured one, except that sdpa
    (the default) means eager for a class without an sdpa path (Mamba, RWKV: no attention at all), as
    transformers' own default does."""
    kernel, model_class = config._attn_implementation, causal_lm_class(config)
    if kernel == "sdpa" and model_class is not None and not model_class._supports_sdpa:
        return "eager"
    return kernel


def build_model(
    config: PretrainedConfig,
    pretrained: str | None = None,
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> nn.Module:
    """Weights from `pretrained`, else a fresh init from the (seeded) global RNG.

    Parameters stay in `dtype` (fp32 master weights); autocast lowers only the compute. The attention
    kernel is `attention_kernel(config)` (checked by `speed.kernel_problems`); a mixture of experts' experts
    run as `experts.chosen_implementation` says (seen on a probe by `experts.describe_experts`).
    """
    dtype = getattr(torch, dtype)
    kernel = attention_kernel(config)
    experts = chosen_implementation(config, dtype, causal_lm_class(config))
    extra = {"experts_implementation": experts} if experts else {}
    if pretrained:
        return AutoModelForCausalLM.from_pretrained(
            pretrained,
            config=config,
            dtype=dtype,
            attn_implementation=kernel,
            trust_remote_code=trust_remote_code,
            **extra,
        )
    model = AutoModelForCausalLM.from_config(
        config, dtype=dtype, attn_implementation=kernel, trust_remote_code=trust_remote_code, **extra
    )
    # transformers keeps some modules in float32 whatever the dtype (`_keep_in_fp32_modules_strict`, e.g.
    # DeepSeek-V3's router): a float64 run (the equality tests) is float64 throughout, as FSDP2 shards one
    # dtype per unit. Only where needed: the planner builds under a fake mode, whose tensors cannot be swapped.
    if dtype == torch.float64 and any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)
    return model


def parameter_counts(model: nn.Module) -> dict:
    """Total / trainable / embedding parameters (tied weights counted once)."""
    params = {id(p): p for p in model.parameters()}
    embedding = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total = sum(p.numel() for p in params.values())
    return {
        "params_total": total,
        "params_trainable": sum(p.numel() for p in params.values() if p.requires_grad),
        "params_embedding": sum(params[i].numel() for i in embedding if i in params),
        "params_non_embedding": total - sum(params[i].numel() for i in embedding if i in params),
    }
