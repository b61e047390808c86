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


@pytest.mark.parametrize("wing", WINGS)
def test_each_wing_imports_on_its_own(wing):
    """In a fresh interpreter, so no earlier import hides an order-dependent cycle."""
    code = f"import sys; import lmpretrain.{wing}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    if wing in ("config", "errors", "progress"):
        assert done.stdout.strip() == "[]", f"lmpretrain.{wing} imports {done.stdout.strip()}"
