"""docs/architecture.md matches the tree, and the code keeps its rules.

The tables of docs/architecture.md are read here: every subpackage and
module it names exists and every one that exists is named, and each import
between the packages is one its "may import" column allows (lazy imports in
functions included). Sizes and private names are held to the house style.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()
SUBPACKAGES = ("serving", "runtime", "fleet", "bench", "cli")
CHECKED = ("inferfleet", "producer", "worker", "scripts", "benchmarks", "tests")


def _table(heading: str) -> list[list[str]]:
    section = DOC[DOC.index(heading) :]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("| ") and not line.startswith("| ---"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:]  # the header row


def _room(module: str) -> str | None:
    """The package a dotted module name belongs to, as the tables name them."""
    parts = module.split(".")
    if parts[:2] == ["inferfleet", "producer"]:
        return "producer"
    if parts[:2] == ["inferfleet", "worker"] and len(parts) > 2:
        return parts[2] if parts[2] in SUBPACKAGES else "shared"
    return None


def _modules(folder: str) -> dict[str, Path]:
    found = {}
    for path in (ROOT / folder).rglob("*.py"):
        dotted = ".".join(("inferfleet", *path.relative_to(ROOT).with_suffix("").parts))
        found[dotted.removesuffix(".__init__")] = path
    return found


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
    return found


def _allowed() -> dict[str, set[str]]:
    allowed = {}
    for package, _, may in _table("## Subpackages and what each may import"):
        room = package.strip("`").rstrip("/").removeprefix("worker/")
        allowed[room] = set() if may.startswith("nothing") else {r.strip() for r in may.split(",")}
    allowed["shared"] = {"producer"}
    return allowed


def test_the_subpackage_table_names_every_subpackage() -> None:
    on_disk = {p.parent.name for p in (ROOT / "worker").glob("*/__init__.py")}
    assert set(_allowed()) - {"producer", "shared"} == on_disk == set(SUBPACKAGES)


def test_the_shared_module_table_names_every_top_level_module() -> None:
    named = {row[0].strip("`") for row in _table("## The shared modules at the top of `worker/`")}
    on_disk = {p.name for p in (ROOT / "worker").glob("*.py")} - {"__init__.py"}
    assert named == on_disk
    assert len(on_disk) + 1 <= 14, (
        "worker/ holds at most 14 top-level modules: put new ones in a subpackage"
    )


def test_the_module_table_names_every_module_of_every_subpackage() -> None:
    rows = {
        row[0].strip("`").rstrip("/"): set(re.findall(r"`(\w+\.py)`", row[1]))
        for row in _table("## Modules inside the subpackages")
    }
    for package in SUBPACKAGES:
        on_disk = {p.name for p in (ROOT / "worker" / package).glob("*.py")} - {"__init__.py"}
        assert rows.get(package) == on_disk, package
    wire = {p.name for p in (ROOT / "producer" / "protocol").glob("*.py")} - {"__init__.py"}
    assert rows.get("producer/protocol") == wire


def test_every_import_between_packages_is_one_the_table_allows() -> None:
    allowed = _allowed()
    wrong = []
    for side in ("producer", "worker"):
        for module, path in _modules(side).items():
            source = _room(module) if module != "inferfleet.worker" else "shared"
            for line, target, _ in _imports(path):
                room = _room(target)
                if room and source and room != source and room not in allowed[source]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {target}")
    assert wrong == []


def _private_imports(path: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: from {module} import {name}"
        for line, module, names in _imports(path)
        if module.split(".")[0] in CHECKED
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]


def test_no_module_imports_another_modules_private_name() -> None:
    found = [
        hit
        for folder in CHECKED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for hit in _private_imports(path)
    ]
    assert found == []


@pytest.mark.parametrize("side", ["inferfleet", "producer", "worker"])
def test_no_function_over_50_lines(side: str) -> None:
    # Classes have no cap: one that owns unrelated state is split by meaning, not by size.
    too_long = []
    for path in sorted((ROOT / side).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
                if lines > 50:
                    too_long.append(
                        f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} has {lines} lines"
                    )
    assert too_long == []


#: Modules aim at about 500 lines (docs/architecture.md); past this one is split by meaning.
MODULE_CAP = 600


@pytest.mark.parametrize("side", ["inferfleet", "producer", "worker"])
def test_no_module_over_the_cap(side: str) -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in sorted((ROOT / side).rglob("*.py"))
    }
    assert {name: n for name, n in sizes.items() if n > MODULE_CAP} == {}


@pytest.mark.parametrize("row", _table("## The folders around the package"), ids=lambda r: r[0])
def test_the_folders_around_the_package_hold_what_the_page_names(row: list[str]) -> None:
    folder = ROOT / row[0].strip("`")
    spans = re.findall(r"`([\w.]+)`", row[2])  # file names; `.venv` is no file here
    named = {name for name in spans if not name.startswith(".")}
    on_disk = {p.name for p in folder.iterdir() if p.is_file()} - {"__init__.py"}
    assert named & on_disk == on_disk, f"{row[0]} holds files the page does not name"
    assert named <= on_disk, f"{row[0]} lacks files the page names"


@pytest.mark.parametrize("folder", ["scripts", "benchmarks", "tests/fixtures"])
def test_nothing_outside_the_package_edits_sys_path(folder: str) -> None:
    files = [p for p in (ROOT / folder).iterdir() if p.is_file()]
    edits = [p.name for p in files if "sys.path" in p.read_text()]
    assert edits == [], "run it with python -m from the repository root instead"


def _sources(*allowed: str) -> list[tuple[str, str]]:
    """(path, text) of every .py under producer/ and worker/ but the ``allowed`` ones."""
    return [
        (str(path.relative_to(ROOT)), path.read_text())
        for side in ("producer", "worker")
        for path in sorted((ROOT / side).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in allowed
    ]


def test_lua_lives_in_lua_files() -> None:
    # scripts are read from worker/lua/ and producer/lua/, never written in Python strings
    assert [path for path, text in _sources() if "redis.call(" in text] == []


def test_scripts_are_registered_by_the_one_registry() -> None:
    # one registry a package: a script is registered once a client, never on each call
    found = [path for path, text in _sources("worker/connections.py") if "register_script" in text]
    assert found == []


def test_redis_py_internals_stay_behind_the_two_fences() -> None:
    # private redis-py (a module named redis._*, a connection's parser or reader) is used in
    # producer/transport.py and worker/resp.py only, where the supported version range is tested
    private = re.compile(r"\bredis\._|\._parser\b|\._reader\b")
    found = [
        f"{path}: {hit.group()}"
        for path, text in _sources("producer/transport.py", "worker/resp.py")
        for hit in private.finditer(text)
    ]
    assert found == []
