"""One typed config tree: YAML first, then `--section.field=value` overrides, then validation.

Structural problems (unknown keys, wrong types) and cross-field problems (batch arithmetic, schedule,
model/tokenizer limits) are each collected and raised together, so a user fixes everything at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lmpretrain.data import SourceSpec, data_problems
from lmpretrain.errors import ConfigError


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    """Where config.yaml, metrics.jsonl, checkpoints/, final/ and wandb/ go."""
    seed: int = 1337
    """Seeds model init, data order and every RNG (saved in checkpoints)."""
    resume: str = "auto"
    """auto: newest valid checkpoint in output_dir; never: start fresh; or a checkpoint path."""
    overwrite: bool = False
    """With resume=never, allow starting fresh in an output_dir that already has checkpoints."""
    allow_mismatch: bool = False
    """Resume a checkpoint whose fingerprint (data, model, world size, batch) differs."""
    threads: int = 0
    """CPU threads per process; 0 = the cores this process may use divided by local processes."""
    name: str | None = None
    """Run name in W&B; default: <config file stem>-<output_dir name>."""
    group: str | None = None
    """W&B group, so the runs of a sweep sit together; default: the config file stem."""


@dataclass
class ModelConfig:
    type: str = "llama"
    """transformers model_type for AutoConfig.for_model (llama, gpt2, qwen2, mistral, ...)."""
    overrides: dict = field(default_factory=dict)
    """Fields of that model config (hidden_size, num_hidden_layers, vocab_size, ...)."""
    pretrained: str | None = None
    """A local path or Hub id to continue pretraining from (from_pretrained); overrides still apply."""
    attn_implementation: str = "sdpa"
    """Attention kernel passed to transformers: eager | sdpa | flash_attention_2 | flex_attention.
    A kernel that cannot run here (flash-attn missing, no CUDA, not bf16/fp16, model lacks it) is
    refused before any work, except sdpa, the default, which is eager for models without an sdpa path
    (as transformers' own default; Mamba and RWKV have no attention); the one that runs is logged
    ("[lmpretrain] attention: ...")."""


@dataclass
class DataConfig:
    train: list[SourceSpec] = field(default_factory=lambda: [SourceSpec(name="python-stdlib")])
    """Training sources, mixed by weight."""
    eval: list[SourceSpec] = field(
        default_factory=lambda: [SourceSpec(name="python-stdlib", split="validation")]
    )
    """Held-out sources: a separate split or file set, never training examples."""
    tokenizer: str = "builtin:python-stdlib"
    """A local tokenizer dir, a Hub id, or builtin:python-stdlib (built on first use)."""
    seq_len: int = 256
    """Tokens per packed block (model context length during training)."""
    num_workers: int = 0
    """Background dataloader workers per process (prefetch + tokenization); changes only speed."""
    num_streams: int = 8
    """Virtual data streams; fixed for a run so data order is independent of world size/workers."""
    shuffle: bool = True
    """Piece order per epoch, a window shuffle of documents, then a window shuffle of packed blocks."""
    shuffle_window: int = 64
    """Blocks per block-shuffle window (a restore re-reads at most this plus one document window)."""
    doc_shuffle_window: int = 64
    """Documents per document-shuffle window (and at most 8 KiB of text per document in a window): each
    window's documents are permuted with the seed before packing."""
    document_masking: bool = False
    """Attention never crosses a document boundary inside a packed block, and positions restart at
    each document (a document starts after each EOS): position_ids restart, from which transformers
    builds a block-causal mask (sdpa, eager, flex_attention) or flash-attention's varlen path (the
    micro-batch as one row). Checked at start-up on three packed documents; refused for models that
    cannot do it. Evaluation masks the same way."""
    add_bos: bool | None = None
    """BOS before each document; null = true when the tokenizer has a BOS token distinct from EOS (the
    builtin one has). Recorded in the resume fingerprint."""


@dataclass
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps (each consumes one global batch)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one process."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; global batch = micro x accum x world size."""
    precision: str = "no"
    """no | bf16 | fp16 (fp16 uses dynamic loss scaling)."""
    loss_scale_init: float = 65536.0
    """fp16 only: initial dynamic loss scale (halved after each overflow, doubled after 2000 clean steps)."""
    param_dtype: str = "float32"
    """Parameters and optimizer state: float32, or float64 for numerical equivalence checks (slow)."""
    max_grad_norm: float = 1.0
    """Global L2 norm limit; 0 disables clipping (the norm is still logged)."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing."""
    mask_cross_doc_targets: bool = False
    """Ignore (-100) each document's first token as a target: it cannot be predicted from the previous one."""
    compile: bool = False
    """torch.compile each transformer block in place (regional compilation: one graph shared by all
    blocks, parameter names unchanged); compiled during the first steps, whose time is logged once as
    perf/compile_s (benchmarks skip those steps). Sample generation stays eager."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (transformers' checkpointing: non-reentrant,
    RNG state preserved, so dropout runs match and resume bit-exactly): less memory, about one extra
    forward. Under FSDP2 use this, not the launch config's fsdp_activation_checkpointing (refused)."""
    loss_impl: str = "full"
    """full: logits of the whole micro-batch, then fp32 cross-entropy | chunked: cross-entropy from the
    final hidden states through the output embedding, loss_chunk_tokens rows at a time, gradients
    computed chunk by chunk (never the full fp32 logits; rows without a target are skipped) | liger:
    Liger's fused linear cross-entropy (CUDA and the liger-kernel package). chunked/liger are refused
    for models that post-process their logits (soft-capping, scaling), checked at start-up."""
    loss_chunk_tokens: int = 2048
    """Rows of the chunked loss (peak logits memory = chunk x vocab x 4 bytes, x2 with the softmax)."""
    z_loss: float = 0.0
    """Adds z_loss * mean(logsumexp(logits)^2) over target tokens (OLMo's z-loss), normalised like the
    loss across micro-batches and ranks; logged as train/z_loss (the added term); 0 = off."""
    max_skipped_steps: int = 10
    """Stop (exit 2) after this many consecutive skipped updates (non-finite loss or gradient, spikes);
    fp16 overflows the loss scaler answers by halving its scale (while it is >= 1) do not count."""
    skip_spikes: bool = False
    """Skip the update of a step whose loss exceeds mean + spike_sigma * std of the last spike_window steps."""
    spike_sigma: float = 6.0
    """Spike threshold in standard deviations of the recent losses (with skip_spikes)."""
    spike_window: int = 100
    """Applied steps of loss history the spike threshold is computed over, judged once half of it is
    filled (with skip_spikes; saved in checkpoints)."""


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    min_lr: float = 3e-5
    """Floor of the cosine decay."""
    warmup_steps: int = 100
    """Linear warmup steps; must be < train.max_steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (never biases or norm weights)."""
    decay_embeddings: bool = False
    """Also decay embedding matrices."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    fused: bool = True
    """torch's fused AdamW where the device supports it, else the foreach implementation (same update;
    checkpoints load across the two). The one that runs is logged at start-up."""
    schedule: str = "cosine"
    """cosine | wsd (warmup-stable-decay) | linear | constant, after the linear warmup; a function of the
    updates applied and the current config, so changing it (or lr, min_lr, warmup, max_steps) at resume works."""
    decay_fraction: float = 0.2
    """wsd: the last round(decay_fraction * train.max_steps) steps decay to optim.min_lr, along 1 - sqrt."""


@dataclass
class EvalConfig:
    every: int = 100
    """Evaluate every N steps (and at the end); 0 = only at the end."""
    batches: int = 8
    """Held-out set size in batches of eval.batch_size blocks (fixed for the run)."""
    batch_size: int = 8
    """Blocks per eval forward pass."""
    prompt: str = "def "
    """Prompt of the sample generation logged at each eval."""
    sample_tokens: int = 48
    """New tokens generated (greedy) for the sample; 0 disables samples."""
    tasks: list[str] = field(default_factory=list)
    """Downstream tasks scored on the live model by lm-evaluation-harness: its task names, task YAML paths,
    or builtin:python_next_line (docs/evaluation.md). Logged as eval/<task>/<metric>."""
    tasks_every: int = 0
    """Run eval.tasks every N steps (a multiple of eval.every) and at the end; 0 = only at the end."""
    tasks_limit: int | None = None
    """Examples per task (its first N documents); null = all."""
    tasks_fewshot: int = 0
    """Few-shot examples in each prompt (a task whose own config pins 0-shot stays 0-shot)."""


@dataclass
class CheckpointConfig:
    every: int = 200
    """Save every N steps (and at the end, and on SIGTERM/SIGINT); 0 = only at the end / on signal."""
    keep_last: int = 2
    """Checkpoints kept besides the best by eval loss."""
    format: str = "auto"
    """full: one file of whole weights and optimizer state | sharded: torch.distributed.checkpoint, each
    rank writes its shards (resumes onto any process count) | auto: sharded under FSDP2, else full."""
    async_save: bool = False
    """Write checkpoints in the background while training continues; a checkpoint is committed only once
    every rank's write is complete (costs a CPU copy of what is written; not under DeepSpeed)."""


