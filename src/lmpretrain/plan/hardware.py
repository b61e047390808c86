"""The GPU a plan is made for: an entry of the one GPU table (lmpretrain/gpus.yaml) by key, or a user's file
with one entry of the same fields."""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml

from lmpretrain.errors import UserError
from lmpretrain.gpus import DTYPES, GPU, REQUIRED, TABLE, entry_problems, gpu_from_entry, table


class PlanError(UserError):
    """A planner input that cannot be planned (GPU, launch config, world size); the message says the fix."""


def load_gpu(name_or_path: str) -> GPU:
    """A GPU from the shipped table by key (h100, ...), or the only entry of a user's YAML file."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.is_file()):
        key = name_or_path.lower()
        if key not in table():
            near = difflib.get_close_matches(key, list(table()), n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise PlanError(
                f"--gpu {name_or_path}: unknown GPU; known: {', '.join(table())}{hint} "
                f"(or pass the path of a YAML file with the fields of {TABLE})"
            )
        return table()[key]
    if not path.is_file():
        raise PlanError(f"--gpu {name_or_path}: no such file (a GPU table like {TABLE})")
    try:
        entries = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise PlanError(f"--gpu {path}: cannot read it as a GPU table ({err})") from None
    if not isinstance(entries, dict) or len(entries) != 1:
        found = len(entries) if isinstance(entries, dict) else type(entries).__name__
        raise PlanError(
            f"--gpu {path}: a user GPU file must hold exactly one entry (name -> fields), found {found}"
        )
    key, entry = next(iter(entries.items()))
    problems = entry_problems(entry)
    if problems:
        peaks = ", ".join(f"{d}_tflops" for d in DTYPES)
        raise PlanError(
            f"--gpu {path}: entry {key!r} {'; '.join(problems)} (fields: {', '.join(REQUIRED)}; {peaks})"
        )
    return gpu_from_entry(key, entry)
