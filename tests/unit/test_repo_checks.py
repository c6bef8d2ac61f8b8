"""Checks on the repository itself: generated docs are fresh, the packages type-check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_docs_match_the_commands():
    from scripts.gen_cli_docs import render

    assert (ROOT / "docs" / "cli.md").read_text() == render(), "run python -m scripts.gen_cli_docs"


def test_cli_docs_have_every_command_and_subcommand_with_its_options():
    """Not the top level alone: ``dead list`` and any later group's commands, each with its
    options."""
    import click

    from inferfleet.worker.cli import main as cli
    from scripts.gen_cli_docs import command_paths

    text = (ROOT / "docs" / "cli.md").read_text()
    headings = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    paths = command_paths()
    assert headings == paths
    assert {f"inferfleet dead {name}" for name in ("list", "show", "replay", "purge")} <= set(paths)
    sections = dict(zip(headings, text.split("\n## ")[1:]))
    for path in paths:
        command: click.Command = cli
        for name in path.split()[1:]:
            assert isinstance(command, click.Group)
            command = command.commands[name]
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.opts[0] in sections[path], (path, param.opts[0])
        if command.help:  # its opening words (click rewraps the rest to the page width)
            assert " ".join(command.help.split()[:4]) in sections[path], path


def test_packages_are_mypy_clean(tmp_path):
    # mypy cannot follow setuptools' package-dir mapping (nor the editable install's import
    # hook), so it checks a tree laid out as installed: inferfleet/{producer,worker} as links.
    package = tmp_path / "inferfleet"
    package.mkdir()
    for name in ("__init__.py", "py.typed"):
        (package / name).symlink_to(ROOT / "inferfleet" / name)
    for side in ("producer", "worker"):
        (package / side).symlink_to(ROOT / side, target_is_directory=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "-p",
            "inferfleet",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found in" in out.stdout, out.stdout


def test_the_producer_never_imports_the_worker_or_msgpack_outside_protocol():
    for path in (ROOT / "producer").rglob("*.py"):
        text = path.read_text()
        assert (
            "inferfleet.worker" not in text
            and "import worker" not in text
            and "from worker" not in text
        ), path
        if path.relative_to(ROOT).as_posix() != "producer/protocol/codec.py":
            assert "import msgpack" not in text, path
    for path in (ROOT / "worker").rglob("*.py"):
        assert "import msgpack" not in path.read_text(), path


def test_ruff_is_clean_with_the_committed_config():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    # one layout for all: a diff then shows what changed, not how someone wraps lines
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_scripts_lua_and_toml_keep_to_100_columns():
    # ruff holds the Python to 100; the same rule for the code it does not read
    files = [ROOT / "Dockerfile", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    files += [f for f in (ROOT / "scripts").iterdir() if f.suffix in ("", ".sh")]
    files += [*ROOT.glob("benchmarks/*.sh"), *ROOT.glob("*/lua/*.lua")]
    long = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in files
        if f.is_file()
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert long == []
    assert len(files) > 8  # the globs still find the files


def test_the_ci_switch_is_any_value_but_empty_0_or_false():
    from tests.conftest import running_in_ci

    for value in ("true", "1", "yes", "True", "TRUE", "on", "github-actions"):
        assert running_in_ci({"CI": value}), value
    for value in ("", "0", "false", "False", "FALSE", " "):
        assert not running_in_ci({"CI": value}), value
    assert not running_in_ci({})
