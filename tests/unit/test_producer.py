"""The sync Producer against fakeredis (no network)."""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Iterator

import fakeredis
import numpy as np
import pytest
import redis

from inferfleet.producer import Producer, errors
from inferfleet.producer.protocol import (
    GROUP,
    decode_body,
    encode_reply_error,
    encode_reply_ok,
    parse_entry,
    validate_request_id,
)

X = np.arange(6, dtype=np.float32).reshape(2, 3)
UNUSED_URL = "redis://127.0.0.1:1/0"


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


@pytest.fixture
def client(server: fakeredis.FakeServer) -> Iterator[fakeredis.FakeRedis]:
    c = fakeredis.FakeRedis(server=server)
    yield c
    c.close()


@pytest.fixture
def producer(client: fakeredis.FakeRedis) -> Iterator[Producer]:
    p = Producer(client=client, name="q")
    yield p
    p.close()


def entries(
    client: fakeredis.FakeRedis, producer: Producer
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return client.xrange(producer.keys.requests)


def ok_reply(rid: str, outputs: object = None) -> bytes:
    return encode_reply_ok(
        rid,
        X if outputs is None else outputs,
        ("q", "v1"),
        {"queued_ms": 1.0, "infer_ms": 2.0, "batch_rows": 2},
    )


# --------------------------------------------------------------------------- submit


def test_submit_writes_one_entry_that_decodes_to_the_inputs(
    client: fakeredis.FakeRedis, producer: Producer
) -> None:
    before = time.time() * 1000
    rid = producer.submit(X, {"t": 0.5})
    written = entries(client, producer)
    assert len(written) == 1
    _, fields = written[0]
    assert set(fields) == {b"id", b"body", b"deadline"}  # the default deadline
    assert before + 59_000 <= int(fields[b"deadline"]) <= time.time() * 1000 + 60_000
    assert fields[b"id"] == rid.encode()
    inputs, params = decode_body(fields[b"body"])
    np.testing.assert_array_equal(inputs, X)
    assert params == {"t": 0.5}


def test_submit_stream_key_is_the_contract_key(
    client: fakeredis.FakeRedis, producer: Producer
) -> None:
    producer.submit(X)
    assert client.keys("*") == [b"inferfleet:{q}:requests"]


def test_submit_with_deadline_and_reply_to(client: fakeredis.FakeRedis, producer: Producer) -> None:
    inbox = producer.keys.inbox("mine")
    before = int(time.time() * 1000)
    rid = producer.submit({"a": X}, deadline_s=2.0, request_id="custom:id-1", reply_to=inbox)
    after = int(time.time() * 1000)
    assert rid == "custom:id-1"
    ((_, fields),) = entries(client, producer)
    env = parse_entry(fields)
    assert env.rid == "custom:id-1"
    assert env.reply_to == inbox
    assert env.deadline_ms is not None
    assert before + 2000 <= env.deadline_ms <= after + 2000
    inputs, _ = decode_body(env.body)
    np.testing.assert_array_equal(inputs["a"], X)


def test_submit_generates_unique_valid_ids(producer: Producer) -> None:
    rids = [producer.submit(X) for _ in range(20)]
    assert len(set(rids)) == 20
    assert all(validate_request_id(r) == r for r in rids)
    other = Producer(client=producer.redis, name="q")
    assert not set(rids) & {other.submit(X) for _ in range(20)}


@pytest.mark.parametrize("rid", ["has space", "x" * 129, "", "a{b}"])
def test_submit_refuses_bad_request_ids_and_writes_nothing(
    client: fakeredis.FakeRedis, producer: Producer, rid: str
) -> None:
    with pytest.raises(errors.ProtocolError, match="request id"):
        producer.submit(X, request_id=rid)
    assert client.exists(producer.keys.requests) == 0


@pytest.mark.parametrize(
    "reply_to",
    ["inferfleet:{other}:inbox:x", "inferfleet:{q}:reply:x", "inferfleet:{q}:inbox:", "anything"],
)
def test_submit_refuses_reply_to_outside_the_inbox_and_writes_nothing(
    client: fakeredis.FakeRedis, producer: Producer, reply_to: str
) -> None:
    with pytest.raises(errors.ProtocolError, match="reply_to"):
        producer.submit(X, reply_to=reply_to)
    assert client.exists(producer.keys.requests) == 0


@pytest.mark.parametrize("deadline_s", [0, -1.0])
def test_submit_refuses_non_positive_deadline(
    client: fakeredis.FakeRedis, producer: Producer, deadline_s: float
) -> None:
    with pytest.raises(errors.ProtocolError, match="deadline"):
        producer.submit(X, deadline_s=deadline_s)
    assert client.exists(producer.keys.requests) == 0


def test_submit_refuses_unencodable_inputs_and_writes_nothing(
    client: fakeredis.FakeRedis, producer: Producer
) -> None:
    with pytest.raises(errors.ProtocolError):
        producer.submit(np.zeros((2, 2), np.complex64))
    assert client.exists(producer.keys.requests) == 0


def test_invalid_queue_name_is_refused() -> None:
    with pytest.raises(errors.ProtocolError, match="queue name"):
        Producer(client=fakeredis.FakeRedis(), name="bad name")


def test_submit_many_writes_entries_in_order(
    client: fakeredis.FakeRedis, producer: Producer
) -> None:
    rids = producer.submit_many([X * i for i in range(5)], chunk=2)
    written = entries(client, producer)
    assert [f[b"id"].decode() for _, f in written] == rids
    for i, (_, fields) in enumerate(written):
        np.testing.assert_array_equal(decode_body(fields[b"body"])[0], X * i)


# --------------------------------------------------------------------------- result


def test_result_returns_the_reply(client: fakeredis.FakeRedis, producer: Producer) -> None:
    rid = producer.submit(X)
    client.rpush(producer.keys.reply(rid), ok_reply(rid, X * 2))
    reply = producer.result(rid, timeout_s=1)
    assert reply.ok and reply.id == rid
    np.testing.assert_array_equal(reply.outputs, X * 2)
    assert reply.model_name == "q" and reply.model_version == "v1"
    assert reply.timing == {"queued_ms": 1.0, "infer_ms": 2.0, "batch_rows": 2}
    assert client.exists(producer.keys.reply(rid)) == 0  # collected means removed


def test_result_waits_for_a_late_reply(server: fakeredis.FakeServer, producer: Producer) -> None:
    rid = producer.submit(X)
    other = fakeredis.FakeRedis(server=server)
    timer = threading.Timer(0.1, other.rpush, (producer.keys.reply(rid), ok_reply(rid)))
    timer.start()
    try:
        assert producer.result(rid, timeout_s=5).id == rid
    finally:
        timer.join()
        other.close()


@pytest.mark.timeout(10)  # bounds a hang only: the call raising is what is checked
def test_result_times_out_when_nothing_arrives(producer: Producer) -> None:
    with pytest.raises(errors.ReplyTimeout) as info:
        producer.result("never-answered", timeout_s=0.05)
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, errors.InferfleetError)
    assert "never-answered" in str(info.value)


