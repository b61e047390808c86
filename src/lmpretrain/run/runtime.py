"""Process setup: the Accelerator, CPU threads, seeding, and refusing launches that silently degrade.

Verified traps this module exists for (accelerate 1.15): `accelerate launch` exports OMP_NUM_THREADS=1,
so a CPU run uses one core; `--cpu --num_processes 2` and a MULTI_CPU config start ONE process; plain
`--multi_gpu` without GPUs starts unsynchronised copies; an FSDP config on CPU quietly runs DDP (the
recipe turns accelerate's own FSDP2 on there instead, see `build_accelerator`); a launch config's
gradient_accumulation_steps or gradient_clipping silently overrides the recipe's; and
`accelerator.unwrap_model` imports DeepSpeed (with its "Setting accelerator to CPU" banner) in every run
where it is installed (also inside its FSDP2 prepare), so non-DeepSpeed launches tell it DeepSpeed is
absent (`_leave_deepspeed_unimported`).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import psutil
import torch
import torch.distributed as dist
import yaml
from accelerate import Accelerator, ParallelismConfig, PartialState
from accelerate.utils import (
    DeepSpeedPlugin,
    DistributedType,
    FullyShardedDataParallelPlugin,
    set_seed,
)
from torch.nn.parallel import DistributedDataParallel

from lmpretrain.config import derive_accumulation
from lmpretrain.errors import LaunchError, UserError
from lmpretrain.launch import report_lost_peer, report_user_error
from lmpretrain.layout import Layout
from lmpretrain.run.preemption import watch_launcher
from lmpretrain.run.process_group import process_group_kwargs, restart_count

# The DeepSpeed ZeRO stages this recipe runs: parameters stay whole on every rank, so checkpoints and
# exports read them directly. Stage 3 shards parameters too; use FSDP (configs/accelerate/fsdp.yaml) for that.
DEEPSPEED_STAGES = (1, 2)


@dataclass
class RuntimeInfo:
    layout: Layout  # how the run is laid out over its processes (lmpretrain/layout.py)
    rank: int
    distributed_type: str
    backend: str | None
    device: str
    threads: int
    restarts: int = 0  # torch elastic's restarts of this launch's process group so far
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.layout.num_processes

    @property
    def local_world_size(self) -> int:
        return self.layout.ranks_per_machine

    def describe(self) -> str:
        sharding = self.layout.describe()
        if self.layout.fsdp and self.device.split(":")[0] == "cpu":
            sharding += " (accelerate's FSDP2 over gloo, switched on by the recipe on cpu)"
        return (
            f"world_size={self.world_size} distributed_type={self.distributed_type} backend={self.backend} "
            f"device={self.device} threads/process={self.threads} sharding={sharding}"
        )

    def facts(self) -> dict:
        """For the run config (W&B, metrics): the processes and how the run is laid out over them."""
        facts = {k: v for k, v in vars(self).items() if k != "layout"}
        sharding = {"sharding": self.layout.describe(), "layout": dataclasses.asdict(self.layout)}
        return {"world_size": self.world_size, "local_world_size": self.local_world_size, **facts, **sharding}

    def startup_lines(self) -> list[str]:
        """The run's first lines: the processes, and on a restart which one it is."""
        lines = [self.describe()]
        if self.restarts:  # torch elastic restarted every rank after one failed (launch --max_restarts)
            lines.append(
                f"restart {self.restarts} of at most {self.max_restarts}: resuming the last complete checkpoint"
            )
        return lines


def has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def launch_requested(flag: str) -> bool:
    """What `accelerate launch` asked for (ACCELERATE_USE_FSDP, ...), read the way accelerate reads it."""
    return os.environ.get(flag, "false").lower() == "true"


