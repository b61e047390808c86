"""The GPU a plan is made for: the shipped table (gpus.yaml, documented there) or a user's file of the same fields."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

import yaml

from lmpretrain.errors import UserError

TABLE = Path(__file__).with_name("gpus.yaml")
FIELDS = (
    "name",
    "memory_gib",
    "bf16_tflops",
    "fp8_tflops",
    "hbm_gbps",
    "intra_node_gbps",
    "inter_node_gbps",
    "gpus_per_node",
)


class PlanError(UserError):
    """A planner input that cannot be planned (GPU, launch config, world size); the message says the fix."""


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_gib: float
    bf16_tflops: float
    fp8_tflops: float | None
    hbm_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    gpus_per_node: int

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def peak_flops(self, fp8: bool = False) -> float:
        return (self.fp8_tflops if fp8 and self.fp8_tflops else self.bf16_tflops) * 1e12


def _entries(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise PlanError(f"--gpu {path}: cannot read it as a GPU table ({err})") from None
    if not isinstance(data, dict):
        raise PlanError(f"--gpu {path}: expected a mapping of GPU name -> fields ({', '.join(FIELDS)})")
    return data


def load_gpu(name_or_path: str) -> GPU:
    """A GPU from the shipped table by key (h100, ...), or the only/named entry of a user's YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise PlanError(f"--gpu {name_or_path}: no such file (a GPU table like {TABLE})")
        entries = _entries(path)
        if len(entries) != 1:
            raise PlanError(
                f"--gpu {path}: a user GPU file must hold exactly one entry, found {len(entries)}"
            )
        key = next(iter(entries))
    else:
        entries, key = _entries(TABLE), name_or_path.lower()
        if key not in entries:
            near = difflib.get_close_matches(key, list(entries), n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise PlanError(
                f"--gpu {name_or_path}: unknown GPU; known: {', '.join(entries)}{hint} "
                "(or pass the path of a YAML file with the fields of src/lmpretrain/plan/gpus.yaml)"
            )
    entry = entries[key]
    missing = [f for f in FIELDS if not isinstance(entry, dict) or f not in entry]
    if missing:
        raise PlanError(f"--gpu {name_or_path}: entry {key!r} lacks {', '.join(missing)}")
    return GPU(key=str(key), **{f: entry[f] for f in FIELDS})
