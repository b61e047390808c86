"""How a run is laid out over its processes: one typed value that the recipe (run/runtime.py builds it from the
Accelerator), its pre-flight checks, the precision and Muon start-up checks, the planner (plan/launch.py reads
it from an accelerate launch config) and the CUDA pre-flight (plan/preflight.py writes it back as one) share.

Kinds: `none` (one process), `ddp` (every rank holds the whole model), `fsdp1`/`fsdp2` (parameters, gradients
and optimizer state sharded; FSDP2 with `replicas` > 1 is HSDP: replica groups of `shards` ranks each, from
accelerate's parallelism_config), `deepspeed` (ZeRO stage `zero_stage`: whole parameters, partitioned
optimizer state). `experts` and `tensor_parallel` are the expert- and tensor-parallel degrees, 1 until a
launch can set them. Imports no torch, like config.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Kind = Literal["none", "ddp", "fsdp1", "fsdp2", "deepspeed"]
KINDS: tuple[str, ...] = get_args(Kind)


@dataclass(frozen=True)
class Layout:
    kind: Kind = "none"
    num_processes: int = 1  # all ranks over all machines, as accelerate's --num_processes
    num_machines: int = 1
    replicas: int = 1  # HSDP: replica groups of the sharded mesh (parallelism_config_dp_replicate_size)
    zero_stage: int = 0  # DeepSpeed's ZeRO stage (1 or 2), 0 otherwise
    reshard_after_forward: bool = True  # FSDP2's fsdp_reshard_after_forward
    experts: int = 1  # expert-parallel degree
    tensor_parallel: int = 1

    def __post_init__(self):
        sizes = {f: getattr(self, f) for f in ("num_processes", "num_machines", "replicas", "experts")}
        sizes["tensor_parallel"] = self.tensor_parallel
        bad = [f"{name}={value}" for name, value in sizes.items() if not isinstance(value, int) or value < 1]
        if self.kind not in KINDS:
            bad.append(f"kind={self.kind!r} (one of {', '.join(KINDS)})")
        if not bad and self.num_processes % (self.replicas * self.tensor_parallel):
            bad.append(
                f"replicas={self.replicas} x tensor_parallel={self.tensor_parallel} must divide num_processes"
            )
        if self.replicas > 1 and self.kind != "fsdp2":
            bad.append(
                f"replicas={self.replicas}: replica groups of shards are FSDP2's (HSDP), not {self.kind}'s"
            )
        if (self.kind == "deepspeed") != (self.zero_stage > 0):
            bad.append(f"zero_stage={self.zero_stage} with kind={self.kind}")
        if self.kind == "none" and self.num_processes > 1:
            bad.append(f"kind=none with {self.num_processes} processes")
        if bad:
            raise ValueError(f"not a launch layout: {', '.join(bad)}")

    @property
    def fsdp(self) -> bool:
        """Parameters sharded over the ranks (FSDP1 or FSDP2)."""
        return self.kind in ("fsdp1", "fsdp2")

    @property
    def hsdp(self) -> bool:
        return self.kind == "fsdp2" and self.replicas > 1

    @property
    def shards(self) -> int:
        """The ranks that share one copy of the parameters: a shard group (1 when every rank holds it all)."""
        return self.num_processes // (self.replicas * self.tensor_parallel) if self.fsdp else 1

    @property
    def replicated(self) -> bool:
        """Several ranks each hold the whole parameters, which must stay identical (DDP, DeepSpeed ZeRO-1/2)."""
        return self.kind in ("ddp", "deepspeed")

    @property
    def ranks_per_machine(self) -> int:
        return -(-self.num_processes // self.num_machines)

    def spans_machines(self, size: int, stride: int = 1) -> bool:
        """Whether a group of `size` ranks `stride` apart (rank 0's: ranks 0, stride, 2 x stride, ...) reaches
        past one machine: a shard group is `shards` consecutive ranks, HSDP's replica group `replicas` ranks
        `shards` apart, the whole world `num_processes` consecutive ones."""
        return (size - 1) * stride >= self.ranks_per_machine

    def members_per_machine(self, size: int, stride: int = 1) -> int:
        """How many ranks of such a group share rank 0's machine: all of a group within one machine, one of
        HSDP's replica groups when its shard groups fill machines."""
        return min(size, -(-self.ranks_per_machine // stride))

    def describe(self) -> str:
        """The start-up line's `sharding=` words (tests and users read them)."""
        if self.kind == "deepspeed":
            words = f"deepspeed-zero{self.zero_stage}"
        elif self.kind == "ddp":
            words = "ddp (replicated)"
        else:
            words = self.kind
        if self.hsdp:
            words += f" HSDP: {self.replicas} replica groups x {self.shards} shards (parallelism_config)"
        for degree, what in ((self.experts, "experts"), (self.tensor_parallel, "tensor parallel")):
            if degree > 1:
                words += f", {what} over {degree} ranks"
        return words
