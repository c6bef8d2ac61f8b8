"""Whether the tests run under CI, where a missing tool is a failure instead of a skip.

One rule for every test (also for issue 19's): ``CI`` set to any non-empty value other than
``0`` or ``false`` (any case) means CI; unset, empty, ``0`` and ``false`` mean a developer's
machine. GitHub Actions, GitLab and most runners set ``CI=true``; some set ``CI=1``.
"""

from __future__ import annotations

import os

import pytest


def in_ci(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get("CI", "").strip().lower()
    return value not in ("", "0", "false")


def skip_unless_ci(reason: str) -> None:
    """Skip the calling test with ``reason`` on a developer's machine; fail it under CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: this test must run here)")
    pytest.skip(reason)
