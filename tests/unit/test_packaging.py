"""What pip installs: every subpackage, under one import name, and an SDK without the worker
side."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def _listed_packages() -> set[str]:
    block = PYPROJECT[PYPROJECT.index("packages = [") :]
    return set(re.findall(r'^\s+"([\w.]+)",$', block[: block.index("]")], re.M))


def _requirement_names(section: str) -> set[str]:
    requirements = re.findall(r'^\s+"([^"]+)",', section, re.M)
    return {re.split(r"[\[<>=~!; ]", req, maxsplit=1)[0].lower() for req in requirements}


def _section(start: str) -> str:
    text = PYPROJECT[PYPROJECT.index(start) :]
    return text[: text.index("\n]")]


def test_every_package_folder_is_installed_under_inferfleet() -> None:
    found = {"inferfleet"}
    for side in ("producer", "worker"):
        for init in (ROOT / side).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            found.add(".".join(("inferfleet", *parts)))
    assert _listed_packages() == found


def test_the_sdk_installs_without_the_worker_side() -> None:
    sdk = _requirement_names(_section("dependencies = ["))
    worker = _requirement_names(_section("worker = ["))
    assert sdk == {"redis", "numpy", "msgpack"}
    assert {"torch", "click", "rich", "matplotlib", "prometheus-client"} <= worker
    assert not sdk & {"torch", "click", "rich", "matplotlib"}


def test_the_console_script_starts_without_importing_the_worker() -> None:
    assert re.search(r'^inferfleet = "inferfleet\.__main__:main"$', PYPROJECT, re.M)
    text = (ROOT / "inferfleet" / "__main__.py").read_text()
    assert not re.search(r"^(from|import) inferfleet\.worker", text, re.M), (
        "the shim must import the CLI lazily"
    )


def test_every_lua_script_ships_as_package_data() -> None:
    block = PYPROJECT[PYPROJECT.index("[tool.setuptools.package-data]") :].split("\n[", 1)[0]
    for side in ("producer", "worker"):
        assert any((ROOT / side / "lua").glob("*.lua")), side
        assert f'"inferfleet.{side}" = ["lua/*.lua"]' in block, side
