"""Process setup: the Accelerator, CPU threads, seeding, and refusing launches that silently degrade.

Verified traps this module exists for (accelerate 1.15): `accelerate launch` exports OMP_NUM_THREADS=1,
so a CPU run uses one core; `--cpu --num_processes 2` and a MULTI_CPU config start ONE process; plain
`--multi_gpu` without GPUs starts unsynchronised copies; an FSDP config on CPU quietly runs DDP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed


class LaunchError(RuntimeError):
    """The processes that started are not the ones that were asked for."""


@dataclass
class RuntimeInfo:
    world_size: int
    rank: int
    local_world_size: int
    distributed_type: str
    backend: str | None
    device: str
    threads: int
    sharding: str

    def describe(self) -> str:
        return (
            f"world_size={self.world_size} distributed_type={self.distributed_type} backend={self.backend} "
            f"device={self.device} threads/process={self.threads} sharding={self.sharding}"
        )


def has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def build_accelerator(log_with=None) -> Accelerator:
    # cpu=True on a machine without GPUs turns a torchrun-style multi-process launch into a real gloo
    # process group; without it each process runs alone (verified with --multi_gpu on CPU).
    return Accelerator(cpu=not has_accelerator(), log_with=log_with, mixed_precision="no")


def configure_threads(requested: int, local_world_size: int) -> int:
    """Use every core this process may use, split between the processes on this machine."""
    if requested <= 0:
        requested = max(1, len(os.sched_getaffinity(0)) // max(1, local_world_size))
    torch.set_num_threads(requested)
    return torch.get_num_threads()


def requested_processes() -> int | None:
    """The process count `accelerate launch` was asked for, read from the launcher's own command line."""
    try:
        argv = psutil.Process(os.getppid()).cmdline()
    except (psutil.Error, OSError):
        return None
    try:
        at = next(i for i in range(len(argv) - 1) if argv[i].endswith("accelerate") and argv[i + 1] == "launch")
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


def check_launch(accelerator: Accelerator) -> None:
    """Refuse every degraded launch we can detect, with the command that works instead."""
    fix = "on CPU use: accelerate launch --config_file configs/accelerate/cpu-ddp.yaml recipes/pretrain.py ..."
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
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and dtype != DistributedType.FSDP:
        raise LaunchError(
            f"FSDP was requested but accelerate runs {dtype.value} on {accelerator.device} "
            "(FSDP needs GPUs in accelerate; nothing would be sharded). Use a GPU machine, or "
            "configs/accelerate/cpu-ddp.yaml for data parallelism on CPU"
        )
    if dtype == DistributedType.DEEPSPEED or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise LaunchError(
            "DeepSpeed is not supported by this recipe yet: its engine takes over gradient accumulation, loss "
            "scaling, clipping, the optimizer step and checkpoint layout, which this loop does itself (and "
            "nothing here could test it without GPUs). For sharded training use configs/accelerate/fsdp.yaml "
            "(FSDP2 full sharding)"
        )


def describe_runtime(accelerator: Accelerator, threads: int) -> RuntimeInfo:
    dtype = accelerator.distributed_type
    sharding = "none"
    if dtype == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        sharding = f"fsdp{getattr(plugin, 'fsdp_version', 1)}:{plugin.sharding_strategy}"
    elif dtype == DistributedType.DEEPSPEED:
        sharding = f"deepspeed-zero{accelerator.state.deepspeed_plugin.zero_stage}"
    elif accelerator.num_processes > 1:
        sharding = "ddp (replicated)"
    return RuntimeInfo(
        world_size=accelerator.num_processes,
        rank=accelerator.process_index,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        distributed_type=dtype.value,
        backend=dist.get_backend() if dist.is_initialized() else None,
        device=str(accelerator.device),
        threads=threads,
        sharding=sharding,
    )


def setup(threads: int = 0, seed: int = 0, log_with=None) -> tuple[Accelerator, RuntimeInfo]:
    accelerator = build_accelerator(log_with)
    check_launch(accelerator)
    used = configure_threads(threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    set_seed(seed)  # same seed on every rank: identical init, DDP would broadcast rank 0's anyway
    return accelerator, describe_runtime(accelerator, used)


def peak_memory_bytes(device: torch.device) -> int:
    """Max CUDA memory allocated, or the peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def replica_digests(model, accelerator: Accelerator) -> list[str]:
    """sha256 of this rank's parameters, gathered from every rank (replicas must agree bit for bit)."""
    import hashlib

    from accelerate.utils import gather_object

    digest = hashlib.sha256()
    for param in accelerator.unwrap_model(model).parameters():
        digest.update(param.detach().float().cpu().numpy().tobytes())
    return gather_object([digest.hexdigest()[:16]])
