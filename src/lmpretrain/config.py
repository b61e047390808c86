"""One typed config tree: YAML first, then `--section.field=value` overrides, then validation.

Structural problems (unknown keys, wrong types) and cross-field problems (batch arithmetic, schedule,
model/tokenizer limits) are each collected and raised together, so a user fixes everything at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import resource
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from lmpretrain.errors import ConfigError

BLANK_LINES = "blank_lines"  # SourceSpec.separator keyword: documents separated by whitespace-only lines
SOURCE_FORMATS = ("text", "json", "parquet", "tokens")
SHUFFLES = ("global", "windows", "none")  # data.shuffle (true/false from older configs: windows/none)


@dataclass
class SourceSpec:
    name: str | None = None  # builtin registry entry, e.g. "python-stdlib"
    files: list[str] | None = None  # local files/globs/dirs (text: .txt/.md/.py..., json/jsonl, parquet)
    hub: str | None = None  # Hub dataset id (real path; unreachable offline)
    hub_config: str | None = None
    split: str = "train"
    format: str | None = None  # "text" | "json" | "parquet" | "tokens"; inferred from extension when None
    text_field: str = "text"
    separator: str | None = None  # text files: None = one document per file; "blank_lines" = documents
    # end at whitespace-only lines; any other string (e.g. "<|endoftext|>", "\n") = documents end at it
    weight: float = 1.0  # mixing weight among train sources

    @property
    def label(self) -> str:
        if self.name:
            return f"{self.name}:{self.split}"
        if self.hub:
            return f"hub:{self.hub}" + (f"/{self.hub_config}" if self.hub_config else "") + f":{self.split}"
        return "files:" + ",".join(self.files or [])

    def validate(self) -> None:
        given = [k for k in ("name", "files", "hub") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"a data source needs exactly one of name/files/hub, got {given or 'none'}: {self}"
            )
        if self.format is not None and self.format not in SOURCE_FORMATS:
            raise ValueError(f"source {self.label}: format {self.format!r} is not one of {SOURCE_FORMATS}")
        if not self.weight > 0:
            raise ValueError(f"source {self.label}: weight must be > 0, got {self.weight}")
        if isinstance(self.files, str):
            raise ValueError(f"source files must be a list of paths/globs, got the string {self.files!r}")
        if self.separator is not None:
            if not isinstance(self.separator, str) or not self.separator:
                raise ValueError(f"source {self.label}: separator must be a non-empty string or null")
            near = difflib.get_close_matches(self.separator, [BLANK_LINES], n=1, cutoff=0.75)
            if near and self.separator != BLANK_LINES:
                raise ValueError(
                    f"source {self.label}: separator {self.separator!r} is not the keyword {BLANK_LINES!r}; "
                    f"write {BLANK_LINES!r} for documents separated by blank lines"
                )


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
    allow_mismatch: list[str] = field(default_factory=list)
    """Names of the fingerprint differences (data, model, batch) to accept at resume, e.g.
    [micro_batch_size]; a resume that keeps the global batch needs none for world size / batch split."""
    allow_data_change: bool = False
    """Resume with a changed training mixture: data.train weights changed, sources added or removed.
    Unchanged sources continue from their positions; the change is printed (docs/data-sources.md)."""
    threads: int = 0
    """CPU threads per process; 0 = the cores this process may use divided by local processes."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective waits for every rank: a rank that stops (hung, stopped, its node gone) makes
    the others fail after this long, naming it, instead of waiting forever (docs/cluster.md)."""
    stall_report_s: float = 60.0
    """A rank whose step has not moved for this long names the ranks that stopped (no heartbeat) or are
    stuck at an earlier step, once, well before the collectives time out (NCCL's watchdog aborts without
    naming anyone); less than collective_timeout_s."""
    straggler_factor: float | None = 2.0
    """Warn (rank 0's log, at most once per 100 steps) naming a rank whose batch load takes more than this
    many times the other ranks' median, over the last 8 steps; the others wait for it every step.
    null or 0 turns it off (docs/cluster.md)."""
    name: str | None = None
    """Run name in W&B; default: <config file stem>-<output_dir name>."""
    group: str | None = None
    """W&B group, so the runs of a sweep sit together; default: the config file stem."""


@dataclass
class MupConfig:
    base_width: int
    """The hidden size the hyper-parameters were tuned at; the model's own width is its hidden_size."""
    depth: Literal["completep", "sqrt"] | None = None
    """Residual-branch scaling by depth (docs/mup.md): each decoder layer's attention and MLP outputs are
    multiplied by (base_depth / L)^alpha before they join the residual stream, and the decoder layers'
    parameters are trained at lr x (base_depth / L)^(1 - alpha); completep: alpha = 1 (Dey et al. 2025),
    sqrt: alpha = 1/2 (Yang et al., "Tensor Programs VI"). L is the model's num_hidden_layers. null: off."""
    base_depth: int | None = None
    """The number of decoder layers the hyper-parameters were tuned at (with `depth`)."""


@dataclass
class ModelConfig:
    type: str = "llama"
    """transformers model_type for AutoConfig.for_model (llama, gpt2, qwen2, mistral, ...)."""
    overrides: dict = field(default_factory=dict)
    """Fields of that model config (hidden_size, num_hidden_layers, vocab_size, ...)."""
    pretrained: str | None = None
    """A local path or Hub id to continue pretraining from (from_pretrained); overrides still apply."""
    imports: list[str] = field(default_factory=list)
    """Modules imported before the model is built, e.g. a fork's own architecture whose import registers
    it with AutoConfig.register / AutoModelForCausalLM.register (docs/models.md)."""
    trust_remote_code: bool = False
    """Run the modelling code a pretrained checkpoint ships (auto_map in its config.json)."""
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] = "sdpa"
    """Attention kernel passed to transformers: eager | sdpa | flash_attention_2 | flex_attention.
    A kernel that cannot run here (flash-attn missing, no CUDA, not bf16/fp16, model lacks it) is
    refused before any work, except sdpa, the default, which is eager for models without an sdpa path
    (as transformers' own default; Mamba and RWKV have no attention); the one that runs is logged
    ("[lmpretrain] attention: ...")."""
    experts_implementation: Literal["auto", "eager", "batched_mm", "grouped_mm"] = "auto"
    """How a mixture of experts runs its experts (transformers' experts_implementation): eager (a loop over
    the experts hit), batched_mm (one batched matmul over every token's chosen experts), grouped_mm (torch's
    grouped matmul over tokens sorted by expert). auto: grouped_mm, or batched_mm for float64 parameters
    (torch's grouped matmul has no float64). What runs is seen on a probe of one layer's experts and
    logged ("[lmpretrain] experts: ..."); a model without experts accepts only auto (docs/moe.md)."""
    mup: MupConfig | None = None
    """μP by width (docs/mup.md): {base_width: N} scales the hidden matrices' init and AdamW lr, the logits and
    (where the head width grows) the attention scores so that hyper-parameters tuned at width N transfer to
    this model's width; equal to the plain model at width N. null: off."""
    ep_size: int = 1
    """Expert parallelism: each MoE layer's experts split over this many ranks, each token sent to its
    experts' ranks and back by all-to-all (transformers' DistributedConfig ep_size, ep_implementation
    all_to_all). Needs an FSDP2 or HSDP launch; it divides the shard group and the number of experts
    (docs/moe.md)."""


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
    shuffle: str | bool | None = None
    """global: blocks drawn by a seeded permutation of every block of the corpus, a new one per epoch
    (token files only, see docs/data.md) | windows: piece order per epoch, a window shuffle of documents,
    then of packed blocks | none: in order. null = global when every train source is token files, else
    windows. true/false (the former boolean) read as windows/none."""
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
    """BOS before each document; null = as the run's token files were prepared (datatrove's own have none)
    or, with no token files, true when the tokenizer has a BOS token distinct from EOS (the builtin one
    has). The held-out set is framed the same way. Recorded in the resume fingerprint."""
    epoch_offset: bool = True
    """Global shuffle: each epoch's block grid starts at a seeded offset in [0, seq_len) of the source's
    token stream (a function of seed, source and epoch), so epochs see new block boundaries; false = every
    epoch cuts blocks at multiples of seq_len. Part of the resume fingerprint."""
    max_open_files: int = 64
    """Token files: at most this many file descriptors per process (trainer and each worker), over all
    sources, the least recently used closed first, so a corpus of any number of shards fits `ulimit -n`."""
    transforms: list[str] = field(default_factory=list)
    """A fork's functions over each document's text, `module:function` or `path/to/file.py:function`, run in
    order: f(text, source label) returns the text to tokenize or None to drop the document (counted in
    train/filtered_docs). Applied to every text source, training and held-out (token files are read as
    prepared: scripts/prepare_data.py --transform); names and file hashes are in the resume fingerprint
    (docs/forking.md)."""


