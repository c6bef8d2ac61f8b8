"""Checks on the repository itself: generated docs are fresh, the packages type-check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_docs_match_the_commands():
    from scripts.gen_cli_docs import render

    assert (ROOT / "docs" / "cli.md").read_text() == render(), "run python scripts/gen_cli_docs.py"


def test_packages_are_mypy_clean():
    out = subprocess.run([sys.executable, "-m", "mypy", "producer", "worker"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_producer_never_imports_the_worker_or_msgpack_outside_protocol():
    for path in (ROOT / "producer").glob("*.py"):
        text = path.read_text()
        assert "import worker" not in text and "from worker" not in text, path
        if path.name != "protocol.py":
            assert "import msgpack" not in text, path
    for path in (ROOT / "worker").glob("*.py"):
        assert "import msgpack" not in path.read_text(), path
