"""The house: config at the bottom (no torch), wings that import each other one way only."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "lmpretrain"
WINGS = [
    "config",
    "errors",
    "progress",
    "layout",
    "gpus",
    "data",
    "model",
    "update",
    "checkpoint",
    "observe",
    "run",
    "preflight",
]


def wing_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def module_level_wing_imports() -> dict[str, set[str]]:
    """wing -> the other wings its modules import at module level (what runs at import time)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).replace(".__init__", "")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lmpretrain"):
                targets = (
                    [node.module]
                    if node.module != "lmpretrain"
                    else [f"lmpretrain.{a.name}" for a in node.names]
                )
                for target in targets:
                    if wing_of(target) != wing_of(name):
                        edges.setdefault(wing_of(name), set()).add(wing_of(target))
    return edges


def test_the_wings_import_each_other_without_a_cycle():
    edges = module_level_wing_imports()
    visiting, done = set(), set()

    def visit(wing, path):
        assert wing not in visiting, f"import cycle between wings: {' -> '.join([*path, wing])}"
        if wing in done:
            return
        visiting.add(wing)
        for other in sorted(edges.get(wing, ())):
            visit(other, [*path, wing])
        visiting.discard(wing)
        done.add(wing)

    for wing in sorted(edges):
        visit(wing, [])
    assert edges["config"] <= {"errors"}  # the bottom: config knows no other wing


# Wings that must not import torch: each is checked in an interpreter of its own.
LIGHT = ("config", "errors", "progress", "layout", "gpus")
# The others are imported each in a fork of one interpreter that has imported only third-party packages every
# one of them imports (the bulk of the ~6 CPU-s each took in a fresh interpreter): lmpretrain's own import
# order still starts from nothing in each fork, so an order-dependent cycle between wings still shows.
PRELOADED = ("torch", "torch.distributed.tensor", "accelerate", "transformers")
IMPORT_EACH_IN_A_FORK = f"""
import importlib, os, sys, traceback
for name in {PRELOADED!r}:
    importlib.import_module(name)
errors = sys.argv[1]
for wing in sys.argv[2:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module("lmpretrain." + wing)
        except BaseException:
            with open(os.path.join(errors, wing), "w") as out:
                traceback.print_exc(file=out)
            os._exit(1)
        os._exit(0)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if status != 0 and not os.path.exists(os.path.join(errors, wing)):  # killed, e.g. a crash in an extension
        with open(os.path.join(errors, wing), "w") as out:
            out.write(f"importing lmpretrain.{{wing}} ended with status {{status}}")
"""


def python(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)}, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def import_errors(tmp_path_factory) -> dict[str, str]:
    """wing -> the traceback of importing it on its own (absent: it imported)."""
    errors = tmp_path_factory.mktemp("wing-imports")
    python("-c", IMPORT_EACH_IN_A_FORK, str(errors), *(w for w in WINGS if w not in LIGHT))
    return {path.name: path.read_text() for path in errors.iterdir()}


@pytest.mark.parametrize("wing", WINGS)
def test_each_wing_imports_on_its_own(wing, import_errors):
    """Each from nothing of lmpretrain's, so no earlier import hides an order-dependent cycle."""
    if wing in LIGHT:
        code = f"import sys; import lmpretrain.{wing}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
        imported = python("-c", code).stdout.strip()
        assert imported == "[]", f"lmpretrain.{wing} imports {imported}"
    else:
        assert wing not in import_errors, import_errors[wing]
