"""What an accelerate launch config says about the processes and the wrapping, as the planner needs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from lmpretrain.plan.hardware import PlanError
from lmpretrain.run.runtime import DEEPSPEED_STAGES, mesh_size_problem


@dataclass(frozen=True)
class Launch:
    wrapping: str  # none | ddp | fsdp2 | zero1 | zero2
    num_processes: int
    num_machines: int
    reshard_after_forward: bool = True
    replicas: int = 1  # HSDP: replica groups of num_processes // replicas shards (parallelism_config)

    @property
    def shards(self) -> int:
        """The ranks that share one copy of the parameters (all of them, unless HSDP replicates)."""
        return self.num_processes // self.replicas

    @property
    def sharding(self) -> str:
        """The recipe's name for it (RuntimeInfo.sharding), which its pre-flight rules read."""
        return {"none": "none", "ddp": "ddp (replicated)", "fsdp2": "fsdp2"}.get(
            self.wrapping, f"deepspeed-{self.wrapping}"
        )


def read_launch(config_file: str | None, num_processes: int | None, num_machines: int | None) -> Launch:
    """The launch config's wrapping, with --num_processes / --num_machines overriding it as in accelerate."""
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
    world = int(num_processes or data.get("num_processes") or 1)
    machines = int(num_machines or data.get("num_machines") or 1)
    if world < 1 or machines < 1 or world % machines:
        raise PlanError(
            f"--num_processes={world} must be a positive multiple of --num_machines={machines} "
            "(num_processes is the total over all machines, as in accelerate)"
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
        return Launch("fsdp2", world, machines, bool(fsdp.get("fsdp_reshard_after_forward", True)), replicas)
    if kind == "DEEPSPEED":
        stage = int((data.get("deepspeed_config") or {}).get("zero_stage", 0))
        if stage not in DEEPSPEED_STAGES:
            raise PlanError(
                f"--config_file {config_file}: DeepSpeed ZeRO stage {stage}; the recipe runs stages "
                f"{DEEPSPEED_STAGES} (use configs/accelerate/fsdp.yaml to shard parameters)"
            )
        return Launch(f"zero{stage}", world, machines)
    return Launch("none" if world == 1 else "ddp", world, machines)


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
