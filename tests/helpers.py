"""Helpers the tests share, one home each (issue #35 moved the older copies here).

* :func:`wait_until`: polling, where a deadline only bounds a hang;
* :func:`drain` and :func:`warmed`: a consumer run round by round in the test's thread;
* :func:`warmed_intake`: an intake whose template path has learnt some bodies.

Fixtures live in tests/conftest.py (``affine``, the example model's direct forward pass, among
them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    every_s: float = 0.05,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``predicate`` until it returns something true and return that; the deadline only
    bounds a hang (AssertionError naming ``what`` and the last value seen), it is never what a
    test checks.

    ``retry_on``: exceptions that mean "not there yet" (an endpoint not up, a check's assertion
    not true yet); they are polled through like a false value, and the last one is named if the
    deadline passes. Any other exception fails at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = last = predicate()
        except retry_on as exc:
            last = exc
        else:
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s} s waiting for {what}; last: {last!r}"
            )
        time.sleep(every_s)


def drain(consumer: Any, count: int | None = None, rounds: int = 50) -> int:
    """Run ``consumer.run_once()`` until a round handles nothing (``count`` None: the stream has
    nothing new for it) or until ``count`` entries are handled in all; the number handled.

    AssertionError if ``rounds`` rounds do not get there: a test never goes on with entries
    silently left unread.
    """
    handled = 0
    for _ in range(rounds):
        done = consumer.run_once()
        handled += done
        if (done == 0) if count is None else (handled >= count):
            return handled
    wanted = "an empty round" if count is None else f"{count} entries"
    raise AssertionError(f"{handled} entries handled in {rounds} rounds, and no {wanted}")


def warmed(consumer: Any, body: bytes, rid: str = "warm") -> Any:
    """``consumer`` once it has answered a first request of ``body``: its intake knows the body
    template, so the next reads of that layout are Columns (the fast path)."""
    consumer.redis.xadd(consumer.keys.requests, {"id": rid, "body": body})
    assert consumer.run_once() == 1
    return consumer


def warmed_intake(
    keys: Any, model: tuple[str, str], bodies: Sequence[bytes], inbox: bytes, now_ms: int, **kw: Any
) -> Any:
    """A new intake (``Intake(keys, Limits(), model, **kw)``) once its template path has learnt
    each of ``bodies`` from a first request answered to ``inbox`` (entry ids 1700000000000-0,
    -1...)."""
    from inferfleet.producer.protocol import Limits
    from inferfleet.worker.serving.batching import Request
    from inferfleet.worker.serving.intake import Intake

    intake = Intake(keys, Limits(), model, **kw)
    for i, body in enumerate(bodies):
        first = {b"id": b"warm", b"body": body, b"reply_to": inbox}
        assert isinstance(intake.admit_fast(b"1700000000000-%d" % i, first, now_ms), Request)
    return intake
