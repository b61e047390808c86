"""The one GPU table (gpus.yaml, its fields and sources documented there): dense peak FLOP/s per matmul dtype,
memory, HBM and link bandwidths, and the device names that select an entry. The recipe's MFU
(observe/flops.py), Muon's spread decision (update/muon_spread.py), the planner (plan/hardware.py, roofline.py)
and the CUDA pre-flight (plan/preflight.py) read it, so a run, its plan and its pre-flight use the same
numbers. Imports no torch, like config.py.

The achievable fractions of those peaks are the planner's roofline (calibrated in plan/roofline.py's docstring,
docs/planning.md); Muon's spread decision weighs the same rates.
"""

from __future__ import annotations

import functools
import re
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import yaml

from lmpretrain.layout import Layout

TABLE = Path(__file__).with_name("gpus.yaml")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")  # the matmul dtypes a peak is given for
MATMUL_FRACTION = 0.5
HBM_FRACTION = 0.8
COMM_FRACTION = 0.8


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_gib: float
    hbm_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    gpus_per_node: int
    fp32_tflops: float | None = None
    tf32_tflops: float | None = None
    bf16_tflops: float | None = None
    fp16_tflops: float | None = None
    fp8_tflops: float | None = None
    match: str | None = None  # regular expression on the lower-case CUDA device name

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def peak_flops(self, dtype: str) -> float | None:
        """Dense tensor-core peak FLOP/s for matmuls in `dtype` (one of DTYPES), None when it has none."""
        tflops = getattr(self, f"{dtype}_tflops")
        return tflops * 1e12 if tflops else None

    def link_bytes_per_s(self, spans_machines: bool, members_per_machine: int = 1) -> float:
        """What a ring collective's bus bandwidth reaches on the links its group uses: NVLink within a machine;
        across machines, NCCL runs one ring (channel) per NIC it can use, each member's own, so a group with k
        members on each machine moves k NICs' worth between machines (at most its NVLink's: every ring passes
        through each member). nccl-tests across 8-GPU H100 machines with a NIC per GPU report 400-450 GB/s of
        all-reduce bus bandwidth, not one NIC's 50."""
        if spans_machines:
            gbps = min(self.intra_node_gbps, members_per_machine * self.inter_node_gbps)
        else:
            gbps = self.intra_node_gbps
        return gbps * 1e9 * COMM_FRACTION

    def link_name(self, spans_machines: bool, members_per_machine: int = 1) -> str:
        rate = self.link_bytes_per_s(spans_machines, members_per_machine) / 1e9
        if not spans_machines:
            return f"NVLink/intra-node {rate:.0f} GB/s effective"
        nics = f"{members_per_machine} NICs" if members_per_machine > 1 else "1 NIC"
        return f"inter-node {rate:.0f} GB/s effective ({nics} a machine)"

    def group_link(self, layout: Layout, size: int, stride: int = 1) -> tuple[float, str]:
        """The rate and the words of a ring group of `size` ranks `stride` apart on `layout`'s machines."""
        spans, members = layout.spans_machines(size, stride), layout.members_per_machine(size, stride)
        return self.link_bytes_per_s(spans, members), self.link_name(spans, members)


# A GPU the table does not name: round figures of a current datacenter GPU (0.5 x 800 TFLOP/s of bf16 matmuls,
# 0.8 x 125 GB/s on any link), which weigh Muon's spread on it and time its pre-flight plan alike (its MFU is
# measured instead: observe/flops.py).
UNKNOWN = GPU(
    key="unknown",
    name="a GPU not in the table (round figures)",
    memory_gib=80,
    hbm_gbps=3000,
    intra_node_gbps=125,
    inter_node_gbps=125,
    gpus_per_node=8,
    fp32_tflops=60,
    tf32_tflops=400,
    bf16_tflops=800,
    fp16_tflops=800,
)

REQUIRED = tuple(f.name for f in fields(GPU) if f.default is MISSING and f.name != "key")


def entry_problems(entry) -> list[str]:
    """What an entry of the table (or of a user's file) lacks or gets wrong."""
    if not isinstance(entry, dict):
        return [f"expected a mapping of {', '.join(REQUIRED)}, got {entry!r}"]
    known = {f.name for f in fields(GPU)} - {"key"}
    problems = (
        [f"lacks {', '.join(f for f in REQUIRED if f not in entry)}"] if set(REQUIRED) - set(entry) else []
    )
    problems += [f"unknown field {name!r}" for name in entry if name not in known]
    return problems


def gpu_from_entry(key: str, entry: dict) -> GPU:
    return GPU(key=str(key), **entry)


@functools.cache
def table() -> dict[str, GPU]:
    """The shipped table, by key, in the file's order (the order device names are matched in)."""
    entries = yaml.safe_load(TABLE.read_text())
    return {key: gpu_from_entry(key, entry) for key, entry in entries.items()}


def gpu_for_device(device_name: str) -> GPU | None:
    """The table's entry for a CUDA device name (torch.cuda.get_device_name()), or None when none matches."""
    name = device_name.lower()
    return next((gpu for gpu in table().values() if gpu.match and re.search(gpu.match, name)), None)
