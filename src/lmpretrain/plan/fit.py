"""Where no micro-batch fits: the ways that would, each planned, and the cheapest of them.

A plan that does not fit at one row per micro-batch is only useful if it says what to change. The changes tried
are the ones that keep the model and the global batch: recompute more activations (train.activation_checkpointing
`selective`, then `full`) and shard the weights over more GPUs (DDP or DeepSpeed: FSDP2 on the same GPUs; FSDP2:
twice the GPUs; HSDP: twice the shards per replica group). Each is simulated like the plan itself at the largest
micro-batch that fits it and divides the rows per rank, and timed on the same roofline; the cheapest is the one
with the most tokens/s per GPU (more GPUs cost GPUs: per GPU is the price of a token). Under FSDP2, where one row per
micro-batch fits only without the whole model's unsharded gradients that accumulation keeps between
micro-batches, each is planned with train.sync_each_micro_batch (the gradients reduce-scattered every
micro-batch), and so is the run itself. A shorter sequence changes what is trained and is named, not planned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lmpretrain.config import config_problems
from lmpretrain.layout import Layout
from lmpretrain.plan.roofline import step_time
from lmpretrain.plan.simulate import simulate
from lmpretrain.preflight import backend_problems

_STRONGER = {"none": ("selective", "full"), "selective": ("full",), "full": ()}
_TRIES = 3  # micro-batches simulated below the line's guess before settling on 1 row


@dataclass(frozen=True)
class FitOption:
    change: str  # the overrides / launch flags that make it
    activation_checkpointing: str
    sync_each_micro_batch: bool
    launch: Layout
    micro_batch: int
    grad_accum: int
    total_peak: int
    tokens_per_s_per_gpu: float

    @property
    def num_processes(self) -> int:
        return self.launch.num_processes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_s_per_gpu * self.num_processes

    def to_json(self) -> dict:
        return {
            "change": self.change,
            "sharding": self.launch.describe(),
            "num_processes": self.num_processes,
            "micro_batch_size": self.micro_batch,
            "sync_each_micro_batch": self.sync_each_micro_batch,
            "grad_accum_steps": self.grad_accum,
            "total_peak": self.total_peak,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tokens_per_s": self.tokens_per_s,
        }


def _more_shards(launch: Layout, gpus_per_node: int) -> tuple[Layout, str] | None:
    """The same run with its weights split over more GPUs, and the flags that launch it."""
    if launch.kind in ("ddp", "deepspeed"):
        return (
            Layout("fsdp2", launch.num_processes, launch.num_machines, experts=launch.experts),
            "--config_file configs/accelerate/fsdp.yaml (FSDP2 on the same GPUs)",
        )
    if launch.hsdp:
        replicas = launch.replicas // 2
        return (
            dataclasses.replace(launch, replicas=replicas),
            f"parallelism_config: {replicas} replica groups x {launch.shards * 2} shards",
        )
    if launch.kind in ("none", "fsdp2"):
        world = 2 * launch.num_processes
        machines = -(-world // gpus_per_node)
        return (
            Layout(
                "fsdp2",
                world,
                machines,
                reshard_after_forward=launch.reshard_after_forward,
                experts=launch.experts,
            ),
            f"--config_file configs/accelerate/fsdp.yaml --num_processes {world} --num_machines {machines}",
        )
    return None


def _fitting(cfg, model_config, launch: Layout, gpu, rows: int, budget: float):
    """(micro, accum, step, sync_each) at the largest micro-batch that fits `budget` and divides `rows`, or
    None; under FSDP2, where one row per micro-batch fits only without the unsharded gradients accumulation
    keeps, with train.sync_each_micro_batch (sync_each True)."""
    # Not planner.largest_micro_batch's exact search (which imports this module): a divisor of the rows near
    # the line's guess, a few simulations per option, is enough to price an option.

    def at(micro: int, sync_each: bool):  # `rows` rows per rank in micro-batches of `micro`, as a run does
        train = dataclasses.replace(
            cfg.train,
            micro_batch_size=micro,
            grad_accum_steps=max(1, rows // micro),
            sync_each_micro_batch=sync_each,
        )
        return simulate(dataclasses.replace(cfg, train=train), model_config, launch, micro, gpu=gpu)

    sync_each = cfg.train.sync_each_micro_batch
    one = at(1, sync_each)
    if one.total_peak > budget and rows > 1 and launch.kind == "fsdp2" and not sync_each:
        sync_each = True
        one = at(1, sync_each)
    if one.total_peak > budget:
        return None
    if rows == 1:
        return 1, 1, one, False
    per_row = at(2, sync_each).total_peak - one.total_peak
    guess = rows if per_row <= 0 else min(rows, 1 + int((budget - one.total_peak) // per_row))
    for micro in [m for m in range(guess, 1, -1) if rows % m == 0][:_TRIES]:
        step = at(micro, sync_each)
        if step.total_peak <= budget:
            return micro, rows // micro, step, sync_each and micro < rows
    return 1, rows, one, sync_each


def fit_options(cfg, model_config, launch: Layout, gpu, budget: float, dtype: str) -> list[FitOption]:
    """Each change that makes this plan fit, planned, the cheapest (most tokens/s per GPU) first."""
    rows = cfg.train.micro_batch_size * cfg.train.grad_accum_steps  # per rank per step
    tried = [
        (
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, activation_checkpointing=mode)),
            launch,
            rows,
            f"--train.activation_checkpointing={mode}",
        )
        for mode in _STRONGER[cfg.train.activation_checkpointing]
    ]
    if launch.kind == "fsdp2" and rows > 1 and not cfg.train.sync_each_micro_batch:
        tried.insert(0, (cfg, launch, rows, ""))  # the same run, its gradients reduced every micro-batch
    sharded = _more_shards(launch, gpu.gpus_per_node)
    if sharded:
        wider, flags = sharded
        grown = wider.num_processes // launch.num_processes
        if rows % grown:
            flags += f" (the global batch grows {grown}x: {rows} rows per rank do not split)"
        tried.append((cfg, wider, max(1, rows // grown), flags))
    options = []
    for option_cfg, option_launch, option_rows, change in tried:
        checked = dataclasses.replace(
            option_cfg,
            train=dataclasses.replace(
                option_cfg.train, micro_batch_size=1, grad_accum_steps=option_rows, global_batch_size=None
            ),
        )
        if config_problems(checked, option_launch.num_processes) or backend_problems(checked, option_launch):
            continue  # not a launch the recipe would run (streams per rank, ...)
        found = _fitting(option_cfg, model_config, option_launch, gpu, option_rows, budget)
        if found is None:
            continue
        micro, accum, step, sync_each = found
        if not (change or sync_each):
            continue  # the run as planned, which does not fit
        timing = step_time(step, gpu, option_launch, accum, dtype)
        tokens = micro * accum * cfg.data.seq_len / timing.step_s
        flags = f"{change} --train.micro_batch_size={micro} --train.grad_accum_steps={accum}".strip()
        if sync_each:
            flags += " --train.sync_each_micro_batch=true"
        mode = option_cfg.train.activation_checkpointing
        options.append(
            FitOption(flags, mode, sync_each, option_launch, micro, accum, step.total_peak, tokens)
        )
    return sorted(options, key=lambda o: -o.tokens_per_s_per_gpu)
