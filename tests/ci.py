"""Skip a test on a developer's machine, fail it under CI, for what CI must be able to run.

Whether this is CI is decided in one place, ``tests.conftest.running_in_ci`` (``CI`` set to
anything but empty, ``0`` or ``false``).
"""

from __future__ import annotations

import pytest

from tests.conftest import running_in_ci


def skip_unless_ci(reason: str) -> None:
    """Skip the calling test with ``reason`` on a developer's machine; fail it under CI."""
    if running_in_ci():
        pytest.fail(f"{reason} (CI is set: this test must run here)")
    pytest.skip(reason)
