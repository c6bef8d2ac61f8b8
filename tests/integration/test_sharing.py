"""One fleet, many callers (issue 14): lanes, cancellation, fleet-wide limits and tenant quotas.

Real redis-server, real in-process consumers with a real handler
(``tests.handlers:Recorder``, which records the first value of every row it
computes), real producers. No timed assertions: rounds, counts and orders.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import redis
from click.testing import CliRunner

from inferfleet.producer import Producer, errors
from inferfleet.producer.protocol import GROUP, decode_reply, encode_body
from inferfleet.producer.sharing import cancels_key, lane_keys, limits_key, tenants_key
from inferfleet.worker.cli.app import main
from inferfleet.worker.serving.consumer import Consumer
from inferfleet.worker.serving.lanes import WEIGHTS
from tests import handlers
from tests.integration.test_consumer import drain, make_consumer

ROWS = 4  # the consumers' max_batch_rows: a saturated read takes 4 entries


def row(value: float) -> np.ndarray:
    return np.full((1, 4), value, np.float32)


@pytest.fixture
def recorder(redis_url: str, redis_client: redis.Redis) -> Consumer:
    consumer = make_consumer(
        redis_url, "tests.handlers:Recorder", idle_block_ms=50, max_batch_rows=ROWS, max_wait_ms=0.0
    )
    handlers.COMPUTED.clear()  # the warm-up's rows
    return consumer


def limit(redis_url: str, *args: str) -> str:
    result = CliRunner().invoke(main, ["limit", "--name", "q", "--redis-url", redis_url, *args])
    assert result.exit_code == 0, result.output
    return result.output


def codes(producer: Producer, rids: list[str]) -> list[str]:
    return [r.error_code or "ok" for r in producer.results(rids, timeout_s=5)]


# -- lanes ---------------------------------------------------------------


def test_a_high_request_overtakes_a_deep_normal_backlog_which_still_drains(recorder, redis_url):
    producer = Producer(redis_url, "q")
    backlog = producer.submit_many([row(i) for i in range(200)])
    recorder.run_once()  # the fleet is busy with the backlog
    urgent = producer.submit(row(-1.0), priority="high")
    rounds = 0
    while -1.0 not in handlers.COMPUTED:
        recorder.run_once()
        rounds += 1
    assert rounds <= 2  # within a couple of batches, not behind 196 requests (49 batches)
    assert producer.result(urgent, timeout_s=5).ok
    assert len(handlers.COMPUTED) <= 3 * ROWS + 1  # the backlog was not drained first
    drain(recorder, rounds=200)
    assert codes(producer, backlog) == ["ok"] * 200
    assert handlers.COMPUTED.count(-1.0) == 1


def test_the_low_lane_gets_its_documented_share_under_a_saturated_high_lane(recorder, redis_url):
    producer = Producer(redis_url, "q")
    producer.submit_many([row(1.0)] * 200, priority="high")
    producer.submit_many([row(2.0)] * 200, priority="low")
    cycle = sum(WEIGHTS)
    for _ in range(2 * cycle):  # a saturated read fills its batch: one read a round
        recorder.run_once()
    high, low = handlers.COMPUTED.count(1.0), handlers.COMPUTED.count(2.0)
    # a cycle of 12 reads favours high 8 times, normal 3 (empty here: high goes first) and low once
    assert (high, low) == (2 * (cycle - WEIGHTS[2]) * ROWS, 2 * WEIGHTS[2] * ROWS)
    assert recorder.lanes.taken == [high, 0, low]


def test_a_lone_low_request_is_served_within_one_cycle_of_reads(recorder, redis_url):
    producer = Producer(redis_url, "q")
    producer.submit_many([row(1.0)] * 300, priority="high")
    producer.submit_many([row(3.0)] * 300)
    lone = producer.submit(row(2.0), priority="low")
    for _ in range(sum(WEIGHTS)):
        recorder.run_once()
    assert producer.result(lone, timeout_s=5).ok
    assert handlers.COMPUTED.count(3.0) == WEIGHTS[1] * ROWS  # normal got its 3 reads in 12


def test_lanes_are_plain_streams_a_raw_client_writes(recorder, redis_url, redis_client):
    high, normal, low = lane_keys(recorder.keys)
    assert (high, normal, low) == (
        "inferfleet:{q}:requests:high",
        "inferfleet:{q}:requests",
        "inferfleet:{q}:requests:low",
    )
    for stream, rid in ((low, "l"), (high, "h"), (normal, "n")):
        assert redis_client.xinfo_groups(stream)[0]["name"] == GROUP.encode()
        redis_client.xadd(stream, {"id": rid, "body": encode_body(row(5.0))})
    drain(recorder)
    for rid in ("h", "n", "l"):
        assert decode_reply(redis_client.lpop(recorder.keys.reply(rid))).ok
    for stream in (high, normal, low):  # every lane's entries acknowledged on their own stream
        assert redis_client.xpending(stream, GROUP)["pending"] == 0


def test_a_batch_may_mix_lanes(recorder, redis_url):
    producer = Producer(redis_url, "q")
    rids = [
        producer.submit(row(1.0), priority="high"),
        producer.submit(row(1.0)),
        producer.submit(row(1.0), priority="low"),
    ]
    recorder.run_once()
    replies = producer.results(rids, timeout_s=5)
    assert [r.timing["batch_rows"] for r in replies] == [3, 3, 3]


def test_an_unknown_priority_is_refused_with_nothing_written(redis_url, redis_client):
    producer = Producer(redis_url, "q")
    with pytest.raises(errors.ProtocolError, match="priority must be one of high, normal, low"):
        producer.submit(row(1.0), priority="urgent")
    with pytest.raises(errors.ProtocolError, match="priority"):
        producer.submit_many([row(1.0)], priority="HIGH")
    assert redis_client.keys("*") == []


# -- cancellation ----------------------------------------------------------


def test_cancelled_requests_are_answered_cancelled_and_never_computed(
    recorder, redis_url, redis_client
):
    producer = Producer(redis_url, "q")
    drain(recorder)  # a worker that already ran rounds (its reply script said: no cancels)
    rids = producer.submit_many([row(i) for i in range(10)])
    assert [producer.cancel(rids[i]) for i in (2, 5, 9)] == ["cancelled"] * 3
    drain(recorder)
    assert codes(producer, rids) == ["cancelled" if i in (2, 5, 9) else "ok" for i in range(10)]
    assert sorted(handlers.COMPUTED) == [float(i) for i in range(10) if i not in (2, 5, 9)]
    assert redis_client.exists(cancels_key(recorder.keys)) == 0  # marks taken when answered


def test_a_computed_request_keeps_its_reply_and_an_unknown_id_writes_nothing(
    recorder, redis_url, redis_client
):
    producer = Producer(redis_url, "q")
    rid = producer.submit(row(1.0))
    drain(recorder)
    assert producer.cancel(rid) == "answered"
    assert producer.result(rid, timeout_s=5).ok
    with pytest.raises(errors.ProtocolError, match="in no lane"):
        producer.cancel("never-sent")
    assert producer.cancel_many(["never-sent", "nor-this"]) == ["unknown", "unknown"]
    assert redis_client.exists(cancels_key(recorder.keys)) == 0


def test_a_cancel_mark_expires_with_the_requests_deadline(redis_url, redis_client):
    producer = Producer(redis_url, "q")
    rid = producer.submit(row(1.0), deadline_s=5)
    producer.cancel(rid)
    ttl_ms = redis_client.pttl(cancels_key(producer.keys))
    assert 60_000 < ttl_ms <= 65_000  # the deadline plus 60 s, not the one-hour bound


def test_the_cancel_command_for_raw_ids(recorder, redis_url, redis_client):
    redis_client.xadd(recorder.keys.requests, {"id": "raw-1", "body": encode_body(row(7.0))})
    result = CliRunner().invoke(
        main, ["cancel", "--name", "q", "--redis-url", redis_url, "raw-1", "nope"]
    )
    assert result.exit_code == 1 and result.output.split("\n")[:2] == [
        "raw-1 cancelled",
        "nope unknown",
    ]
    drain(recorder)
    assert decode_reply(redis_client.lpop(recorder.keys.reply("raw-1"))).error_code == "cancelled"
    assert 7.0 not in handlers.COMPUTED


# -- fleet-wide limits -----------------------------------------------------


def test_two_producers_racing_never_exceed_max_backlog(redis_url, redis_client):
    limit(redis_url, "--max-backlog", "50")
    refused = []

    def flood(priority: str) -> None:
        producer = Producer(redis_url, "q")
        for _ in range(60):
            try:
                producer.submit(row(1.0), priority=priority)
            except errors.QueueFull:
                refused.append(priority)

    threads = [threading.Thread(target=flood, args=(p,)) for p in ("normal", "high")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    written = sum(redis_client.xlen(stream) for stream in lane_keys(Producer(redis_url, "q").keys))
    assert written == 50 and len(refused) == 70


def test_a_bulk_call_over_the_backlog_limit_writes_none_of_its_chunk(redis_url, redis_client):
    limit(redis_url, "--max-backlog", "10")
    producer = Producer(redis_url, "q")
    producer.submit_many([row(1.0)] * 8)
    with pytest.raises(errors.QueueFull, match="fleet-wide max_backlog 10"):
        producer.submit_many([row(1.0)] * 5)
    assert redis_client.xlen(producer.keys.requests) == 8


def test_a_tenant_over_its_rate_is_refused_and_other_tenants_are_not(
    recorder, redis_url, redis_client
):
    limit(redis_url, "--tenant", "nightly", "--rate", "0.001", "--burst", "5")
    nightly = Producer(redis_url, "q", tenant="nightly")
    ranking = Producer(redis_url, "q", tenant="ranking")
    sent = [nightly.submit(row(1.0)) for _ in range(5)]
    with pytest.raises(errors.RateLimited) as info:
        nightly.submit(row(1.0))
    assert info.value.tenant == "nightly" and info.value.retry_after_s > 0
    with pytest.raises(errors.RateLimited):
        nightly.map([row(1.0)] * 3)
    others = [ranking.submit(row(2.0)) for _ in range(20)]
    drain(recorder, rounds=50)
    assert codes(nightly, sent) == ["ok"] * 5 and codes(ranking, others) == ["ok"] * 20
    counts = {
        k.decode(): int(v) for k, v in redis_client.hgetall(tenants_key(nightly.keys)).items()
    }
    assert counts == {"accepted:nightly": 5, "refused:nightly": 4, "accepted:*": 20}


def test_raw_entries_past_the_check_are_refused_by_the_worker_without_compute(
    recorder, redis_url, redis_client
):
    limit(redis_url, "--tenant", "nightly", "--rate", "0.001", "--burst", "2")
    recorder.work.limits.refresh(redis_client)  # as housekeeping does
    for i in range(4):
        redis_client.xadd(
            recorder.keys.requests,
            {"id": f"raw-{i}", "body": encode_body(row(10.0 + i)), "tenant": "nightly"},
        )
    redis_client.xadd(
        recorder.keys.requests, {"id": "other", "body": encode_body(row(20.0)), "tenant": "ranking"}
    )
    drain(recorder)
    got = [
        decode_reply(redis_client.lpop(recorder.keys.reply(f"raw-{i}"))).error_code or "ok"
        for i in range(4)
    ]
    assert got == ["ok", "ok", "rate_limited", "rate_limited"]
    assert decode_reply(redis_client.lpop(recorder.keys.reply("other"))).ok
    assert sorted(handlers.COMPUTED) == [10.0, 11.0, 20.0]


def test_raw_entries_over_the_backlog_limit_are_answered_overloaded(
    recorder, redis_url, redis_client
):
    limit(redis_url, "--max-backlog", "4")
    recorder.work.limits.refresh(redis_client)
    for i in range(12):  # a v1 producer that never looks at the limits
        redis_client.xadd(
            recorder.keys.requests, {"id": f"raw-{i}", "body": encode_body(row(float(i)))}
        )
    drain(recorder)
    got = [
        decode_reply(redis_client.lpop(recorder.keys.reply(f"raw-{i}"))).error_code or "ok"
        for i in range(12)
    ]
    assert got.count("overloaded") >= 4 and got[-ROWS:] == ["ok"] * ROWS
    assert sorted(handlers.COMPUTED) == [float(i) for i, code in enumerate(got) if code == "ok"]


def test_bad_limits_and_tenants_are_refused_with_nothing_written(redis_url, redis_client):
    runner = CliRunner()
    for args in (
        ["--tenant", "a", "--rate", "-1"],
        ["--tenant", "a", "--rate", "1e12"],
        ["--tenant", "bad name", "--rate", "1"],
        ["--tenant", "x" * 65, "--rate", "1"],
        ["--rate", "1"],
        ["--max-backlog", "0"],
        ["--tenant", "a", "--rate", "nan"],
    ):
        result = runner.invoke(main, ["limit", "--name", "q", "--redis-url", redis_url, *args])
        assert result.exit_code == 2, (args, result.output)
    assert redis_client.exists(limits_key(Producer(redis_url, "q").keys)) == 0
    for tenant in ("bad name", "", "é", "x" * 65):
        with pytest.raises(errors.ProtocolError, match="tenant"):
            Producer(redis_url, "q", tenant=tenant)


def test_a_hostile_tenant_field_is_answered_bad_request(recorder, redis_client):
    redis_client.xadd(
        recorder.keys.requests, {"id": "t", "body": encode_body(row(1.0)), "tenant": "a b\x00"}
    )
    drain(recorder)
    reply = decode_reply(redis_client.lpop(recorder.keys.reply("t")))
    assert reply.error_code == "bad_request" and "tenant" in (reply.error_message or "")
    assert handlers.COMPUTED == []


def test_limit_show_and_clear(redis_url, redis_client):
    limit(redis_url, "--max-backlog", "100", "--tenant", "nightly", "--rate", "5", "--burst", "10")
    shown = limit(redis_url, "--show")
    assert '"max_backlog": 100' in shown and '"rate": 5.0' in shown and '"burst": 10.0' in shown
    limit(redis_url, "--clear", "--tenant", "nightly")
    assert '"tenants": {}' in limit(redis_url, "--show")
    limit(redis_url, "--clear")
    assert redis_client.exists(limits_key(Producer(redis_url, "q").keys)) == 0


def test_a_bisect_retry_checks_the_cancel_marks_again(redis_url):
    consumer = make_consumer(
        redis_url,
        "tests.handlers:CancelOnPoison",
        idle_block_ms=50,
        max_batch_rows=ROWS,
        max_wait_ms=0.0,
    )
    handlers.COMPUTED.clear()
    producer = Producer(redis_url, "q")
    rids = producer.submit_many([row(1.0), row(2.0), row(handlers.POISON), row(4.0)])
    handlers.ON_POISON.append(
        lambda: producer.cancel(rids[1])
    )  # cancelled while its batch is computed
    drain(consumer)
    assert codes(producer, rids) == ["ok", "cancelled", "model_error", "ok"]
    assert sorted(handlers.COMPUTED) == [1.0, 4.0]  # the retries never computed the cancelled one


def test_the_producers_lag_and_backlog_count_every_lane(recorder, redis_url):
    producer = Producer(redis_url, "q", max_backlog=5)
    producer.submit_many([row(1.0)] * 3)
    producer.submit_many([row(1.0)] * 2, priority="high")
    assert producer.lag() == 5 and producer.backlog() == 5
    with pytest.raises(errors.QueueFull):  # the producer's own limit counts every lane too
        producer.submit(row(1.0), priority="low")
    drain(recorder)
    assert producer.lag() == 0
