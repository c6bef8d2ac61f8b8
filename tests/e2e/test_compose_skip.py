"""Where no Docker engine can be used, the compose test is skipped with the reason, or fails under
CI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize(("ci", "outcome"), [("", "1 skipped"), ("true", "1 error")])
def test_the_compose_test_skips_without_docker_and_fails_under_ci(ci: str, outcome: str) -> None:
    """No docker on PATH: a developer is told why it was skipped; CI gets a failure."""
    env = {**os.environ, "PATH": "/nonexistent", "CI": ci}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rs",
            "tests/e2e/test_compose.py",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert outcome in out.stdout, out.stdout[-2000:]
    assert "no docker client on PATH" in out.stdout