def build_accelerator(train, log_with=None, timeout_s: float = 1800) -> Accelerator:
    """The Accelerator for this launch; ``train`` (TrainConfig) owns accumulation, clipping and precision;
    a collective waits at most ``timeout_s`` seconds for every rank (run/process_group.py).

    Our loop does autocast and loss scaling itself (accelerate's are no-ops on CPU), so accelerate's
    mixed precision stays off, except under DeepSpeed, whose engine owns precision, clipping and the step.
    """
    accum = train.grad_accum_steps
    if not launch_requested("ACCELERATE_USE_DEEPSPEED"):
        _leave_deepspeed_unimported()
    fsdp = launch_requested("ACCELERATE_USE_FSDP")
    if fsdp and not has_accelerator():
        return _cpu_fsdp2_accelerator(train, log_with, timeout_s)
    if not launch_requested("ACCELERATE_USE_DEEPSPEED"):
        # cpu=True on a machine without GPUs turns a torchrun-style multi-process launch into a real gloo
        # process group; without it each process runs alone (verified with --multi_gpu on CPU).
        return Accelerator(
            cpu=not has_accelerator(),
            log_with=log_with,
            mixed_precision="no",
            gradient_accumulation_plugin=_accumulation(train, accum),
            fsdp_plugin=_fsdp_plugin(train) if fsdp else None,
            kwargs_handlers=[process_group_kwargs(timeout_s)],
        )
    if importlib.util.find_spec("deepspeed") is None:
        raise LaunchError(
            "the launch config asks for DeepSpeed but it is not installed: pip install -r requirements.txt"
        )
    plugin = DeepSpeedPlugin(gradient_accumulation_steps=accum, gradient_clipping=train.max_grad_norm)
    # DeepSpeed runs on CPU through its CPU accelerator over gloo; accelerate only wires DeepSpeed up
    # with cpu=False, and then needs the backend named (it would assume a GPU's).
    backend = None if has_accelerator() else "gloo"
    accelerator = Accelerator(
        log_with=log_with,
        mixed_precision=train.precision,
        deepspeed_plugin=plugin,
        gradient_accumulation_steps=accum,
        kwargs_handlers=[process_group_kwargs(timeout_s, backend)],
    )
    # No dataloader goes through accelerate.prepare, so DeepSpeed learns the micro-batch here.
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = (
        train.micro_batch_size
    )
    return accelerator


def _fsdp_plugin(train) -> FullyShardedDataParallelPlugin:
    """The launch config's FSDP settings (its FSDP_* variables) with, under FSDP2, the recipe's
    mixed-precision policy (model/sharded_precision.py); accelerate's own stays off (mixed_precision="no")."""
    from lmpretrain.model.sharded_precision import fsdp_policy

    if os.environ.get("FSDP_VERSION", "1") != "2":  # read as accelerate's plugin reads it
        return FullyShardedDataParallelPlugin()
    return FullyShardedDataParallelPlugin(mixed_precision_policy=fsdp_policy(train))


