"""What trained a run: the recipe file (path and hash), the checkout's commit, and the package versions.

Recorded in config.yaml, W&B's config and every checkpoint's metadata, so the runs of two forks that
share a config tell apart in `scripts/compare_runs.py`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
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


def provenance(recipe: str | Path) -> dict:
    """The recipe's path and sha256, the git commit and dirty flag of the checkout holding it (None
    outside a checkout), and the versions of python and the training packages."""
    recipe = Path(recipe).resolve()
    where = recipe.parent
    commit = _git(["rev-parse", "HEAD"], where)
    status = _git(["status", "--porcelain", "--untracked-files=no"], where) if commit else None
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "recipe": str(recipe),
        "recipe_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest() if recipe.is_file() else None,
        "git_commit": commit,
        "git_dirty": bool(status) if commit else None,
        "versions": versions,
    }