@pytest.mark.parametrize(
    "code,cls",
    [
        ("bad_request", errors.BadRequest),
        ("too_large", errors.TooLarge),
        ("expired", errors.Expired),
        ("model_error", errors.ModelError),
        ("dead_letter", errors.DeadLetter),
    ],
)
def test_result_raises_the_matching_reply_error(
    client: fakeredis.FakeRedis, producer: Producer, code: str, cls: type[errors.ReplyError]
) -> None:
    rid = producer.submit(X)
    client.rpush(producer.keys.reply(rid), encode_reply_error(rid, code, "nope"))
    with pytest.raises(cls) as info:
        producer.result(rid, timeout_s=1)
    assert info.value.code == code
    assert info.value.reply.id == rid


def test_result_returns_error_replies_when_asked(
    client: fakeredis.FakeRedis, producer: Producer
) -> None:
    rid = producer.submit(X)
    client.rpush(producer.keys.reply(rid), encode_reply_error(rid, "model_error", "boom"))
    reply = producer.result(rid, timeout_s=1, raise_errors=False)
    assert reply.ok is False
    assert reply.error_code == "model_error" and reply.error_message == "boom"


def test_result_refuses_an_invalid_request_id(producer: Producer) -> None:
    with pytest.raises(errors.ProtocolError):
        producer.result("bad id", timeout_s=0.01)


def test_infer_returns_outputs(server: fakeredis.FakeServer, producer: Producer) -> None:
    with FakeWorker(server, producer.keys.requests):
        np.testing.assert_array_equal(producer.infer(X, timeout_s=5), X * 10)


def test_results_collects_several_in_order(client: fakeredis.FakeRedis, producer: Producer) -> None:
    rids = [producer.submit(X * i) for i in range(4)]
    for i in (3, 1, 0, 2):  # replies land out of order
        rid = rids[i]
        client.rpush(producer.keys.reply(rid), ok_reply(rid, X * i))
    replies = producer.results(rids, timeout_s=1)
    assert [r.id for r in replies] == rids
    for i, reply in enumerate(replies):
        np.testing.assert_array_equal(reply.outputs, X * i)


def test_results_keeps_error_replies_by_default(
    client: fakeredis.FakeRedis, producer: Producer
) -> None:
    rids = [producer.submit(X) for _ in range(2)]
    client.rpush(producer.keys.reply(rids[0]), encode_reply_error(rids[0], "expired", "late"))
    client.rpush(producer.keys.reply(rids[1]), ok_reply(rids[1]))
    replies = producer.results(rids, timeout_s=1)
    assert [r.ok for r in replies] == [False, True]
    assert replies[0].error_code == "expired"


