"""What trained a run: the recipe file (path and hash), the fork's own files (model.imports, data.transforms)
with their hashes, the checkout's commit and whether it is dirty (untracked files included), and the
package versions.

Recorded in config.yaml, W&B's config and every checkpoint's metadata, so the runs of two forks that
share a config tell apart in `scripts/compare_runs.py`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import platform
import subprocess
from pathlib import Path

PACKAGES = ("torch", "transformers", "accelerate", "datasets")


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git here, or a hung filesystem
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def module_file(where: str) -> Path | None:
    """The file of a module named by model.imports or a data.transforms entry's module part: a .py path
    as given, else the module's file on the Python path (found without importing it); None if none."""
    if where.endswith(".py"):
        return Path(where).expanduser().resolve()
    try:
        spec = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec else None
    return Path(origin).resolve() if origin and origin not in ("built-in", "frozen") else None


def fork_files(cfg) -> dict[str, str | None]:
    """name -> sha256 of each file a fork names in the config: model.imports and data.transforms."""
    names = [*cfg.model.imports, *(t.rpartition(":")[0] for t in cfg.data.transforms)]
    files = {}
    for name in dict.fromkeys(names):
        path = module_file(name)
        files[str(path) if path else name] = _sha256(path) if path else None
    return files


def provenance(recipe: str | Path, cfg=None) -> dict:
    """The recipe's path and sha256, the files `cfg` names (model.imports, data.transforms) and their
    sha256, the git commit and dirty flag of the checkout holding the recipe (None outside a checkout;
    untracked files make it dirty: a fork's new files are often not committed yet), and the versions of
    python and the training packages."""
    recipe = Path(recipe).resolve()
    files = fork_files(cfg) if cfg is not None else {}
    where = recipe.parent
    commit = _git(["rev-parse", "HEAD"], where)
    status = _git(["status", "--porcelain", "--untracked-files=normal"], where) if commit else None
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "recipe": str(recipe),
        "recipe_sha256": _sha256(recipe),
        **({"files": files} if files else {}),
        "git_commit": commit,
        "git_dirty": bool(status) if commit else None,
        "versions": versions,
    }
