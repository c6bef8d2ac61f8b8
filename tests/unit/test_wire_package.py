"""The wire format's subpackage keeps its public surface whole and its modules readable.

Each module of ``producer/protocol/`` lists in ``__all__`` every name other code imports from
it, the package re-exports exactly the union of those lists, and a module-level name is
defined above the first function that uses it (read top to bottom, nothing is used before
it is defined).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import inferfleet.producer.protocol as wire

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(p.stem for p in (ROOT / "producer" / "protocol").glob("*.py") if p.stem[0] != "_")


def _imported_names() -> dict[str, set[str]]:
    """Every name imported from the wire package or one of its modules, by module imported."""
    found: dict[str, set[str]] = {}
    for folder in ("producer", "worker", "tests", "scripts", "benchmarks", "inferfleet"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "inferfleet.producer.protocol"
                ):
                    found.setdefault(node.module, set()).update(a.name for a in node.names)
    return found


def test_the_package_exports_exactly_what_its_modules_export() -> None:
    union = set()
    for name in MODULES:
        union |= set(importlib.import_module(f"inferfleet.producer.protocol.{name}").__all__)
    assert set(wire.__all__) == union
    assert all(hasattr(wire, name) for name in wire.__all__)


def test_every_name_imported_from_the_wire_format_is_in_its_all() -> None:
    missing = []
    for module, names in _imported_names().items():
        exported = set(importlib.import_module(module).__all__)
        missing += [f"{module}.{name}" for name in sorted(names - exported)]
    assert missing == []


@pytest.mark.parametrize("name", MODULES)
def test_module_level_names_are_defined_before_the_functions_that_use_them(name: str) -> None:
    tree = ast.parse((ROOT / "producer" / "protocol" / f"{name}.py").read_text())
    defined: dict[str, int] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name):
                    defined.setdefault(leaf.id, node.lineno)
    late = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            for leaf in ast.walk(node):
                if isinstance(leaf, ast.Name) and defined.get(leaf.id, 0) > node.lineno:
                    late.append(f"{leaf.id} (line {defined[leaf.id]}) used by {node.name}")
    assert late == []
