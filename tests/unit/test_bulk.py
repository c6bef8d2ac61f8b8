"""The bulk calls' bookkeeping (MapRun, ReplyScan, InFlight) with no Redis at all, and the bulk
calls on fakeredis."""

from __future__ import annotations

import threading
import time

import fakeredis
import numpy as np
import pytest
import redis

from inferfleet.producer import Producer, errors
from inferfleet.producer.bulk import (
    MAX_PROBE,
    MIN_PROBE,
    InFlight,
    InOrder,
    MapRun,
    ReplyScan,
    group_by_shard,
    place,
)
from inferfleet.producer.protocol import (
    decode_body,
    encode_reply_error,
    encode_reply_ok,
    lazy_replies,
    parse_entry,
    shard_for,
)
from inferfleet.producer.transport import Round

X = np.ones((1, 4), np.float32)


def ok(rid: str) -> bytes:
    return encode_reply_ok(rid, X, ("q", "1"), {"batch_rows": 1})


def offline(shards: int = 1, **options: object) -> Producer:
    return Producer(
        name="q", shards=shards, client=redis.Redis(host="127.0.0.1", port=1), **options
    )


# --------------------------------------------------------------------------- MapRun and InFlight


def test_fill_keeps_the_window_and_sends_each_shard_its_own_inbox() -> None:
    producer = offline(shards=3)
    calls = MapRun(producer, [X] * 10, {"p": 1}, window=4, deadline_s=5)
    round_ = Round()
    rids = calls.fill(round_)
    assert len(rids) == 4 and len(calls.in_flight) == 4 and calls.sent == 4 and not calls.exhausted
    commands = list(round_.commands())
    assert sorted(c[4] for c in commands) == sorted(rids)
    for command in commands:
        shard = shard_for(command[4], 3)
        assert command[1] == producer.shard_keys[shard].requests
        assert command[9:] == ("reply_to", producer.inboxes[shard])
        assert command[7] == "deadline" and int(command[8]) > time.time() * 1000
        assert decode_body(command[6])[1] == {"p": 1}
    assert calls.fill(Round()) == []  # the window is full


def test_fill_registers_each_shard_s_ids_before_anything_is_sent() -> None:
    producer = offline(shards=3)
    expected: list[tuple[list[str], int]] = []
    calls = MapRun(producer, [X] * 20, None, 20, None, 1, lambda r, s: expected.append((r, s)))
    rids = calls.fill(Round())
    assert sorted(r for group, _ in expected for r in group) == sorted(rids)
    for group, shard in expected:
        assert {shard_for(rid, 3) for rid in group} == {shard}


def test_take_puts_replies_at_their_input_index_and_ignores_stale_ones() -> None:
    producer = offline()
    calls = MapRun(producer, [X] * 3, None, window=10, deadline_s=None)
    rids = calls.fill(Round())
    assert calls.exhausted
    taken = calls.take(lazy_replies([ok(rids[2]), ok("stale-1"), ok(rids[0])]), raise_errors=False)
    assert [(i, r.id) for i, r in taken] == [(2, rids[2]), (0, rids[0])]
    assert calls.active and len(calls.in_flight) == 1
    with pytest.raises(errors.Expired):
        calls.take(lazy_replies([encode_reply_error(rids[1], "expired", "late")]), True)
    assert not calls.active


def test_an_input_the_contract_refuses_sends_nothing_of_its_round() -> None:
    calls = MapRun(offline(), [X, np.zeros((1, 2), np.complex64)], None, window=10, deadline_s=None)
    round_ = Round()
    with pytest.raises(errors.ProtocolError):
        calls.fill(round_)
    assert round_.replies == 0 and len(calls.in_flight) == 0


def test_a_stall_raises_reply_timeout() -> None:
    calls = MapRun(offline(), [X], None, window=1, deadline_s=None)
    calls.fill(Round())
    calls.check_stall(10)
    calls.last_progress -= 11
    with pytest.raises(errors.ReplyTimeout, match="1 requests in flight"):
        calls.check_stall(10)


def test_in_flight_adds_many_and_takes_per_shard() -> None:
    in_flight = InFlight(2)
    in_flight.add_many(1, ["a", "b"], [5, 6])
    in_flight.add("c", 0, 7)
    assert len(in_flight) == 3 and in_flight.shards() == [0, 1]
    assert sorted(in_flight.ids()) == ["a", "b", "c"]
    assert in_flight.pop("a", 0) is None  # not shard 0's
    assert in_flight.pop("b") == 6 and in_flight.pop("a", 1) == 5
    assert in_flight.pop("c", 0) == 7 and len(in_flight) == 0


