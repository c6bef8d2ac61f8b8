"""What pip installs: every subpackage, under one import name, and an SDK without the worker
side."""

from __future__ import annotations

import re
import subprocess
import sys
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


#: Python as on a machine where inferfleet is not installed: the editable install's finder gone.
_NOT_INSTALLED = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in repr(f)]; "
)


def test_the_checkout_folder_is_the_whole_package_from_the_checkout_root() -> None:
    """Issue 31: from the checkout's root, its own inferfleet/ folder comes first on the import
    path (``python -c``, ``python -m``), so without an install it must find producer/ and
    worker/ itself; a shim of symlinks behind it on PYTHONPATH never got the chance."""
    probe = (
        _NOT_INSTALLED
        + "import inferfleet, inferfleet.worker.config as c, inferfleet.producer as p;"
        " print(p.__file__, c.__file__, inferfleet.Producer.__module__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        str(ROOT / "producer" / "__init__.py"),
        str(ROOT / "worker" / "config.py"),
        "inferfleet.producer.sync",
    ]


def test_an_installed_copy_adds_nothing_to_its_path(tmp_path: Path) -> None:
    """A wheel's layout (producer/ inside inferfleet/) next to folders that happen to be named
    producer and worker: the package's path stays its own folder."""
    package = tmp_path / "inferfleet"
    (package / "producer").mkdir(parents=True)
    (package / "__init__.py").write_text((ROOT / "inferfleet" / "__init__.py").read_text())
    (package / "producer" / "__init__.py").write_text("__all__ = []\n")
    for side in ("producer", "worker"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "__init__.py").write_text("raise ImportError('the wrong one')\n")
    probe = _NOT_INSTALLED + "import inferfleet; print(list(inferfleet.__path__))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([str(package)])