def _cpu_fsdp2_accelerator(train, log_with, timeout_s) -> Accelerator:
    """FSDP2 on CPU processes over gloo, sharded by accelerate's own FSDP2 code (as on GPUs).

    accelerate 1.15 assigns DistributedType.FSDP only to GPU-like process groups, so on CPU it would run
    plain DDP (MULTI_CPU). torch's fully_shard works over gloo, and accelerate's FSDP2 path (prepare,
    accumulate without gradient sync, DTensor-aware clipping) has nothing GPU-specific in it: the
    recipe switches the state to FSDP so that path runs, the same code a GPU launch runs.
    """
    version = os.environ.get("FSDP_VERSION", "1")  # read as accelerate's plugin reads it
    if version != "2":  # FSDP1's plugin refuses CPU-only machines (and would not run there)
        raise LaunchError(
            f"the launch config asks for FSDP version {version} on CPU; only FSDP2 runs on CPU "
            "(set fsdp_version: 2, as configs/accelerate/cpu-fsdp.yaml does)"
        )
    plugin = _fsdp_plugin(train)
    # A launch config's parallelism_config (HSDP: dp_replicate_size x dp_shard_size) is checked against the
    # distributed type inside Accelerator(), before the switch below; it is applied after it.
    hybrid = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true"
    accelerator = Accelerator(
        cpu=True,
        log_with=log_with,
        mixed_precision="no",
        gradient_accumulation_plugin=_accumulation(train, train.grad_accum_steps),
        fsdp_plugin=plugin,
        kwargs_handlers=[process_group_kwargs(timeout_s)],
    )
    if accelerator.distributed_type == DistributedType.MULTI_CPU:  # one process stays NO: refused later
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        # Also where every later AcceleratorState() copies it from (accelerate's GPU FSDP path does the
        # same): otherwise the next one resets the type to MULTI_CPU, and accumulate() then takes its
        # non-FSDP branch, reduce-scattering the gradients of every micro-batch instead of the last.
        PartialState().distributed_type = DistributedType.FSDP
        if hybrid:  # what Accelerator() does with it on GPUs: the mesh fully_shard then shards over
            parallelism = ParallelismConfig()  # its sizes from the launch config's PARALLELISM_CONFIG_*
            if parallelism.total_size != accelerator.num_processes:  # torch would fail building the mesh
                n = accelerator.num_processes
                mesh = parallelism.dp_replicate_size, parallelism.dp_shard_size, parallelism.total_size
                given = f"{n} {'was' if n == 1 else 'were'} launched"
                raise LaunchError(f"the launch config's {mesh_size_problem(*mesh, given)}")
            accelerator.state.parallelism_config = parallelism
            accelerator.state.device_mesh = parallelism.get_device_mesh("cpu")
            parallelism._validate_accelerator(accelerator)
    return accelerator


def mesh_size_problem(replicate: int, shard: int, total: int, given: str) -> str:
    """The one line for a parallelism_config whose mesh is not the processes there are (`given`: how many
    there are), as the recipe and the planner say it."""
    return (
        f"parallelism_config asks for {replicate} replica groups x {shard} shards = {total} processes, but "
        f"{given}: make parallelism_config_dp_replicate_size x parallelism_config_dp_shard_size equal "
        "num_processes"
    )


def _leave_deepspeed_unimported() -> None:
    """accelerate's model unwrapping (`unwrap_model`, and inside its FSDP2 prepare) imports DeepSpeed
    whenever it is installed, only to recognise DeepSpeed engines; importing it prints "Setting
    accelerator to CPU" and costs seconds. A launch without DeepSpeed has no engine to recognise."""
    import accelerate.utils.other

    accelerate.utils.other.is_deepspeed_available = lambda: False


def is_sharded(model) -> bool:
    """Whether the model's parameters are FSDP2 shards (its forward then needs every rank)."""
    from torch.distributed.fsdp import FSDPModule

    # fully_shard converts the model in place (it is its own wrapper); torch.compile wraps it.
    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


def keep_buffers_loadable(model, accelerator) -> list[str]:
    """Before `accelerator.prepare`: accelerate 1.15's FSDP2 loading with `fsdp_cpu_ram_efficient_loading`
    (`fsdp2_load_full_state_dict`) broadcasts every state-dict entry as a sharded parameter and fails on a
    persistent buffer (DeepSeek-V3's router bias: "'Tensor' object has no attribute 'device_mesh'"). A model
    built from its config has the same weights on every rank (the same seed), so the broadcast is not needed
    and is switched off; returns the start-up line. Weights loaded on rank 0 only cannot go without it."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or not plugin.cpu_ram_efficient_loading:
        return []
    params = {name for name, _ in model.named_parameters()}
    buffers = [name for name in model.state_dict() if name not in params]
    if not buffers:
        return []
    if any(p.is_meta for p in model.parameters()):
        raise LaunchError(
            f"accelerate's FSDP2 rank-0 loading (fsdp_cpu_ram_efficient_loading) cannot load this model's "
            f"persistent buffers ({buffers[0]}, ...): set fsdp_cpu_ram_efficient_loading: false in the launch config"
        )
    plugin.cpu_ram_efficient_loading = False
    return [
        f"FSDP2 rank-0 loading switched off: accelerate's fails on persistent buffers ({len(buffers)}, e.g. "
        f"{buffers[0]}); every rank built the same weights from the seed"
    ]


def describe_wrapping(model, accelerator) -> str:
    """What wraps the model after `accelerator.prepare`, and how much of it this rank holds."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    inner = accelerator.unwrap_model(model)
    params = list(inner.parameters())
    total = sum(p.numel() for p in params)
    if isinstance(inner, FSDPModule):
        units = [name or "root" for name, m in inner.named_modules() if isinstance(m, FSDPModule)]
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        return (
            f"FSDP2: {len(units)} fully_shard units ({', '.join(units)}); rank 0 holds {local:,} of "
            f"{total:,} parameter values (DTensor shards), and the optimizer state of those"
        )
    if type(model).__name__ == "DeepSpeedEngine":
        return (
            f"DeepSpeed ZeRO-{model.zero_optimization_stage()}: every rank holds all {total:,} parameter "
            "values; the optimizer state is partitioned across ranks"
        )
    wrapper = "DDP" if isinstance(model, DistributedDataParallel) else type(model).__name__
    return f"{wrapper}: every rank holds all {total:,} parameter values and their optimizer state"


