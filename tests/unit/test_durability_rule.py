"""The durability rule as pure functions: which WAITs a round gets, and what their replies
make of the writes before them (producer/durability.py)."""

from __future__ import annotations

import pytest
import redis

from inferfleet.producer import Durability, NotReplicated
from inferfleet.producer.durability import confirmed, queue_waits
from inferfleet.producer.transport import Round

TWO = Durability(replicas=2, timeout_ms=50)


def test_no_durability_adds_nothing_and_keeps_every_reply() -> None:
    round_ = Round()
    round_.xadd("s", ["a"], [b"x"])
    assert queue_waits(round_, None, [None]) == 0
    assert list(round_.commands()) == [("XADD", "s", "*", "id", "a", "body", b"x")]
    assert confirmed([b"1-0"], 1, 0, None) == [b"1-0"]


def test_one_wait_a_node_goes_behind_the_writes() -> None:
    round_ = Round()
    round_.xadd("s", ["a", "b"], [b"x", b"y"])
    assert queue_waits(round_, TWO, ["n1", "n2"]) == 2
    routed = list(round_.routed())
    assert routed[2:] == [
        (("WAIT", 2, 50), {"target_nodes": "n1"}),
        (("WAIT", 2, 50), {"target_nodes": "n2"}),
    ]
    assert round_.replies == 4
    assert round_.packed()[-1] == b"*3\r\n$4\r\nWAIT\r\n$1\r\n2\r\n$2\r\n50\r\n"


def test_enough_replicas_strip_the_wait_replies_and_keep_what_follows() -> None:
    # two writes, one WAIT, then a read's replies (a map round)
    assert confirmed([b"1-0", b"1-1", 2, [b"inbox", b"r"]], 2, 1, TWO) == [
        b"1-0",
        b"1-1",
        [b"inbox", b"r"],
    ]


def test_a_short_wait_fails_every_write_but_keeps_their_own_errors() -> None:
    refused = redis.exceptions.ResponseError("OOM")
    out = confirmed([b"1-0", refused, 2, 1], 2, 2, TWO)  # the second node saw only 1
    assert isinstance(out[0], NotReplicated) and "1 of the 2 replicas" in str(out[0])
    assert out[1] is refused
    assert len(out) == 2


def test_a_failed_wait_is_what_the_writes_raise() -> None:
    denied = redis.exceptions.NoPermissionError("NOPERM this user has no permissions: WAIT")
    assert confirmed([b"1-0", denied], 1, 1, TWO) == [denied]


def test_a_round_without_a_wait_keeps_its_replies_even_with_durability_on() -> None:
    # a read's round, or one whose writes all failed before any WAIT was queued
    assert confirmed([b"1-0", b"x"], 1, 0, TWO) == [b"1-0", b"x"]


@pytest.mark.parametrize(
    ("replicas", "timeout_ms", "error", "says"),
    [
        (0, 1000, ValueError, "replicas must be at least 1, got 0"),
        (1, 0, ValueError, r"timeout_ms must be at least 1 \(WAIT 0 blocks for ever\), got 0"),
        (True, 1000, TypeError, "replicas must be an int, got True"),
        (1.0, 1000, TypeError, "replicas must be an int, got 1.0"),
        (1, False, TypeError, "timeout_ms must be an int, got False"),
        (1, 10.0, TypeError, "timeout_ms must be an int, got 10.0"),
    ],
)
def test_nonsense_durability_is_refused_naming_the_field(
    replicas: object, timeout_ms: object, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=f"^{says}$"):
        Durability(replicas=replicas, timeout_ms=timeout_ms)  # type: ignore[arg-type]


def test_one_replica_within_one_millisecond_is_the_least_allowed() -> None:
    least = Durability(replicas=1, timeout_ms=1)
    assert (least.replicas, least.timeout_ms) == (1, 1)