def test_results_times_out_when_one_is_missing(
    client: fakeredis.FakeRedis, producer: Producer
) -> None:
    rids = [producer.submit(X) for _ in range(3)]
    client.rpush(producer.keys.reply(rids[0]), ok_reply(rids[0]))
    with pytest.raises(errors.ReplyTimeout, match="2 of 3"):
        producer.results(rids, timeout_s=0.05)


# --------------------------------------------------------------------------- map


class FakeWorker:
    """Reads the request stream and answers each entry at its reply_to key.

    Replies are written in reverse order of arrival within each read, so the
    producer has to put them back in input order itself.
    """

    def __init__(self, server: fakeredis.FakeServer, stream: str, fail_every: int = 0) -> None:
        self.client = fakeredis.FakeRedis(server=server)
        self.stream = stream
        self.fail_every = fail_every
        self.seen = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self) -> FakeWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.client.close()

    def run(self) -> None:
        last = b"0"
        while not self.stop.is_set():
            got = self.client.xread({self.stream: last}, count=50, block=20)
            for _, items in got:
                last = items[-1][0]
                for _, fields in reversed(items):
                    self.answer(fields)

    def answer(self, fields: dict[bytes, bytes]) -> None:
        env = parse_entry(fields)
        inputs, _ = decode_body(env.body)
        self.seen += 1
        key = env.reply_to or f"inferfleet:{{q}}:reply:{env.rid}"
        if self.fail_every and self.seen % self.fail_every == 0:
            payload = encode_reply_error(env.rid, "model_error", "planned")
        else:
            payload = encode_reply_ok(env.rid, inputs * 10, ("q", "v1"), {"batch_rows": 1})
        self.client.rpush(key, payload)


def test_map_returns_replies_in_input_order(
    server: fakeredis.FakeServer, producer: Producer
) -> None:
    inputs = [np.full((1, 2), i, np.float32) for i in range(25)]
    with FakeWorker(server, producer.keys.requests):
        replies = producer.map(inputs, window=7, timeout_s=5)
    assert len(replies) == 25
    for i, reply in enumerate(replies):
        assert reply.ok
        np.testing.assert_array_equal(reply.outputs, inputs[i] * 10)
    assert len({r.id for r in replies}) == 25


def test_map_uses_the_producers_inbox(
    client: fakeredis.FakeRedis, server: fakeredis.FakeServer, producer: Producer
) -> None:
    with FakeWorker(server, producer.keys.requests):
        producer.map([X], timeout_s=5)
    ((_, fields),) = entries(client, producer)
    assert fields[b"reply_to"] == producer.inbox.encode()
    assert producer.keys.is_inbox(producer.inbox)


def test_map_returns_error_replies_in_place(
    server: fakeredis.FakeServer, producer: Producer
) -> None:
    with FakeWorker(server, producer.keys.requests, fail_every=3):
        replies = producer.map([X] * 6, timeout_s=5)
    assert [r.ok for r in replies].count(False) == 2


def test_map_raises_on_error_replies_when_asked(
    server: fakeredis.FakeServer, producer: Producer
) -> None:
    with FakeWorker(server, producer.keys.requests, fail_every=1):
        with pytest.raises(errors.ModelError):
            producer.map([X] * 3, timeout_s=5, raise_errors=True)


def test_map_times_out_without_workers(producer: Producer) -> None:
    with pytest.raises(errors.ReplyTimeout):
        producer.map([X, X], timeout_s=0.1)


def test_map_refuses_a_zero_window(producer: Producer) -> None:
    with pytest.raises(ValueError, match="window"):
        producer.map([X], window=0)


def test_map_of_nothing_is_nothing(client: fakeredis.FakeRedis, producer: Producer) -> None:
    assert producer.map([], timeout_s=0.1) == []
    assert client.exists(producer.keys.requests) == 0


# --------------------------------------------------------------------------- lag and lifecycle


def test_lag_counts_the_whole_stream_before_any_worker(producer: Producer) -> None:
    assert producer.lag() == 0
    for _ in range(3):
        producer.submit(X)
    assert producer.lag() == 3


def test_lag_follows_the_consumer_group(client: fakeredis.FakeRedis, producer: Producer) -> None:
    for _ in range(3):
        producer.submit(X)
    client.xgroup_create(producer.keys.requests, GROUP, id="0")
    assert producer.lag() == 3
    client.xreadgroup(GROUP, "c1", {producer.keys.requests: ">"}, count=2)
    assert producer.lag() == 1