@pytest.mark.parametrize("shards", [1, 2])
def test_in_flight_takes_its_own_replies_with_their_indexes(shards: int) -> None:
    in_flight = InFlight(shards)
    in_flight.add_many(shards - 1, ["a", "b"], [3, 4])
    taken = in_flight.take(lazy_replies([ok("b"), ok("stranger"), ok("a"), ok("b")]))
    assert [(index, reply.id) for index, reply in taken] == [(4, "b"), (3, "a")]
    assert len(in_flight) == 0  # the second "b" found nobody waiting


def test_place_puts_each_reply_at_its_index_and_grows_the_list() -> None:
    replies: list = ["r0"]
    place(replies, [(3, "r3"), (1, "r1")])
    assert replies == ["r0", "r1", None, "r3"]
    place(replies, [])
    place(replies, [(2, "r2")])
    assert replies == ["r0", "r1", "r2", "r3"]


def test_in_order_releases_a_reply_only_once_every_earlier_one_came() -> None:
    order = InOrder()
    assert order.release([(1, "b"), (3, "d")]) == []
    assert order.release([(0, "a")]) == ["a", "b"]
    assert order.release([(2, "c"), (4, "e")]) == ["c", "d", "e"]


def test_group_by_shard_keeps_input_order_within_a_shard() -> None:
    rids = [f"r{i}" for i in range(50)]
    groups = group_by_shard(rids, 4)
    assert [s for s, _ in groups] == sorted(s for s, _ in groups)
    assert sorted(p for _, ps in groups for p in ps) == list(range(50))
    for shard, positions in groups:
        assert positions == sorted(positions) and {shard_for(rids[p], 4) for p in positions} == {
            shard
        }
    assert group_by_shard(rids, 1) == [(0, list(range(50)))]


# --------------------------------------------------------------------------- ReplyScan


def scan_of(count: int) -> ReplyScan:
    return ReplyScan([f"k{i}" for i in range(count)])


def polled(scan: ReplyScan, timeout_s: float = 0.05) -> tuple[list, list[str]]:
    """(the round's BLPOP, the keys it LPOPs)."""
    round_ = Round()
    scan.queue(round_, timeout_s)
    first, *rest = round_.commands()
    assert all(command[0] == "LPOP" and len(command) == 2 for command in rest)
    return list(first), [command[1] for command in rest]


def answer(blpop: list, keys: list[str], answered: int) -> list:
    """The round's replies when keys k0 .. k{answered - 1} have theirs."""
    key = blpop[1]
    return [
        [key.encode(), ok(key)] if int(key[1:]) < answered else None,
        *[ok(k) if int(k[1:]) < answered else None for k in keys],
    ]


def test_a_round_waits_for_the_last_key_it_names_and_polls_the_others() -> None:
    scan = scan_of(1000)
    blpop, keys = polled(scan, 0.05)
    assert blpop == ["BLPOP", f"k{MIN_PROBE - 1}", "0.050"]
    assert keys == [f"k{i}" for i in range(MIN_PROBE - 1)]


def test_the_probe_doubles_while_every_key_is_answered() -> None:
    scan = scan_of(10_000)
    sizes = []
    while scan.missing:
        blpop, keys = polled(scan)
        sizes.append(1 + len(keys))
        scan.take(answer(blpop, keys, 10_000), raise_errors=False)
    assert (
        sizes[:4] == [MIN_PROBE, 2 * MIN_PROBE, 4 * MIN_PROBE, 8 * MIN_PROBE]
        and max(sizes) <= MAX_PROBE
    )
    assert [r.id for r in scan.replies()] == [f"k{i}" for i in range(10_000)]


