"""docs/architecture.md matches the tree, and the code keeps its rules.

The tables of docs/architecture.md are read here: every subpackage and
module it names exists and every one that exists is named, and each import
between the packages is one its "may import" column allows (lazy imports in
functions included, and dynamic ones: ``importlib.import_module`` and
``__import__`` of a literal name, or of a name drawn from a module's table of
strings, as a lazy ``__getattr__`` does, resolved with ``ast``). Sizes and
private names are held to the house style.

The package root (``worker/__init__.py``) is in no table: it is the public
face, above the subpackages. What it imports when imported follows the shared
modules' row, so ``import inferfleet.worker`` stays light (no torch); the
names its ``__getattr__`` hands out on first use may come from any room
(``save_model`` lives in ``runtime/``), and in return no module of the
package imports those names from the root, which would route around the table.
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


def _modules(folder: str, root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in (root / folder).rglob("*.py"):
        dotted = ".".join(("inferfleet", *path.relative_to(root).with_suffix("").parts))
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


def _is_dynamic_import(call: ast.Call) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module" and isinstance(func.value, ast.Name)
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _bindings(body: list[ast.stmt]) -> dict[str, list[ast.expr]]:
    """Every value assigned to a plain name in ``body`` (nested blocks included, not the bodies
    of nested functions or classes)."""
    found: dict[str, list[ast.expr]] = {}
    todo = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(node.value)
        elif (
            isinstance(node, (ast.AnnAssign, ast.NamedExpr))
            and node.value is not None
            and isinstance(node.target, ast.Name)
        ):
            found.setdefault(node.target.id, []).append(node.value)
        todo += list(ast.iter_child_nodes(node))
    return found


class _Resolver:
    """The module names a dynamic import in one file can take, read statically: a literal, a
    name bound to literals (in the function, then the module), an entry of a module-level dict,
    list, tuple or set of literals (``TABLE[key]``, ``TABLE.get(key)``), ``a if c else b`` and
    ``a or b`` of those. None where any part is not static (a user's ``module:attr``)."""

    def __init__(self, tree: ast.Module) -> None:
        self.module_level = _bindings(tree.body)

    def names(self, node: ast.expr, local: dict[str, list[ast.expr]]) -> set[str] | None:
        if isinstance(node, ast.Constant):
            return {node.value} if isinstance(node.value, str) else set()
        if isinstance(node, ast.Name):
            return self._bound(self._values(node.id, local), local)
        if isinstance(node, ast.IfExp):
            return self._union([node.body, node.orelse], local)
        if isinstance(node, ast.BoolOp):
            return self._union(node.values, local)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            return self._entries(node.value.id, local)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
        ):
            entries = self._entries(node.func.value.id, local)
            default = self._union(node.args[1:], local)
            return None if entries is None or default is None else entries | default
        return None

    def _values(self, name: str, local: dict[str, list[ast.expr]]) -> list[ast.expr]:
        return local.get(name) or self.module_level.get(name, [])

    def _bound(self, values: list[ast.expr], local: dict[str, list[ast.expr]]) -> set[str] | None:
        return self._union(values, local) if values else None

    def _union(self, nodes: list[ast.expr], local: dict[str, list[ast.expr]]) -> set[str] | None:
        found: set[str] = set()
        for node in nodes:
            names = self.names(node, local)
            if names is None:
                return None
            found |= names
        return found

    def _entries(self, table: str, local: dict[str, list[ast.expr]]) -> set[str] | None:
        values = self._values(table, local)
        if len(values) != 1:
            return None
        literal = values[0]
        if isinstance(literal, ast.Dict):
            return self._union(literal.values, local)
        if isinstance(literal, (ast.List, ast.Tuple, ast.Set)):
            return self._union(literal.elts, local)
        return None


def _absolute(name: str, module: str, is_package: bool) -> str:
    """``name`` with a leading-dot (relative) name resolved against ``module``'s package."""
    if not name.startswith("."):
        return name
    dots = len(name) - len(name.lstrip("."))
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - dots + 1]
    return ".".join([*base, name.lstrip(".")]).rstrip(".")