def test_close_then_submit_raises(client: fakeredis.FakeRedis) -> None:
    p = Producer(client=client, name="q")
    p.close()
    with pytest.raises(errors.InferfleetError, match="closed"):
        p.submit(X)
    assert client.exists(p.keys.requests) == 0
    client.ping()  # a borrowed client is not closed by the producer


def test_context_manager_closes(client: fakeredis.FakeRedis) -> None:
    with Producer(client=client, name="q") as p:
        p.submit(X)
    with pytest.raises(errors.InferfleetError):
        p.submit(X)


# --------------------------------------------------------------------------- errors


def test_connection_errors_are_translated() -> None:
    p = Producer(UNUSED_URL, "q")
    try:
        with pytest.raises(errors.ConnectionError) as info:
            p.submit(X)
    finally:
        p.close()
    exc = info.value
    assert isinstance(exc, builtins.ConnectionError)
    assert isinstance(exc, errors.InferfleetError)
    assert isinstance(exc.__cause__, redis.exceptions.ConnectionError)


@pytest.mark.parametrize("call", ["result", "results", "lag", "map"])
def test_every_call_translates_connection_errors(call: str) -> None:
    p = Producer(UNUSED_URL, "q")
    try:
        with pytest.raises(errors.ConnectionError) as info:
            if call == "result":
                p.result("r", timeout_s=0.1)
            elif call == "results":
                p.results(["r"], timeout_s=0.1)
            elif call == "lag":
                p.lag()
            else:
                p.map([X], timeout_s=0.1)
    finally:
        p.close()
    assert isinstance(info.value.__cause__, redis.exceptions.RedisError)


def test_redis_url_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/3")
    p = Producer(name="q")
    try:
        kwargs = p.redis.connection_pool.connection_kwargs
        assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 1, 3)
    finally:
        p.close()


def test_other_redis_errors_become_inferfleet_errors(
    client: fakeredis.FakeRedis, producer: Producer
) -> None:
    client.set(producer.keys.requests, b"not a stream")
    with pytest.raises(errors.InferfleetError) as info:
        producer.submit(X)
    assert not isinstance(info.value, errors.ConnectionError)
    assert isinstance(info.value.__cause__, redis.exceptions.ResponseError)


# --------------------------------------------------------------------------- deadlines and
# backpressure


def test_no_default_deadline_when_disabled(client: fakeredis.FakeRedis) -> None:
    with Producer(client=client, name="q", default_deadline_s=None) as p:
        p.submit(X)
    ((_, fields),) = client.xrange("inferfleet:{q}:requests")
    assert set(fields) == {b"id", b"body"}


def test_infer_uses_its_timeout_as_deadline(
    client: fakeredis.FakeRedis, producer: Producer
) -> None:
    with pytest.raises(errors.ReplyTimeout):
        producer.infer(X, timeout_s=0.05)
    ((_, fields),) = entries(client, producer)
    assert int(fields[b"deadline"]) <= time.time() * 1000 + 100


def test_queue_full_raises_and_writes_nothing(client: fakeredis.FakeRedis) -> None:
    with Producer(client=client, name="q", max_backlog=3) as p:
        p.submit_many([X] * 3)
        with pytest.raises(errors.QueueFull) as info:
            p.submit(X)
        time.sleep(0.06)  # past the backlog cache
        with pytest.raises(errors.QueueFull):
            p.submit(X)
    assert info.value.backlog == 3
    assert client.xlen("inferfleet:{q}:requests") == 3


@pytest.mark.timeout(30)  # bounds a hang only
def test_queue_full_waits_for_room(
    client: fakeredis.FakeRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call reads a full backlog twice (it waits, writing nothing), then room is made: it
    sends once it reads the room, and only then (its entry is the one left after the delete)."""
    stream = "inferfleet:{q}:requests"
    with Producer(client=client, name="q", max_backlog=2, on_full="wait", full_wait_s=60) as p:
        p.submit_many([X] * 2)
        read, seen = p.backlog, []

        def backlog() -> int:  # each read the waiting call makes; room once it has seen it full
            seen.append((read(), client.xlen(stream)))
            if len(seen) == 2:
                client.delete(stream)
            return seen[-1][0]

        monkeypatch.setattr(p, "backlog", backlog)
        p.submit(X)
    assert seen[:2] == [(2, 2), (2, 2)]  # full, and nothing written while it waited
    assert seen[2:] == [(0, 0)]  # the room, read once
    assert client.xlen(stream) == 1  # written after the delete, not before


def test_bad_limit_settings_are_refused(client: fakeredis.FakeRedis) -> None:
    for kwargs in ({"max_backlog": 0}, {"on_full": "drop"}, {"default_deadline_s": 0}):
        with pytest.raises(ValueError):
            Producer(client=client, name="q", **kwargs)
