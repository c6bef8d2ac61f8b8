"""benchmarks/chaos.py's counting on a real redis-server: the 0 lost / 0 duplicated the reliability
tests assert."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from benchmarks import chaos
from inferfleet.producer.protocol import GROUP, encode_reply_error, encode_reply_ok

TIMING = {"queue_ms": 0.0, "infer_ms": 1.0, "batch_rows": 1}


def reply_of(rid: str, index: int, version: str = "sim-1") -> bytes:
    return encode_reply_ok(
        rid, chaos.inputs_for(index) * chaos.FACTOR[version], ("chaos", version), TIMING
    )


def answer(client: redis.Redis, rid: str, body: bytes) -> None:
    client.rpush(chaos.KEYS.reply(rid), body)


def test_tally_counts_answers_versions_wrong_outputs_dead_letters_and_lost(redis_client):
    accepted = {f"r{i}": i for i in range(6)}
    answer(redis_client, "r0", reply_of("r0", 0))
    answer(redis_client, "r1", reply_of("r1", 1, "sim-2"))
    answer(redis_client, "r2", reply_of("r2", 3))  # the outputs of another input
    answer(
        redis_client,
        "r3",
        encode_reply_error("r3", "dead_letter", "over the limit", ("chaos", "sim-1"), TIMING),
    )
    answer(redis_client, "r4", reply_of("r4", 4, "sim-2"))
    counts = chaos.tally(redis_client, accepted, timeout_s=0.5, settle_s=0)
    assert counts.pop("settle_s") >= 0
    assert counts == {
        "requests": 6,
        "answered": 5,
        "lost": 1,
        "duplicated": 0,
        "wrong": 1,
        "dead_lettered": 1,
        "sim-1": 2,
        "sim-2": 2,
        "unacknowledged": 0,
    }


def test_a_second_reply_pushed_after_the_first_was_taken_is_counted(redis_client, monkeypatch):
    """The late duplicate: a redelivered entry answered again after the tally took its first
    reply (as a client does: LPOP)."""
    accepted = {"r0": 0, "r1": 1, "r2": 2}
    for rid, index in accepted.items():
        answer(redis_client, rid, reply_of(rid, index))
    first_read = chaos._check

    def read_then_answer_again(raw: bytes, index: int, counts: dict[str, Any]) -> None:
        first_read(raw, index, counts)
        if index == 1:
            answer(redis_client, "r1", reply_of("r1", index))  # pushed once r1's was taken

    monkeypatch.setattr(chaos, "_check", read_then_answer_again)
    counts = chaos.tally(redis_client, accepted, timeout_s=10, settle_s=0)
    assert (counts["answered"], counts["duplicated"], counts["lost"], counts["wrong"]) == (
        3,
        1,
        0,
        0,
    )
    assert [redis_client.llen(chaos.KEYS.reply(rid)) for rid in accepted] == [0, 1, 0]


@pytest.mark.parametrize("acknowledged", [True, False])
def test_duplicates_are_counted_once_nothing_is_left_unacknowledged(redis_client, acknowledged):
    """An entry still pending could be answered again: the tally says so rather than report a final
    0."""
    keys = chaos.KEYS
    entry = redis_client.xadd(keys.requests, {"id": "r0"})
    redis_client.xgroup_create(keys.requests, GROUP, id="0")
    redis_client.xreadgroup(GROUP, "w1", {keys.requests: ">"}, count=1)
    answer(redis_client, "r0", reply_of("r0", 0))
    if acknowledged:
        redis_client.xack(keys.requests, GROUP, entry)
    counts = chaos.tally(redis_client, {"r0": 0}, timeout_s=5, settle_s=0)
    assert (counts["answered"], counts["unacknowledged"]) == (1, 0 if acknowledged else 1)


def test_duplicates_count_every_reply_left_once_the_client_took_one(redis_client):
    accepted = {"r0": 0, "r1": 1, "r2": 2}
    for rid, copies in (("r0", 1), ("r1", 3), ("r2", 2)):
        for _ in range(copies):
            answer(redis_client, rid, reply_of(rid, accepted[rid]))
    counts = chaos.tally(redis_client, accepted, timeout_s=5, settle_s=0)
    assert (counts["answered"], counts["duplicated"]) == (3, 2)
    assert [redis_client.llen(chaos.KEYS.reply(rid)) for rid in accepted] == [0, 2, 1]