def _dynamic_imports(path: Path, module: str) -> list[tuple[int, str | None, str]]:
    """(line, imported module or None where not static, enclosing function) of every dynamic
    import in the file; a name drawn from a table yields one row per entry."""
    tree = ast.parse(path.read_text())
    resolver = _Resolver(tree)
    scopes: list[tuple[str, list[ast.stmt]]] = [("<module>", tree.body)]
    scopes += [(node.name, node.body) for node in ast.walk(tree) if isinstance(node, _SCOPES)]
    found = []
    for scope, body in scopes:
        local = _bindings(body) if scope != "<module>" else {}
        calls = [
            node
            for statement in body
            for node in _walk_scope(statement)
            if isinstance(node, ast.Call) and _is_dynamic_import(node) and node.args
        ]
        for call in calls:
            names = resolver.names(call.args[0], local)
            if names is None:
                found.append((call.lineno, None, scope))
                continue
            package = path.name == "__init__.py"
            found += [(call.lineno, _absolute(n, module, package), scope) for n in sorted(names)]
    return found


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _walk_scope(node: ast.AST) -> list[ast.AST]:
    """``node`` and what it holds, but not the bodies of the functions and classes it defines
    (each one is a scope of its own); their decorators, defaults and bases run here."""
    if isinstance(node, _SCOPES):
        outside: list[ast.AST] = [*node.decorator_list]
        if isinstance(node, ast.ClassDef):
            outside += [*node.bases, *node.keywords]
        else:
            outside += [*node.args.defaults, *node.args.kw_defaults]
        return [found for child in outside if child for found in _walk_scope(child)]
    found = [node]
    for child in ast.iter_child_nodes(node):
        found += _walk_scope(child)
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


def _root_exports(root: Path) -> set[str]:
    """The names the package root hands out (its ``__all__``)."""
    tree = ast.parse((root / "worker" / "__init__.py").read_text())
    listed = _bindings(tree.body).get("__all__", [])
    return {e.value for node in listed if isinstance(node, ast.List) for e in node.elts}


def _import_sites(path: Path, module: str) -> list[tuple[int, str, list[str], str]]:
    """(line, target, names, enclosing scope) of every import of the file, static and dynamic;
    dynamic ones that are not static are left out (test_dynamic_imports_are_all_resolved)."""
    tree = ast.parse(path.read_text())
    lazy = {  # the lines of a module-level __getattr__
        line
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }
    static = _imports(path)
    static += [(line, t, []) for line, t, _ in _dynamic_imports(path, module) if t]
    return [(line, t, names, "__getattr__" if line in lazy else "") for line, t, names in static]


def _layering_violations(root: Path) -> list[str]:
    """Every import under ``root``'s producer/ and worker/ that the table does not allow."""
    allowed, exports = _allowed(), _root_exports(root)
    wrong = []
    for side in ("producer", "worker"):
        for module, path in _modules(side, root).items():
            where = f"{path.relative_to(root)}"
            is_root = module == "inferfleet.worker"
            for line, target, names, scope in _import_sites(path, module):
                if target == "inferfleet.worker" and not is_root and set(names) & exports:
                    wrong.append(
                        f"{where}:{line}: imports {sorted(set(names) & exports)} from "
                        "the package root"
                    )
                if is_root and scope == "__getattr__":
                    continue  # the public face: a name handed out on first use, any room
                source = "shared" if is_root else _room(module)
                room = _room(target)
                if room and source and room != source and room not in allowed[source]:
                    wrong.append(f"{where}:{line}: {source} imports {target}")
    return wrong


def test_every_import_between_packages_is_one_the_table_allows() -> None:
    assert _layering_violations(ROOT) == []