@dataclass
class RampStage:
    until_tokens: float
    """The stage lasts while fewer than this many tokens have been trained on (YAML may write 2e6)."""
    global_batch: int
    """Blocks per optimizer step during the stage: a multiple of train.micro_batch_size x world size."""


@dataclass
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps (each consumes one global batch)."""
    micro_batch_size: int | Literal["auto"] = 8
    """Sequences per forward/backward on one process; auto (CUDA, with train.global_batch_size): the largest
    the pre-flight plan fits on this GPU that divides the global batch (docs/planning.md)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; global batch = micro x accum x world size. Derived (this value
    ignored) when train.global_batch_size is set."""
    global_batch_size: int | None = None
    """Blocks per optimizer step over all processes; set, grad_accum_steps = global_batch_size /
    (micro_batch_size x world size), which must divide it; null = micro x accum x world size."""
    sync_each_micro_batch: bool = False
    """FSDP2 with grad_accum_steps > 1: reduce-scatter every micro-batch's gradients into the shards (accelerate's
    GradientAccumulationPlugin sync_each_batch) instead of keeping the whole model's unsharded gradients until
    the last one: that much less memory per rank (an 8B model's float32 gradients are 32 GB), the reduce-scatter
    traffic times the accumulation."""
    precision: Literal["no", "bf16", "fp16"] = "no"
    """no | bf16 | fp16 (fp16 uses dynamic loss scaling)."""
    loss_scale_init: float = 65536.0
    """fp16 only: initial dynamic loss scale (halved after each overflow, doubled after 2000 clean steps)."""
    param_dtype: Literal["float32", "float64"] = "float32"
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
    activation_checkpointing: Literal["none", "full", "selective"] | bool = "none"
    """What each block keeps for backward (transformers' checkpointing of each block: non-reentrant, RNG
    state preserved, so dropout masks are replayed and runs resume bit-exactly) | none: every activation
    (fastest, most memory) | full: only the block's input; the whole block is run again in backward (least
    memory, about one extra forward) | selective: the outputs of the matmuls and of the attention kernel,
    recomputing only the cheap elementwise ops between them (norms, activations, residual adds; torch's
    selective checkpointing, with the kinds of ops torchtitan's op-level policy keeps; docs/speed.md).
    false/true read as none/full. Under FSDP2 use this, not the launch config's
    fsdp_activation_checkpointing (refused)."""
    loss_impl: Literal["full", "chunked", "liger"] = "full"
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
    moe_balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    """How a mixture of experts keeps its experts busy (a dense model ignores it; docs/moe.md): aux_loss: the
    model's own load-balancing loss (transformers' load_balancing_loss_func, Switch Transformer's) is a term
    of the objective, weight train.router_aux_loss_coef, logged train/router_aux and eval/router_aux | bias:
    DeepSeek-V3's aux-loss-free balancing, for routers with a per-expert selection bias
    (e_score_correction_bias): after each update every expert's bias moves by train.moe_bias_rate toward an
    even load | none: nothing balances the experts."""
    router_aux_loss_coef: float | None = None
    """Weight of the load-balancing term per target token (train.moe_balance=aux_loss); null = the model
    config's own router_aux_loss_coef (Qwen3-MoE and Mixtral 0.001, OLMoE 0.01)."""
    router_z_loss: float = 0.0
    """ST-MoE's router z-loss: adds router_z_loss * mean over tokens and MoE layers of logsumexp(router
    logits)^2, logged as train/router_z and eval/router_z; 0 = off."""
    moe_bias_rate: float = 0.001
    """train.moe_balance=bias: how far an expert's selection bias moves after each update (DeepSeek-V3's
    0.001): up for an expert below the mean load of its layer, down for one above."""
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
    on_spike: Literal["skip", "rollback"] = "skip"
    """What a spike the guard flags (with skip_spikes) does: skip: that step's update is not applied |
    rollback: the last checkpoint is reloaded and the data read since it (up to and including the
    spike) is skipped, never trained on (the PaLM recipe); see docs/checkpoints.md."""
    max_rollbacks: int = 3
    """Rollbacks a run may make (with on_spike=rollback); one more spike stops it as diverged (exit 2)."""
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """float32 | bfloat16: the dtype FSDP2 reduce-scatters gradients in when precision=bf16 (whose
    policy all-gathers bf16 parameters from fp32 shards; docs/gpu.md). bfloat16 halves the traffic."""
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """none | tensorwise | rowwise: train the blocks' large Linear layers in float8 through torchao
    (CUDA compute capability >= 8.9, train.compile, pip install -e .[gpu]; the rule in docs/gpu.md)."""
    ema_decay: float | None = None
    """An exponential moving average of every trainable parameter (fp32; float64 with param_dtype=float64),
    ema = decay * ema + (1 - decay) * weights after each applied update, evaluated at each eval as
    eval/ema/* and exported to final-ema/; null = off (docs/averaging.md)."""
    ema_start: int = 0
    """Updates up to this step copy the weights into the EMA, so the average starts from step ema_start."""
    batch_ramp: list[RampStage] = field(default_factory=list)
    """Stages of smaller global batches at the start, [{until_tokens: N, global_batch: B}, ...] (B in
    blocks), then micro_batch_size x grad_accum_steps x world size; [] = the constant batch."""
    batch_ramp_lr: Literal["sqrt", "linear", "constant"] = "sqrt"
    """The lr during a ramp stage: the schedule's x (B / final batch)^(1/2 | 1 | 0)."""
    preflight_plan: bool = True
    """CUDA only: before the model is built, plan the run on this GPU (python -m lmpretrain.plan, a CPU
    subprocess of a minute or so) and stop, naming the micro-batch that fits, if its peak memory exceeds the
    device's (docs/planning.md); false skips it. CPU runs never plan."""
    profile_steps: list[int] | None = None
    """[start, end]: a torch.profiler trace of steps start..end (Chrome/Perfetto JSON) and on CUDA a
    memory snapshot in <output_dir>/profile/; null = off. A CUDA out-of-memory writes a snapshot too."""

    def __post_init__(self):
        # Configs written before the selective mode said true/false; the rest of the code sees the mode only.
        if isinstance(self.activation_checkpointing, bool):
            self.activation_checkpointing = "full" if self.activation_checkpointing else "none"


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon", "normuon"] = "adamw"
    """adamw | muon: Muon (momentum orthogonalised by Newton-Schulz) for every 2-D weight matrix inside the
    transformer blocks, AdamW for embeddings, the output head, norms and biases | normuon: Muon with each
    output neuron's orthogonalised update normalised by a running mean square (docs/muon.md). The optim.muon_*
    settings apply to both."""
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
    schedule: Literal["cosine", "wsd", "linear", "constant"] = "cosine"
    """cosine | wsd (warmup-stable-decay) | linear | constant, after the linear warmup; a function of the
    updates applied and the current config, so changing it (or lr, min_lr, warmup, max_steps) at resume works."""
    decay_fraction: float = 0.2
    """wsd: the last round(decay_fraction * train.max_steps) steps decay to optim.min_lr, along 1 - sqrt."""
    muon_momentum: float = 0.95
    """optim.name=muon: the matrices' (Nesterov) momentum."""
    muon_ns_steps: int = 5
    """optim.name=muon: Newton-Schulz iterations that orthogonalise each matrix's update."""
    muon_lr_scale: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """optim.name=muon: match_rms_adamw scales a matrix's lr (optim.lr) by 0.2 * sqrt(max(rows, cols)), so its
    update has AdamW's RMS and the lr tuned for AdamW carries over | original: optim.muon_lr times
    sqrt(max(1, rows / cols)) (Keller Jordan's). Both follow the schedule's shape."""
    muon_lr: float = 0.02
    """optim.name=muon with muon_lr_scale=original: the matrices' peak lr."""
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """optim.name=muon: the Newton-Schulz iteration's dtype. auto = bfloat16 on CUDA, float32 on CPUs (bf16
    matmul is slow without AMX), the parameters' dtype when they are float64."""
    muon_spread: Literal["auto", "always", "never"] = "auto"
    """optim.name=muon at world size > 1: spread the orthogonalisation over the ranks (each matrix on one
    rank; FSDP2: two all-to-alls, DDP: one all-gather of the results) | never: every rank does every matrix.
    auto: always under FSDP2, under DDP when a stated roofline says the compute saved exceeds the
    all-gather's time (docs/muon.md). The start-up line says which runs."""
    muon_coefficients: Literal["quintic", "polar_express"] = "quintic"
    """optim.name=muon/normuon: the Newton-Schulz coefficients. quintic: Keller Jordan's, the same at every
    step | polar_express: a tuned (a, b, c) per step (Amsel et al. 2025), closer to orthogonal after 5 steps;
    made for muon_ns_steps=5 (fewer steps stop it early, later steps repeat its last)."""
    normuon_beta2: float = 0.95
    """optim.name=normuon: decay of each neuron's running mean square of its orthogonalised update."""


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
    format: Literal["auto", "full", "sharded"] = "auto"
    """full: one file of whole weights and optimizer state | sharded: torch.distributed.checkpoint, each
    rank writes its shards (resumes onto any process count) | auto: sharded under FSDP2, else full."""
    async_save: bool = False
    """Write checkpoints in the background while training continues; a checkpoint is committed only once
    every rank's write is complete (costs a CPU copy of what is written; not under DeepSpeed)."""


@dataclass
class LoggingConfig:
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """online | offline | disabled; online falls back to offline without an API key or network."""
    wandb_project: str = "lmpretrain"
    every: int = 10
    """Console log line every N steps (metrics.jsonl and W&B get every step)."""
    bytes_at_step: int = 0
    """Count what optimizer step N really sends and holds on each rank (observe/step_bytes.py): bytes received
    per collective kind and bytes of parameters, gradients and optimizer state, logged once at that step as
    comm/<kind>_bytes and memory/<kind>_bytes (what `python -m lmpretrain.plan` predicts); 0: off."""


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
        if self.train.global_batch_size is not None:
            return self.train.global_batch_size
        return self.train.micro_batch_size * self.train.grad_accum_steps * world_size


# ----------------------------------------------------------------------------------------------
# Building dataclasses from plain data, with every problem collected


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value, tp, where: str, problems: list[str]):
    """Return `value` as type `tp`, appending a problem (and returning None) when it does not fit."""
    origin = typing.get_origin(tp)
    if origin is Literal:  # the one place each set of allowed values is written
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        near = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        problems.append(f"{where}={value!r} must be one of {', '.join(map(str, allowed))}{hint}")
        return None
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        exact = [a for a in inner if type(value) is a]  # `str | bool`: a bool stays a bool
        first = (exact or inner)[0]
        # `int | Literal["auto"]`: the first type the value fits
        for tp in [first] + [a for a in inner if a is not first]:
            tried: list[str] = []
            coerced = _coerce(value, tp, where, tried)
            if not tried:
                return coerced
        return _coerce(value, first, where, problems)
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
    """`over`'s keys over `base`'s, mappings merged key by key; a null in `over` deletes the key from
    `base` (the field's default then applies; a model.overrides entry is dropped)."""
    out = dict(base)
    for key, value in over.items():
        if value is None and key in out:
            del out[key]
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_config_file(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """A training YAML as a mapping. One that starts with `base: other.yaml` (relative to its own folder)
    is that file's mapping with its own keys over it, a null deleting a key of the base."""
    path = Path(path)
    chain = (*_chain, path.resolve())
    if not path.is_file():
        if _chain:
            raise ConfigError([f"{_chain[-1]}: base {path} does not exist"])
        raise ConfigError([f"config file {path} does not exist (shipped: configs/*.yaml)"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError([f"{path} is not valid YAML: {err}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path} must hold a mapping of sections, got {type(data).__name__}"])
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError([f"{path}: base must be the path of another training YAML, got {base!r}"])
    parent = (path.parent / Path(base).expanduser()).resolve()
    if parent in chain:
        cycle = " -> ".join(str(p) for p in (*chain[chain.index(parent) :], parent))
        raise ConfigError([f"{path}: its bases form a cycle: {cycle}"])
    return _merge(read_config_file(parent, chain), data)


def with_sections(sections: dict[str, type] | None) -> type[Config]:
    """Config plus a fork's own sections ({"mtp": MTPConfig}: dataclasses with defaults), which then get
    YAML and command-line overrides, type checks, did-you-mean, config.yaml and W&B like ours. A section given
    as `dict` is read as a plain mapping: what the planner does with a fork's sections, whose classes it lacks."""
    if not sections:
        return Config
    taken = {f.name for f in dataclasses.fields(Config)} & set(sections)
    if taken:
        raise ConfigError(
            [f"a recipe section cannot reuse the name of a built-in one: {', '.join(sorted(taken))}"]
        )
    for name, cls in sections.items():
        if not dataclasses.is_dataclass(cls) and cls is not dict:
            raise ConfigError([f"recipe section {name!r} must be a dataclass, got {cls!r}"])
    extra = [(name, cls, field(default_factory=cls)) for name, cls in sections.items()]
    return dataclasses.make_dataclass("Config", extra, bases=(Config,))


def fork_sections(cfg: Config) -> list[str]:
    """The names of the config sections a fork added (with_sections), in order."""
    builtin = {f.name for f in dataclasses.fields(Config)}
    return [f.name for f in dataclasses.fields(cfg) if f.name not in builtin]


def load_config(argv: list[str], sections: dict[str, type] | None = None, transforms=()) -> Config:
    """`argv` = [path/to/config.yaml, --section.field=value, ...] -> a typed Config (or ConfigError).

    `sections`: a fork's own config sections, see `with_sections`; `transforms`: a forked recipe's data
    transforms (functions), named in data.transforms before the config's own."""
    if not argv or argv[0].startswith("--"):
        raise ConfigError(["the first argument must be a config YAML, e.g. configs/smoke.yaml"])
    path = Path(argv[0])
    data = _merge(read_config_file(path), parse_overrides(argv[1:]))
    data.pop("provenance", None)  # a saved config.yaml records what trained it; not a setting
    problems: list[str] = []
    run = data.get("run")
    if isinstance(run, dict) and isinstance(run.get("allow_mismatch"), bool):  # the former switch
        from lmpretrain.run.fingerprint import accepted_names

        problems.append(
            f"run.allow_mismatch={run.pop('allow_mismatch')} is no longer a switch: it takes the names of the "
            "resume differences to accept (the refusal names them), e.g. --run.allow_mismatch=[micro_batch_size], "
            f"from: {accepted_names(list(sections or ()))}"
        )
    cfg = _build(with_sections(sections), data, "", problems)
    if problems:
        raise ConfigError(problems, source=str(path))
    cfg.config_path = str(path)
    if transforms:
        from lmpretrain.data.transforms import transform_name

        names = [transform_name(f) for f in transforms]
        cfg.data.transforms = names + [n for n in cfg.data.transforms if n not in names]
    return cfg


def save_config(cfg: Config, path: Path, provenance: dict | None = None) -> None:
    """The resolved config, plus what trained the run (recipe, commit, packages) under `provenance`."""
    data = cfg.to_dict()
    if provenance:
        data["provenance"] = provenance
    path.write_text(yaml.safe_dump(data, sort_keys=False))


# ----------------------------------------------------------------------------------------------
# Cross-field rules, checked once at start-up


def data_problems(data: DataConfig, world_size: int) -> list[str]:
    """Every rule of the data section that needs only the config and the world size, named by config key."""
    p: list[str] = []
    if data.seq_len < 2:
        p.append("data.seq_len must be >= 2 (a block needs an input and a next-token target)")
    if data.num_streams < 1:
        p.append("data.num_streams must be >= 1")
    elif data.num_streams % world_size:
        p.append(
            f"data.num_streams={data.num_streams} must be a multiple of the world size {world_size} "
            f"(each process owns num_streams/world_size streams); try --data.num_streams="
            f"{world_size * max(1, -(-data.num_streams // world_size))}"
        )
    elif data.num_workers > data.num_streams // world_size:
        p.append(
            f"data.num_workers={data.num_workers} exceeds the {data.num_streams // world_size} streams each "
            "process owns (data.num_streams / world size; each worker owns whole streams); lower it or raise "
            "data.num_streams"
        )
    if data.num_workers < 0:
        p.append("data.num_workers must be >= 0")
    if data.shuffle not in (None, True, False, "true", "false", *SHUFFLES):
        p.append(
            f"data.shuffle must be one of {SHUFFLES} or null (the default for the sources), got {data.shuffle!r}"
        )
    for key in ("shuffle_window", "doc_shuffle_window"):
        if getattr(data, key) < 1:
            p.append(f"data.{key} must be >= 1")
    if data.max_open_files < 1:
        p.append("data.max_open_files must be >= 1")
    else:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and data.max_open_files > soft // 2:
            p.append(
                f"data.max_open_files={data.max_open_files} leaves too few of this process's {soft} file "
                f"descriptors (ulimit -n) to the rest of the run; lower it to {max(1, soft // 4)} or raise "
                "ulimit -n"
            )
    if not data.train:
        p.append("data.train needs at least one source")
    if not data.eval:
        p.append("data.eval needs at least one held-out source (a separate split or file set)")
    for section, sources in (("data.train", data.train), ("data.eval", data.eval)):
        for i, source in enumerate(sources):
            try:
                source.validate()
            except ValueError as err:
                p.append(f"{section}[{i}]: {err}")
    return p


def config_problems(cfg: Config, world_size: int) -> list[str]:
    """Every rule that needs only the config and the world size."""
    p: list[str] = []
    t, o, d = cfg.train, cfg.optim, cfg.data
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
        value = getattr(getattr(cfg, section), name)
        if value != "auto" and value < 1:
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
        "train.router_z_loss",
        "logging.bytes_at_step",
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
    if t.router_aux_loss_coef is not None and t.router_aux_loss_coef < 0:
        p.append("train.router_aux_loss_coef must be >= 0 (null: the model config's own)")
    if not t.moe_bias_rate > 0:
        p.append("train.moe_bias_rate must be > 0")
    if not t.spike_sigma > 0:
        p.append("train.spike_sigma must be > 0")
    if t.on_spike == "rollback" and not t.skip_spikes:
        p.append("train.on_spike=rollback acts on the spikes train.skip_spikes=true detects: set both")
    if t.max_rollbacks < 0:
        p.append("train.max_rollbacks must be >= 0")
    if not cfg.run.collective_timeout_s > 0:
        p.append("run.collective_timeout_s must be > 0")
    if not 0 < cfg.run.stall_report_s < cfg.run.collective_timeout_s:
        p.append(
            f"run.stall_report_s={cfg.run.stall_report_s:g} must be > 0 and less than "
            f"run.collective_timeout_s={cfg.run.collective_timeout_s:g}: it names a stopped rank before they end the run"
        )
    if cfg.run.straggler_factor and not cfg.run.straggler_factor > 1:
        p.append("run.straggler_factor must be > 1 (how many times slower than the others), or null/0 (off)")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        p.append("optim.beta1 and optim.beta2 must be in [0, 1)")
    if o.name == "normuon" and not 0 <= o.normuon_beta2 < 1:
        p.append(f"optim.normuon_beta2={o.normuon_beta2} must be in [0, 1)")
    if o.name in ("muon", "normuon") and not (
        0 <= o.muon_momentum < 1 and o.muon_ns_steps >= 1 and o.muon_lr > 0
    ):
        p.append(
            f"optim.muon_momentum={o.muon_momentum} must be in [0, 1), optim.muon_ns_steps={o.muon_ns_steps} "
            f">= 1 and optim.muon_lr={o.muon_lr} > 0"
        )
    if t.profile_steps is not None and not (
        len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1]
    ):
        p.append(
            f"train.profile_steps={t.profile_steps} must be [start, end] with 1 <= start <= end, or null"
        )
    if t.ema_decay is not None and not 0 < t.ema_decay < 1:
        p.append(f"train.ema_decay={t.ema_decay} must be in (0, 1), or null (no EMA)")
    if t.ema_start < 0:
        p.append("train.ema_start must be >= 0")
    if cfg.model.mup is not None:
        if cfg.model.mup.base_width < 1:
            p.append(
                f"model.mup.base_width={cfg.model.mup.base_width} must be >= 1 (the width the lr was tuned at)"
            )
        depth, base_depth = cfg.model.mup.depth, cfg.model.mup.base_depth
        if depth and base_depth is None:
            p.append(
                f"model.mup.depth={depth} needs model.mup.base_depth (the number of layers the lr was tuned at)"
            )
        if base_depth is not None and base_depth < 1:
            p.append(
                f"model.mup.base_depth={base_depth} must be >= 1 (the number of layers the lr was tuned at)"
            )
        elif base_depth is not None and not depth:
            p.append(
                f"model.mup.base_depth={base_depth} does nothing without model.mup.depth (completep or sqrt)"
            )
        if depth and t.fp8 != "none":
            p.append(
                f"model.mup.depth scales the o_proj/down_proj outputs by forward hooks, which train.fp8={t.fp8} would "
                "drop when it swaps those layers for torchao's Float8Linear: set train.fp8=none or model.mup.depth=null"
            )
        if cfg.model.pretrained:
            p.append(
                "model.mup changes the initialisation and the logits' scale: it starts a model from scratch, "
                "not model.pretrained (unset one of them)"
            )
    if cfg.model.ep_size < 1:
        p.append(f"model.ep_size={cfg.model.ep_size} must be >= 1 (1: every rank holds every expert)")
    p += batch_problems(t, world_size)
    p += ramp_problems(t, world_size)
    if t.fsdp_reduce_dtype != "float32" and t.precision != "bf16":
        p.append(
            f"train.fsdp_reduce_dtype={t.fsdp_reduce_dtype} belongs to FSDP2's bf16 policy and would do nothing "
            f"with train.precision={t.precision}: set train.precision=bf16 or leave it at float32"
        )
    if t.fp8 != "none" and not t.compile:
        p.append(
            f"train.fp8={t.fp8} needs train.compile=true: torchao's float8 casts and scaling are fast only "
            "when compiled into the blocks (eager float8 is slower than bf16)"
        )
    p += data_problems(d, world_size)
    return p


def batch_problems(t: TrainConfig, world_size: int) -> list[str]:
    """train.global_batch_size splits into micro-batches on every rank; micro_batch_size=auto needs it."""
    gbs, micro = t.global_batch_size, t.micro_batch_size
    if gbs is None:
        need = "train.micro_batch_size=auto picks the micro-batch for a stated global batch: set train.global_batch_size"
        return [need] if micro == "auto" else []
    if gbs < 1 or gbs % world_size:
        return [f"train.global_batch_size={gbs} must be a positive multiple of the world size {world_size}"]
    if micro != "auto" and micro >= 1 and gbs % (micro * world_size):
        fits = [m for m in range(micro, 0, -1) if (gbs // world_size) % m == 0][0]
        return [
            f"train.global_batch_size={gbs} is not a multiple of train.micro_batch_size x world size = "
            f"{micro} x {world_size}: set --train.micro_batch_size={fits} (or a global batch that divides)"
        ]
    return []


def derive_accumulation(t: TrainConfig, world_size: int) -> None:
    """With train.global_batch_size (and a micro-batch size that divides it): grad_accum_steps from it."""
    gbs, micro = t.global_batch_size, t.micro_batch_size
    if gbs is not None and micro != "auto" and micro >= 1 and gbs >= 1 and gbs % (micro * world_size) == 0:
        t.grad_accum_steps = gbs // (micro * world_size)


def ramp_problems(t: TrainConfig, world_size: int) -> list[str]:
    """train.batch_ramp: every stage's batch splits into micro-batches on every rank; stages in order."""
    p: list[str] = []
    split = t.micro_batch_size * world_size if t.micro_batch_size != "auto" else 0
    bad = [
        f"stage {i} (until_tokens {s.until_tokens:g}) global_batch={s.global_batch}"
        for i, s in enumerate(t.batch_ramp)
        if s.global_batch < 1 or (split > 0 and s.global_batch % split)
    ]
    if bad:
        p.append(
            f"train.batch_ramp: a stage's global_batch must be a positive multiple of train.micro_batch_size x "
            f"world size = {split} (its micro-batches are accumulated on every rank); not: {'; '.join(bad)}"
        )
    until = [s.until_tokens for s in t.batch_ramp]
    if any(u <= 0 or u != int(u) for u in until) or until != sorted(set(until)):
        p.append(f"train.batch_ramp: until_tokens must be whole, positive and increasing, got {until}")
    return p