def test_after_a_round_that_missed_some_it_waits_for_as_many_as_came() -> None:
    scan = scan_of(1000)
    scan.take(answer(*polled(scan), 1000), raise_errors=False)  # k0..k63: all there
    blpop, keys = polled(scan)
    assert blpop[1] == f"k{3 * MIN_PROBE - 1}" and len(keys) == 2 * MIN_PROBE - 1
    scan.take(answer(blpop, keys, 100), raise_errors=False)  # timed out: k64..k99 came, k100.. not
    assert scan.missing == 900
    blpop, keys = polled(scan)
    assert (
        keys[0] == "k100" and len(keys) + 1 == MIN_PROBE
    )  # as many as came (36), at least MIN_PROBE
    scan.take(answer(blpop, keys, 1000), raise_errors=False)
    assert scan.missing == 900 - MIN_PROBE


def test_a_timed_out_wait_keeps_its_key_in_place() -> None:
    scan = scan_of(10)
    blpop, keys = polled(scan)
    assert blpop[1] == "k9"
    scan.take(
        [None, *[ok(k) if k != "k3" else None for k in keys]], raise_errors=False
    )  # k3 and k9 missing
    assert scan.missing == 2
    assert polled(scan) == (["BLPOP", "k9", "0.050"], ["k3"])


def test_an_id_asked_twice_gets_the_same_reply() -> None:
    scan = ReplyScan(["a", "b", "a"])
    blpop, keys = polled(scan)
    assert (blpop[1], keys) == ("b", ["a"])
    scan.take([[b"b", ok("b")], ok("a")], raise_errors=False)
    replies = scan.replies()
    assert [r.id for r in replies] == ["a", "b", "a"] and replies[0] is replies[2]


def test_raise_errors_raises_the_first_failed_reply() -> None:
    scan = scan_of(2)
    _, keys = polled(scan)
    with pytest.raises(errors.ModelError):
        scan.take(
            [[b"k1", ok("k1")], encode_reply_error(keys[0], "model_error", "boom")],
            raise_errors=True,
        )


# --------------------------------------------------------------------------- the bulk calls on
# fakeredis


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


def test_submit_many_writes_the_contract_fields_in_every_chunk(
    server: fakeredis.FakeServer,
) -> None:
    client = fakeredis.FakeRedis(server=server)
    with Producer(client=client, name="q") as producer:
        before = int(time.time() * 1000)
        rids = producer.submit_many([X * i for i in range(7)], {"t": 2}, deadline_s=3, chunk=3)
    entries = client.xrange("inferfleet:{q}:requests")
    assert [f[b"id"].decode() for _, f in entries] == rids
    for i, (_, fields) in enumerate(entries):
        assert set(fields) == {b"id", b"body", b"deadline"}
        assert before + 3000 <= int(fields[b"deadline"]) <= time.time() * 1000 + 3000
        inputs, params = decode_body(fields[b"body"])
        np.testing.assert_array_equal(inputs, X * i)
        assert params == {"t": 2}


def test_sharded_submit_many_and_results_find_each_shard(server: fakeredis.FakeServer) -> None:
    client = fakeredis.FakeRedis(server=server)
    with Producer(client=client, name="q", shards=3) as producer:
        rids = producer.submit_many([X] * 30, chunk=7)
        for shard, keys in enumerate(producer.shard_keys):
            for _, fields in client.xrange(keys.requests):
                env = parse_entry(fields)
                assert shard_for(env.rid, 3) == shard and env.reply_to is None
                client.rpush(keys.reply(env.rid), ok(env.rid))
        replies = producer.results(list(reversed(rids)) + rids[:2], timeout_s=5)
    assert [r.id for r in replies] == list(reversed(rids)) + rids[:2]


def test_results_blocks_for_late_replies_instead_of_spinning(server: fakeredis.FakeServer) -> None:
    client = fakeredis.FakeRedis(server=server)
    with Producer(client=client, name="q") as producer:
        rids = producer.submit_many([X] * 5)
        client.rpush(producer.keys.reply(rids[0]), ok(rids[0]))
        late = fakeredis.FakeRedis(server=server)
        timer = threading.Timer(
            0.2, lambda: [late.rpush(producer.keys.reply(r), ok(r)) for r in rids[1:]]
        )
        timer.start()
        try:
            assert [r.id for r in producer.results(rids, timeout_s=5)] == rids
        finally:
            timer.join()
            late.close()


def test_results_refuses_a_bad_id_before_polling(server: fakeredis.FakeServer) -> None:
    with Producer(client=fakeredis.FakeRedis(server=server), name="q") as producer:
        with pytest.raises(errors.ProtocolError, match="invalid request id"):
            producer.results(["fine", "not fine"], timeout_s=0.1)