def configure_threads(requested: int, local_world_size: int) -> int:
    """Use every core this process may use, split between the processes on this machine."""
    if requested <= 0:
        requested = max(1, len(os.sched_getaffinity(0)) // max(1, local_world_size))
    torch.set_num_threads(requested)
    return torch.get_num_threads()


def requested_processes() -> int | None:
    """The process count `accelerate launch` (or `python -m lmpretrain.launch`, which takes the same
    arguments) was asked for, read from the launcher's own command line."""
    try:
        argv = psutil.Process(os.getppid()).cmdline()
    except (psutil.Error, OSError):
        return None
    launchers = {("accelerate", "launch"), ("-m", "lmpretrain.launch")}
    try:
        at = next(i for i in range(len(argv) - 1) if (os.path.basename(argv[i]), argv[i + 1]) in launchers)
    except StopIteration:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:
        args, _ = launch_command_parser().parse_known_args(argv[at + 2 :])
    except SystemExit:
        return None
    if args.num_processes is not None:
        return int(args.num_processes)
    if args.config_file and os.path.isfile(args.config_file):
        with open(args.config_file) as f:
            value = (yaml.safe_load(f) or {}).get("num_processes")
        return int(value) if value is not None else None
    return None


def check_launch(accelerator: Accelerator, train) -> None:
    """Refuse every degraded launch we can detect, with the command that works instead."""
    fix = (
        "on CPU use: accelerate launch --config_file configs/accelerate/cpu-ddp.yaml recipes/pretrain.py ..."
    )
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world != accelerator.num_processes:
        raise LaunchError(
            f"WORLD_SIZE={env_world} processes were started but this one is in a group of "
            f"{accelerator.num_processes}: the processes are not one process group; {fix}"
        )
    asked = requested_processes()
    if asked is not None and asked != accelerator.num_processes:
        raise LaunchError(
            f"accelerate launch asked for {asked} processes but {accelerator.num_processes} started "
            f"(accelerate silently starts one process for --cpu/MULTI_CPU launches); {fix}"
        )
    dtype = accelerator.distributed_type
    if launch_requested("ACCELERATE_USE_FSDP") and dtype != DistributedType.FSDP:
        raise LaunchError(
            f"FSDP was requested but accelerate runs {dtype.value} on {accelerator.device} "
            "(FSDP needs GPUs in accelerate; nothing would be sharded). Use a GPU machine, or "
            "configs/accelerate/cpu-ddp.yaml for data parallelism on CPU"
        )
    if launch_requested("ACCELERATE_USE_DEEPSPEED") and dtype != DistributedType.DEEPSPEED:
        raise LaunchError(
            f"DeepSpeed was requested but accelerate runs {dtype.value} on {accelerator.device}"
        )
    # `accelerate launch` exports these from a launch config or its flags; the recipe config owns them.
    owned = {
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": ("train.grad_accum_steps", train.grad_accum_steps),
        "ACCELERATE_GRADIENT_CLIPPING": ("train.max_grad_norm", train.max_grad_norm),
    }
    for env, (field, value) in owned.items():
        launched = os.environ.get(env, "auto")
        if launched != "auto" and float(launched) != value:
            raise LaunchError(
                f"the launch config or flags set {env}={launched} but {field}={value}: remove it from "
                f"the launch (the recipe config owns it) or pass --{field}=..."
            )
    if dtype == DistributedType.DEEPSPEED:
        check_deepspeed(accelerator.state.deepspeed_plugin.deepspeed_config, train)


def check_deepspeed(ds_config: dict, train) -> None:
    """The DeepSpeed config must run what the recipe config says (a launch or DeepSpeed config file
    can set accumulation, clipping, precision and the ZeRO stage behind the recipe's back)."""
    from deepspeed.accelerator import get_accelerator

    stage = ds_config.get("zero_optimization", {}).get("stage")
    if stage not in DEEPSPEED_STAGES:
        raise LaunchError(
            f"DeepSpeed ZeRO stage {stage} is not supported by this recipe (stages {DEEPSPEED_STAGES}: its "
            "checkpoints and export read whole parameters). To shard parameters use configs/accelerate/fsdp.yaml"
        )
    wanted = {
        "gradient_accumulation_steps": train.grad_accum_steps,
        "gradient_clipping": train.max_grad_norm,
        "fp16.enabled": train.precision == "fp16",
        "bf16.enabled": train.precision == "bf16",
    }
    actual = {
        "gradient_accumulation_steps": ds_config.get("gradient_accumulation_steps"),
        "gradient_clipping": ds_config.get("gradient_clipping", 0.0),  # DeepSpeed's default: off
        "fp16.enabled": ds_config.get("fp16", {}).get("enabled", False),
        "bf16.enabled": ds_config.get("bf16", {}).get("enabled", False),
    }
    for key, value in wanted.items():
        if actual[key] != value:
            raise LaunchError(
                f"the DeepSpeed config has {key}={actual[key]!r} but the recipe config asks for "
                f"{value!r} (train.*): remove it from the DeepSpeed/launch config, the recipe owns it"
            )
    if train.precision == "fp16" and not get_accelerator().is_fp16_supported():
        raise LaunchError(
            f"DeepSpeed has no fp16 on {get_accelerator().device_name()}: use --train.precision=bf16 or no"
        )


def describe_runtime(accelerator: Accelerator, threads: int) -> RuntimeInfo:
    return RuntimeInfo(
        layout=layout_of(accelerator),
        rank=accelerator.process_index,
        distributed_type=accelerator.distributed_type.value,
        backend=dist.get_backend() if dist.is_initialized() else None,
        device=str(accelerator.device),
        threads=threads,
        restarts=restart_count(),
        max_restarts=int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")),
    )


def layout_of(accelerator: Accelerator) -> Layout:
    """What this launch really runs, read from the prepared Accelerator (not from the launch config, which a
    degraded launch does not follow); machines from torchrun's ranks per machine (LOCAL_WORLD_SIZE)."""
    dtype, world = accelerator.distributed_type, accelerator.num_processes
    machines = max(1, world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if dtype == DistributedType.FSDP:
        parallelism = accelerator.parallelism_config
        replicas = parallelism.dp_replicate_size if parallelism and parallelism.dp_replicate_enabled else 1
        plugin = accelerator.state.fsdp_plugin
        if getattr(plugin, "fsdp_version", 1) != 2:  # FSDP1's reshard_after_forward is a sharding strategy
            return Layout("fsdp1", world, machines)
        return Layout("fsdp2", world, machines, replicas, reshard_after_forward=plugin.reshard_after_forward)
    if dtype == DistributedType.DEEPSPEED:
        return Layout("deepspeed", world, machines, zero_stage=accelerator.state.deepspeed_plugin.zero_stage)
    return Layout("ddp" if world > 1 else "none", world, machines)


def setup(
    train, threads: int = 0, seed: int = 0, log_with=None, timeout_s: float = 1800
) -> tuple[Accelerator, RuntimeInfo]:
    """Build and check the Accelerator, set threads and the seed; ranks stop if their launcher dies;
    ``timeout_s`` bounds every collective (run.collective_timeout_s)."""
    watch_launcher()
    derive_accumulation(train, int(os.environ.get("WORLD_SIZE", "1")))  # train.global_batch_size
    accelerator = build_accelerator(train, log_with, timeout_s)
    check_launch(accelerator, train)
    used = configure_threads(threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    set_seed(seed)  # same seed on every rank: identical init, DDP would broadcast rank 0's anyway
    return accelerator, describe_runtime(accelerator, used)


def setup_from_config(cfg, log_with=None) -> tuple[Accelerator, RuntimeInfo]:
    """`setup` with a run config's settings: cfg.train, run.threads, run.seed, run.collective_timeout_s, and
    model.ep_size as the layout's expert-parallel degree."""
    accelerator, info = setup(
        cfg.train, cfg.run.threads, cfg.run.seed, log_with, timeout_s=cfg.run.collective_timeout_s
    )
    info.layout = dataclasses.replace(
        info.layout, experts=cfg.model.ep_size
    )  # expert parallelism: set by the model section
    return accelerator, info


def announcer(accelerator):
    """The recipe's `say(*lines)`: each line printed as `[lmpretrain] line`, on the main process only."""

    def say(*lines: str) -> None:
        for line in lines:
            accelerator.print(f"[lmpretrain] {line}")

    return say


def _accumulation(train, accum: int):
    """accelerate's accumulation: `accum` micro-batches per step; with train.sync_each_micro_batch (FSDP2) each
    micro-batch's gradients are reduce-scattered into the shards, none kept unsharded until the last."""
    from accelerate.utils import GradientAccumulationPlugin

    return GradientAccumulationPlugin(num_steps=accum, sync_each_batch=train.sync_each_micro_batch)


def exit_after(run: Callable[[], object]) -> NoReturn:
    """Call `run`, then exit the process: 0, or for a UserError (a problem to fix, not a bug) its one
    message and exit code 2, no traceback (see exit_process: a clean exit that gloo's threads cannot abort). A
    rank whose collective failed because another rank went away (on a user error, say) hands its traceback to
    torch elastic's error file rather than the screen (launch.report_lost_peer), so the message stays alone."""
    try:
        run()
    except UserError as err:
        exit_process(report_user_error(err))
    except Exception as err:
        if (code := report_lost_peer(err)) is not None:
            exit_process(code)
        raise
    exit_process(0)


def exit_process(code: int) -> NoReturn:
    """End this process with ``code``; a rank of a process group skips C++ static teardown.

    torch 2.13's gloo backend never joins its threads (destroy_process_group, shutdown() and abort()
    all leave them running, as /proc/<pid>/task shows), and C++ static destructors running while they
    are alive abort the process: "terminate called without an active exception", SIGABRT, and the
    launcher then SIGTERMs the other ranks. Two-rank gloo runs with one core kept busy aborted 5 times
    in 27 that way and 0 in 30 ended like this. Python's own exit handlers still run (W&B, logging,
    thread pools); the recipe has closed everything it opened by then.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    atexit._run_exitfuncs()  # what a normal exit runs before the teardown that aborts
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def peak_memory_bytes(device: torch.device) -> int:
    """Max CUDA memory allocated, or the peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def set_grad_accum(accelerator, steps: int) -> None:
    """Micro-batches of the next optimizer step (a batch ramp changes them). accelerate syncs gradients
    when its micro-batch counter reaches a multiple of `gradient_accumulation_steps` (and train_step reads
    it for the loss normalisation), so the counter restarts at 0 with each step."""
    accelerator.gradient_accumulation_steps = steps
    accelerator.step = 0
