"""An accelerate launch config read as the run's Layout (lmpretrain/layout.py), with --num_processes /
--num_machines overriding it as in accelerate; and a Layout written back as a launch config, which is how the
CUDA pre-flight hands its own launch to `python -m lmpretrain.plan`."""

from __future__ import annotations

from pathlib import Path

import yaml

from lmpretrain.layout import Layout
from lmpretrain.plan.hardware import PlanError
from lmpretrain.run.runtime import DEEPSPEED_STAGES, mesh_size_problem


def read_launch(config_file: str | None, num_processes: int | None, num_machines: int | None) -> Layout:
    """The launch config's layout, with --num_processes / --num_machines overriding it as in accelerate."""
    data: dict = {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise PlanError(
                f"--config_file {config_file}: not a file (an accelerate launch config, e.g. "
                "configs/accelerate/fsdp.yaml)"
            )
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise PlanError(f"--config_file {config_file} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise PlanError(f"--config_file {config_file}: expected an accelerate launch config mapping")
    world = _count("num_processes", num_processes, data, config_file)
    machines = _count("num_machines", num_machines, data, config_file)
    if world % machines:
        raise PlanError(
            f"--num_processes={world} is not a multiple of --num_machines={machines}: num_processes is the "
            "total over all machines, as in accelerate (e.g. 8 machines x 8 GPUs: --num_processes 64 "
            "--num_machines 8)"
        )
    kind = str(data.get("distributed_type", "NO" if world == 1 else "MULTI_GPU")).upper()
    if kind == "FSDP":
        fsdp = data.get("fsdp_config") or {}
        version = int(fsdp.get("fsdp_version", 1))
        if version != 2:
            raise PlanError(
                f"--config_file {config_file}: fsdp_version {version}; the planner plans FSDP2 (fsdp_version: 2)"
            )
        replicas = _replica_groups(data.get("parallelism_config") or {}, world, config_file)
        reshard = bool(fsdp.get("fsdp_reshard_after_forward", True))
        return Layout("fsdp2", world, machines, replicas, reshard_after_forward=reshard)
    if kind == "DEEPSPEED":
        stage = int((data.get("deepspeed_config") or {}).get("zero_stage", 0))
        if stage not in DEEPSPEED_STAGES:
            raise PlanError(
                f"--config_file {config_file}: DeepSpeed ZeRO stage {stage}; the recipe runs stages "
                f"{DEEPSPEED_STAGES} (use configs/accelerate/fsdp.yaml to shard parameters)"
            )
        return Layout("deepspeed", world, machines, zero_stage=stage)
    return Layout("none" if world == 1 else "ddp", world, machines)


def _count(name: str, flag: int | None, data: dict, config_file: str | None) -> int:
    """--num_processes / --num_machines, else the launch config's, else 1: a whole number of at least 1."""
    value, where = flag, f"--{name}={flag}"
    if flag is None:
        value, where = data.get(name), f"{config_file}: {name}={data.get(name)}"
        value = 1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{where}: must be a whole number of at least 1 (the {name.removeprefix('num_')})")
    return value


def launch_config(layout: Layout) -> dict:
    """The accelerate launch config of `layout` (what read_launch reads back as the same Layout)."""
    config: dict = {"num_processes": layout.num_processes, "num_machines": layout.num_machines}
    if layout.kind == "fsdp2":
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": layout.reshard_after_forward,
        }
        if layout.hsdp:
            config["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": layout.replicas,
                "parallelism_config_dp_shard_size": layout.shards,
            }
    elif layout.kind == "deepspeed":
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {"zero_stage": layout.zero_stage}
    elif layout.kind in ("none", "ddp"):
        config["distributed_type"] = "NO" if layout.kind == "none" else "MULTI_GPU"
    else:
        raise PlanError(
            f"the planner plans FSDP2, DDP and DeepSpeed ZeRO-1/2 launches, not {layout.describe()}"
        )
    return config


def _replica_groups(parallelism: dict, world: int, config_file: str | None) -> int:
    """HSDP's replica groups from accelerate's parallelism_config (absent: 1, FSDP2 over every rank); the
    recipe refuses sizes whose product is not the processes launched, and so does the plan."""
    sizes = {k.removeprefix("parallelism_config_"): int(v) for k, v in parallelism.items()}
    others = {k: v for k, v in sizes.items() if k not in ("dp_replicate_size", "dp_shard_size") and v > 1}
    if others:
        raise PlanError(
            f"--config_file {config_file}: parallelism_config {others}; the planner plans data parallelism "
            "only (parallelism_config_dp_replicate_size x parallelism_config_dp_shard_size)"
        )
    replicate, shard = sizes.get("dp_replicate_size", 1), sizes.get("dp_shard_size", 1)
    if parallelism and replicate * shard != world:
        problem = mesh_size_problem(replicate, shard, replicate * shard, f"--num_processes is {world}")
        raise PlanError(f"--config_file {config_file}: {problem}")
    return replicate
