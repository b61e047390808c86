"""A run records what trained it: recipe path and hash, commit and dirty flag, package versions."""

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from lmpretrain.run.provenance import provenance

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"


def test_provenance_outside_a_checkout(tmp_path):
    recipe = tmp_path / "my_recipe.py"
    recipe.write_text("print('fork')\n")
    made = provenance(recipe)
    assert made["recipe"] == str(recipe.resolve())
    assert made["recipe_sha256"] == hashlib.sha256(b"print('fork')\n").hexdigest()
    assert made["git_commit"] is None and made["git_dirty"] is None
    assert set(made["versions"]) == {"python", "torch", "transformers", "accelerate", "datasets"}
    assert made["versions"]["torch"] and made["versions"]["transformers"]


def committed_recipe(folder):
    """A git checkout in `folder` whose one commit holds pretrain.py ("1"); returns (git command, path)."""
    git = [
        "git",
        "-C",
        str(folder),
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "-c",
        "commit.gpgsign=false",
    ]
    subprocess.run(["git", "init", "-q", str(folder)], check=True)
    recipe = folder / "pretrain.py"
    recipe.write_text("1\n")
    subprocess.run([*git, "add", "pretrain.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    return git, recipe


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")
def test_provenance_names_the_commit_and_whether_the_checkout_is_dirty(tmp_path):
    git, recipe = committed_recipe(tmp_path)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    clean = provenance(recipe)
    assert (clean["git_commit"], clean["git_dirty"]) == (head, False)
    recipe.write_text("2\n")
    dirty = provenance(recipe)
    assert (dirty["git_commit"], dirty["git_dirty"]) == (head, True)
    assert dirty["recipe_sha256"] != clean["recipe_sha256"]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")
def test_a_forks_own_files_are_hashed_and_an_untracked_one_makes_the_checkout_dirty(tmp_path, monkeypatch):
    from lmpretrain.config import load_config

    git, recipe = committed_recipe(tmp_path)
    assert provenance(recipe)["git_dirty"] is False
    model = tmp_path / "my_model.py"
    model.write_text("# a fork's architecture\n")  # untracked
    (tmp_path / "my_filters.py").write_text("def keep(text):\n    return text\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config([str(SMOKE), f"--model.imports=[{model}]", "--data.transforms=[my_filters:keep]"])
    made = provenance(recipe, cfg)
    assert made["git_dirty"] is True  # the untracked fork files count
    assert made["files"] == {
        str(model.resolve()): hashlib.sha256(model.read_bytes()).hexdigest(),
        str((tmp_path / "my_filters.py").resolve()): hashlib.sha256(
            (tmp_path / "my_filters.py").read_bytes()
        ).hexdigest(),
    }
    assert "files" not in provenance(recipe, load_config([str(SMOKE)]))