@dataclass
class LoggingConfig:
    wandb_mode: str = "online"
    """online | offline | disabled; online falls back to offline without an API key or network."""
    wandb_project: str = "lmpretrain"
    every: int = 10
    """Console log line every N steps (metrics.jsonl and W&B get every step)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    config_path: str | None = None
    """The YAML this config came from (set by load_config)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def global_batch(self, world_size: int) -> int:
        return self.train.micro_batch_size * self.train.grad_accum_steps * world_size


CHOICES = {
    "train.precision": ("no", "bf16", "fp16"),
    "train.param_dtype": ("float32", "float64"),
    "train.loss_impl": ("full", "chunked", "liger"),
    "model.attn_implementation": ("eager", "sdpa", "flash_attention_2", "flex_attention"),
    "optim.schedule": ("cosine", "wsd", "linear", "constant"),
    "checkpoint.format": ("auto", "full", "sharded"),
    "logging.wandb_mode": ("online", "offline", "disabled"),
}


# ----------------------------------------------------------------------------------------------
# Building dataclasses from plain data, with every problem collected


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, where: str, problems: list[str]):
    """Return `value` as type `tp`, appending a problem (and returning None) when it does not fit."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, where, problems)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{where}: expected a mapping of {sorted(_fields(tp))}, got {value!r}")
            return None
        return _build(tp, value, where, problems)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, (str, dict)) or value is None:
            value = [value] if value is not None else []
        if not isinstance(value, list):
            problems.append(f"{where}: expected a list, got {value!r}")
            return None
        return [_coerce(v, inner, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if tp is dict:
        if isinstance(value, dict):
            return dict(value)
        problems.append(f"{where}: expected a mapping, got {value!r}")
        return None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads `1e-3` as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    problems.append(f"{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return None


def _fields(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _build(cls, data: dict, where: str, problems: list[str]):
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys: {', '.join(fields)}"
            problems.append(f"unknown key '{name}'{hint}")
            continue
        kwargs[key] = _coerce(value, fields[key], name, problems)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:  # e.g. a SourceSpec with neither name, files nor hub
        problems.append(f"{where or cls.__name__}: {err}")
        return None


def parse_overrides(args: list[str]) -> dict:
    """`--train.max_steps=20 --optim.lr 1e-3` -> {"train": {"max_steps": 20}, "optim": {"lr": "1e-3"}}."""
    tree: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError([f"unexpected argument {arg!r}; overrides look like --section.field=value"])
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, raw = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError([f"override {arg!r} has no value; write --{arg[2:]}=VALUE"])
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
        i += 1
    return tree


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(argv: list[str]) -> Config:
    """`argv` = [path/to/config.yaml, --section.field=value, ...] -> a typed Config (or ConfigError)."""
    if not argv or argv[0].startswith("--"):
        raise ConfigError(["the first argument must be a config YAML, e.g. configs/smoke.yaml"])
    path = Path(argv[0])
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist (shipped: configs/*.yaml)"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError([f"{path} is not valid YAML: {err}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path} must hold a mapping of sections, got {type(data).__name__}"])
    data = _merge(data, parse_overrides(argv[1:]))
    problems: list[str] = []
    cfg = _build(Config, data, "", problems)
    if problems:
        raise ConfigError(problems, source=str(path))
    cfg.config_path = str(path)
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ----------------------------------------------------------------------------------------------
# Cross-field rules, checked once at start-up


def config_problems(cfg: Config, world_size: int) -> list[str]:
    """Every rule that needs only the config and the world size."""
    p: list[str] = []
    t, o, d = cfg.train, cfg.optim, cfg.data
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            p.append(f"{key}={value!r} must be one of {', '.join(allowed)}")
    if t.loss_scale_init <= 0:
        p.append("train.loss_scale_init must be > 0")
    for key in (
        "train.max_steps",
        "train.micro_batch_size",
        "train.grad_accum_steps",
        "eval.batches",
        "eval.batch_size",
        "checkpoint.keep_last",
        "logging.every",
        "train.loss_chunk_tokens",
        "train.max_skipped_steps",
        "train.spike_window",
    ):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 1:
            p.append(f"{key} must be >= 1")
    for key in (
        "eval.every",
        "checkpoint.every",
        "run.threads",
        "eval.sample_tokens",
        "optim.warmup_steps",
        "optim.weight_decay",
        "train.max_grad_norm",
        "train.z_loss",
    ):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 0:
            p.append(f"{key} must be >= 0")
    if o.warmup_steps >= t.max_steps:
        p.append(f"optim.warmup_steps={o.warmup_steps} must be < train.max_steps={t.max_steps}")
    if not 0 < o.lr:
        p.append("optim.lr must be > 0")
    if not 0 <= o.min_lr <= o.lr:
        p.append(f"optim.min_lr={o.min_lr} must be between 0 and optim.lr={o.lr}")
    if not 0 <= t.label_smoothing < 1:
        p.append("train.label_smoothing must be in [0, 1)")
    if not 0 < o.decay_fraction <= 1:
        p.append(f"optim.decay_fraction={o.decay_fraction} must be in (0, 1]")
    if not t.spike_sigma > 0:
        p.append("train.spike_sigma must be > 0")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        p.append("optim.beta1 and optim.beta2 must be in [0, 1)")
    p += data_problems(d, world_size)
    return p


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
    if getattr(model_config, "output_router_logits", False):
        p.append(
            "model.overrides.output_router_logits=true asks for the router's load-balancing loss, which the "
            "recipe's loss (the language-model loss only) would silently leave out; set it to false"
        )
    from lmpretrain.model.speed import kernel_problems  # here: it loads transformers' model registry

    return p + kernel_problems(cfg, model_config)
