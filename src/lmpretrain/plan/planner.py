"""A plan: the config checked as the recipe's pre-flight checks it, one simulated step, the roofline, the
largest micro-batch that fits, as a printed table and as the JSON of `--json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lmpretrain.config import Config, config_problems, derive_accumulation, fork_sections
from lmpretrain.errors import ConfigError
from lmpretrain.gpus import GPU
from lmpretrain.layout import Layout
from lmpretrain.model.build import build_model_config, import_model_modules
from lmpretrain.observe.flops import flops_per_token, table_dtype
from lmpretrain.plan.fit import FitOption, fit_options
from lmpretrain.plan.hardware import PlanError
from lmpretrain.plan.roofline import OVERLAP, Timing, step_time
from lmpretrain.plan.simulate import Step, simulate
from lmpretrain.preflight import backend_problems
from lmpretrain.run.expert_parallel import ep_problems

# Kernels that cannot run on this CPU; sdpa stands in (FlashAttention-class memory: no S x S scores kept).
_STAND_INS = {"flash_attention_2": "sdpa", "flex_attention": "sdpa"}


@dataclass
class Plan:
    cfg: Config
    launch: Layout
    gpu: GPU
    memory_fraction: float
    step: Step
    timing: Timing
    model_flops_per_token: float
    max_micro_batch: int
    split: tuple[int, int] | None  # (micro_batch_size, grad_accum_steps) keeping the global batch
    notes: list[str]
    fit_options: list[FitOption]  # where no micro-batch fits: the changes that do, cheapest first

    @property
    def fits(self) -> bool:
        return self.step.total_peak <= self.memory_fraction * self.gpu.memory_bytes

    @property
    def tokens_per_step_per_gpu(self) -> int:
        t = self.cfg.train
        return t.micro_batch_size * t.grad_accum_steps * self.cfg.data.seq_len

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step_per_gpu / self.timing.step_s

    @property
    def tokens_per_s(self) -> float:
        """The whole run's: every GPU's tokens per second."""
        return self.tokens_per_s_per_gpu * self.launch.num_processes

    @property
    def peak_dtype(self) -> str:
        return peak_dtype(self.cfg)

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_gpu * self.model_flops_per_token / self.gpu.peak_flops(self.peak_dtype)

    def to_json(self) -> dict:
        s = self.step
        return {
            "world_size": self.launch.num_processes,
            "replica_groups": self.launch.replicas,
            "gpu": self.gpu.key,
            "per_rank_bytes": {
                "params": s.params,
                "grads": s.grads,
                "optimizer": s.optimizer,
                "ema": s.ema,
                "activations_peak": s.activations_peak,
                "buffers": s.buffers,
                "total_peak": s.total_peak,
            },
            "comm_bytes_per_step": {k: round(v) for k, v in s.comm.items()},
            "flops_per_step": dict(s.flops),
            "step_time_s": self.timing.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "fit_options": [o.to_json() for o in self.fit_options],
        }


def check_config(cfg: Config, launch: Layout) -> None:
    """The recipe's own rules for this world size and backend (batch arithmetic, streams per rank, Muon
    under DeepSpeed, ...): one ConfigError naming each, exit 2."""
    problems = config_problems(cfg, launch.num_processes) + backend_problems(cfg, launch)
    if problems:
        raise ConfigError(problems, source=f"{cfg.config_path} at {launch.num_processes} processes")


def peak_dtype(cfg: Config) -> str:
    """The dtype of the run's matmuls, whose peak times the step and is the MFU's basis as in the recipe's MFU
    (observe/flops.py): the precision's, fp8 with train.fp8."""
    return table_dtype(cfg.train.precision, fp8=cfg.train.fp8 != "none")


def check_hardware(cfg: Config, launch: Layout, gpu: GPU) -> None:
    """The launch must fit the GPU's machines, and the GPU must run the config's matmuls."""
    if launch.ranks_per_machine > gpu.gpus_per_node:
        raise PlanError(
            f"{launch.num_processes} processes on {launch.num_machines} machine(s) is {launch.ranks_per_machine} "
            f"GPUs per machine, but one {gpu.key} machine holds {gpu.gpus_per_node} (gpus_per_node): pass "
            f"--num_machines {-(-launch.num_processes // gpu.gpus_per_node)}"
        )
    dtype = peak_dtype(cfg)
    if gpu.peak_flops(dtype) is None:
        raise PlanError(
            f"--gpu {gpu.key}: {gpu.name} has no {dtype} peak in the GPU table (its tensor cores do not run "
            f"{dtype} matmuls), which train.precision={cfg.train.precision}, train.fp8={cfg.train.fp8} need"
        )


