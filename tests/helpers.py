"""Helpers the tests share: the one home for polling (issue #35 moves the older copies here)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something true and return that; the deadline only
    bounds a hang (AssertionError naming ``what``), it is never what a test checks."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)