def test_the_check_reads_the_package_roots_lazy_exports() -> None:
    # the root's table of homes is followed: each exported name's module is one the check sees
    lazy = {
        t
        for _, t, _, scope in _import_sites(ROOT / "worker" / "__init__.py", "inferfleet.worker")
        if scope == "__getattr__"
    }
    assert "inferfleet.worker.runtime.saving" in lazy
    assert {"inferfleet.worker.handler", "inferfleet.worker.config"} <= lazy


#: Dynamic imports of a name only known at run time: a user's ``module:attr``.
USER_TARGETS = {
    ("worker/runtime/readers.py", "import_target"),
    ("worker/runtime/split.py", "load_splittable"),
}


def test_dynamic_imports_are_all_resolved() -> None:
    # a dynamic import the resolver cannot read would escape the layering check: only the known
    # loaders of a user's module may hold one
    unresolved = {
        (str(path.relative_to(ROOT)), scope)
        for side in ("producer", "worker")
        for module, path in _modules(side).items()
        for _, target, scope in _dynamic_imports(path, module)
        if target is None
    }
    assert unresolved == USER_TARGETS


_LAZY_TABLE = """
import importlib

_HOMES = {"save_model": "inferfleet.worker.runtime.saving"}


def __getattr__(name):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(home), name)
"""

#: (file, text, the violation it must raise) planted in a temporary tree
PLANTED = [
    (
        "worker/config.py",
        'import importlib\nsaving = importlib.import_module("inferfleet.worker.runtime.saving")\n',
        "worker/config.py:2: shared imports inferfleet.worker.runtime.saving",
    ),
    (
        "worker/fleet/observe.py",
        'def f():\n    return __import__("inferfleet.worker.serving.consumer")\n',
        "worker/fleet/observe.py:2: fleet imports inferfleet.worker.serving.consumer",
    ),
    (
        "worker/keys.py",
        _LAZY_TABLE,
        "worker/keys.py:11: shared imports inferfleet.worker.runtime.saving",
    ),
    (
        "worker/heartbeat.py",
        "from importlib import import_module\n\n"
        'NAME = ".serving.consumer"\nconsumer = import_module(NAME, __package__)\n',
        "worker/heartbeat.py:4: shared imports inferfleet.worker.serving.consumer",
    ),
    (
        "worker/__init__.py",
        '__all__ = ["save_model"]\nimport importlib\n'
        'importlib.import_module("inferfleet.worker.runtime")\n',
        "worker/__init__.py:3: shared imports inferfleet.worker.runtime",
    ),
    (
        "worker/runtime/loading.py",
        "from inferfleet.worker import save_model\n",
        "worker/runtime/loading.py:1: imports ['save_model'] from the package root",
    ),
]


def _tree(root: Path, planted: dict[str, str]) -> Path:
    """A producer/ and worker/ tree under ``root``: empty modules but the ``planted`` ones."""
    files = {
        "producer/__init__.py": "",
        "worker/__init__.py": '__all__ = ["save_model"]\n' + _LAZY_TABLE,
        "worker/config.py": "import importlib\n"
        "keys = importlib.import_module('inferfleet.worker.keys')\n"
        "table = {'a': 'inferfleet.worker.errors'}\n"
        "errors = importlib.import_module(table['a'])\n",
        "worker/keys.py": "",
        "worker/heartbeat.py": "",
        "worker/runtime/__init__.py": "",
        "worker/runtime/loading.py": "from inferfleet.worker.config import WorkerSettings\n",
        "worker/fleet/__init__.py": "",
        "worker/fleet/observe.py": "",
        **planted,
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_clean_tree_with_a_lazy_root_passes(tmp_path: Path) -> None:
    # the control: the planted tree below fails for its plant alone
    assert _layering_violations(_tree(tmp_path, {})) == []


@pytest.mark.parametrize("path, text, violation", PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_dynamic_import_fails_the_check(
    tmp_path: Path, path: str, text: str, violation: str
) -> None:
    assert _layering_violations(_tree(tmp_path, {path: text})) == [violation]


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