def largest_micro_batch(peak_at, step: Step, micro_batch: int, budget: float, search_limit: int) -> int:
    """The largest micro-batch whose simulated peak fits `budget` bytes. `peak_at(m)`: the total peak of the step
    simulated at m rows. What grows with the rows (activations, temporaries, chunked logits per chunk) and what
    does not (parameters, gradients, gathered weights, optimizer state, the optimizer step's own peak) are told
    apart by simulating: the line through the planned micro-batch and one row more gives a first answer, which
    is then narrowed between a micro-batch that fits and one that does not (each next guess on the line between
    them) until they are one row apart, so that planning at the answer says it fits and at one row more it does
    not. Past `search_limit` rows (more than a step gives a rank) the line's answer stands."""
    if step.step_peak > budget:
        return 0
    peaks = {0: 0.0, micro_batch: step.total_peak}

    def peak(m: int) -> float:
        if m not in peaks:
            peaks[m] = peak_at(m)
        return peaks[m]

    per_row = peak(micro_batch + 1) - peak(micro_batch)
    if per_row <= 0:
        return max(micro_batch, search_limit)
    guess = max(1, micro_batch + int((budget - peak(micro_batch)) // per_row))
    if guess > search_limit:
        return guess
    fits = max([m for m in peaks if peaks[m] <= budget])
    over = min([m for m in peaks if peaks[m] > budget], default=None)
    while over is None:  # the line's answer fits: double it until one does not
        if peak(guess) <= budget:
            fits, guess = guess, 2 * guess
        else:
            over = guess
    while over - fits > 1:
        slope = (peak(over) - peak(fits)) / (over - fits)
        guess = min(over - 1, max(fits + 1, fits + int((budget - peak(fits)) // slope)))
        if peak(guess) <= budget:
            fits = guess
        else:
            over = guess
    return fits


def batch_split(rows_per_rank: int, max_micro: int) -> tuple[int, int] | None:
    """The largest micro-batch <= max_micro that divides this rank's rows per step, and its accumulation."""
    for micro in range(min(max_micro, rows_per_rank), 0, -1):
        if rows_per_rank % micro == 0:
            return micro, rows_per_rank // micro
    return None


def make_plan(cfg: Config, launch: Layout, gpu: GPU, memory_fraction: float = 0.9) -> Plan:
    if not 0 < memory_fraction <= 1:
        raise PlanError(f"--memory_fraction={memory_fraction} must be in (0, 1]")
    launch = dataclasses.replace(launch, experts=cfg.model.ep_size)  # the model section sets it, as in a run
    check_hardware(cfg, launch, gpu)
    check_config(cfg, launch)
    import_model_modules(cfg.model)  # a fork's model classes register with the Auto classes, as in the recipe
    notes = []
    if fork_sections(cfg):
        notes.append(
            f"a fork's config sections ({', '.join(fork_sections(cfg))}) are read, not simulated: the step runs the "
            "recipe's objective, without a fork's own loss terms or auxiliary modules"
        )
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train))  # resolved below, the caller's kept
    derive_accumulation(cfg.train, launch.num_processes)  # train.global_batch_size
    if cfg.train.micro_batch_size == "auto":  # what the recipe's pre-flight resolves on its GPU
        cfg.train.micro_batch_size, cfg.train.grad_accum_steps = 1, cfg.global_batch(launch.num_processes)
        cfg.train.grad_accum_steps //= launch.num_processes
        notes.append(
            "train.micro_batch_size=auto: simulated at 1 row per micro-batch; a run takes the largest micro-batch "
            "that fits and divides its rows per step (the split below)"
        )
    kernel = cfg.model.attn_implementation
    if kernel in _STAND_INS:
        notes.append(
            f"attention {kernel} simulated as {_STAND_INS[kernel]} (same memory class; this CPU runs no {kernel})"
        )
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, attn_implementation=_STAND_INS[kernel])
        )
    if cfg.train.compile:
        notes.append(
            "train.compile: simulated eager (compile's fusions save some activation memory the plan does not see)"
        )
    if cfg.train.fp8 != "none":
        notes.append(f"train.fp8={cfg.train.fp8}: bytes simulated in bf16; compute timed at the fp8 peak")
    if cfg.train.loss_impl == "liger":
        notes.append("train.loss_impl=liger simulated as chunked (the same never-whole logits)")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_impl="chunked"))
    model_config = build_model_config(cfg.model)  # no tokenizer: the vocabulary is the model config's
    problems = ep_problems(cfg, model_config, launch)  # model.ep_size, as the recipe's pre-flight checks it
    if problems:
        raise ConfigError(problems, source=f"{cfg.config_path} at {launch.num_processes} processes")
    step = simulate(cfg, model_config, launch, cfg.train.micro_batch_size, gpu=gpu)
    timing = step_time(step, gpu, launch, cfg.train.grad_accum_steps, peak_dtype(cfg))
    per_token, _ = flops_per_token(
        model_config, cfg.data.seq_len
    )  # the recipe's MFU basis (observe/flops.py)
    budget = memory_fraction * gpu.memory_bytes
    rows = cfg.train.micro_batch_size * cfg.train.grad_accum_steps

    def peak_at(micro: int) -> float:
        return simulate(cfg, model_config, launch, micro, gpu=gpu).total_peak

    max_micro = largest_micro_batch(
        peak_at, step, cfg.train.micro_batch_size, budget, search_limit=max(4 * rows, 1024)
    )
    options = [] if max_micro else fit_options(cfg, model_config, launch, gpu, budget, peak_dtype(cfg))
    return Plan(
        cfg,
        launch,
        gpu,
        memory_fraction,
        step,
        timing,
        per_token or 0.0,
        max_micro,
        batch_split(rows, max_micro),
        notes,
        options,
    )


def _gb(n: float) -> str:
    return f"{n / 1e9:8.2f} GB" if abs(n) >= 1e8 else f"{n / 1e6:8.2f} MB"


def format_plan(plan: Plan) -> str:
    s, t, cfg, launch, gpu = plan.step, plan.timing, plan.cfg, plan.launch, plan.gpu
    budget = plan.memory_fraction * gpu.memory_bytes
    tr = cfg.train
    lines = [
        f"plan: {cfg.config_path} on {launch.num_processes} x {gpu.key} ({gpu.name}), {launch.num_machines} "
        f"machine(s), sharding={launch.describe()}"
        + (f" (reshard_after_forward={launch.reshard_after_forward})" if launch.kind == "fsdp2" else ""),
        f"  step: micro {tr.micro_batch_size} x accum {tr.grad_accum_steps} x {launch.num_processes} ranks x "
        f"{cfg.data.seq_len} tokens = {cfg.global_batch(launch.num_processes) * cfg.data.seq_len:,} tokens; "
        f"precision {tr.precision}, optimizer {cfg.optim.name}, activation checkpointing "
        f"{tr.activation_checkpointing}, loss {tr.loss_impl}",
        "memory per rank (rank 0 of the fake process group; torch MemTracker categories at the peak):",
        f"  params          {_gb(s.params)}",
        f"  grads           {_gb(s.grads)}",
        f"  optimizer       {_gb(s.optimizer)}",
        *(
            [f"  ema             {_gb(s.ema)}  (train.ema_decay: the moving average of this rank's weights)"]
            if s.ema
            else []
        ),
        f"  activations     {_gb(s.activations_peak)}  (at the peak)",
        f"  buffers         {_gb(s.buffers)}  (gathered weights/grads, collective and DDP buckets, temporaries)",
        f"  total peak      {_gb(s.total_peak)}  vs {plan.memory_fraction:g} x {gpu.memory_gib:g} GiB = "
        f"{_gb(budget).strip()}: {'fits' if s.total_peak <= budget else 'DOES NOT FIT'}",
        f"  of which: peak during the micro-batches {_gb(s.micro_batch_peak).strip()}, during the optimizer "
        f"step {_gb(s.step_peak).strip()}",
        "communication per step, bytes received per rank:",
    ]
    for kind, value in s.comm.items():
        if kind != "muon" and value:
            lines.append(f"  {kind:15} {_gb(value)}  ({t.comm_s.get(kind, 0) * 1e3:.1f} ms)")
    if cfg.optim.name in ("muon", "normuon"):
        kinds = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in s.muon_comm.items() if v) or "none"
        lines.append(
            f"  muon            {_gb(s.comm['muon'])}  ({t.comm_s.get('muon', 0) * 1e3:.1f} ms; {kinds})"
        )
    f = s.flops
    lines += [
        "FLOPs per step per rank (torch FlopCounterMode, executed: recomputation included):",
        f"  forward {f['forward']:.4g}  backward {f['backward']:.4g}  optimizer {f['optimizer']:.4g}"
        " (Newton-Schulz matmuls; AdamW's elementwise work is not counted)",
        f"roofline ({gpu.key}, {plan.peak_dtype} peak {gpu.peak_flops(plan.peak_dtype) / 1e12:g} TFLOP/s): compute "
        f"{t.compute_s * 1e3:.1f} ms, HBM {t.hbm_s * 1e3:.1f} ms, "
        f"collectives at {t.link}",
        f"  overlap: {OVERLAP}; exposed {t.exposed_comm_s * 1e3:.1f} ms",
        f"  step {t.step_s:.3f} s, {plan.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, {plan.tokens_per_s:,.0f} for "
        f"the whole run ({launch.num_processes} GPUs), MFU {plan.mfu:.1%} "
        f"(model FLOPs {plan.model_flops_per_token:.4g}/token as observe/flops.py counts them)"
        + ("" if plan.fits else "; of a step that does not fit: no run makes it"),
        f"largest micro-batch within {plan.memory_fraction:g} of {gpu.memory_gib:g} GiB: {plan.max_micro_batch}",
    ]
    if plan.split:
        lines.append(
            f"  keeping the global batch: --train.micro_batch_size={plan.split[0]} "
            f"--train.grad_accum_steps={plan.split[1]}"
        )
    else:
        lines.append(
            "  no micro-batch fits; the changes that do, planned (cheapest first: most tokens/s per GPU):"
        )
        for option in plan.fit_options:
            lines.append(
                f"    {option.change}: peak {_gb(option.total_peak).strip()}, {option.tokens_per_s_per_gpu:,.0f} "
                f"tokens/s per GPU, {option.tokens_per_s:,.0f} for the whole run ({option.num_processes} GPUs)"
            )
        if not plan.fit_options:
            lines.append("    none of: stronger activation checkpointing, more shards")
        lines.append("    or a shorter data.seq_len (not planned: it changes what is trained)")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
