"""Rounds on a real redis-server: the hiredis loop, RESP2 and RESP3, errors and dropped
connections."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis
from redis._parsers.hiredis import _AsyncHiredisParser, _HiredisParser

from inferfleet.producer import transport
from inferfleet.producer.transport import Round, arun, run

STREAM = "inferfleet:{q}:requests"
INBOX = "inferfleet:{q}:inbox:p-1"


def a_round(count: int = 500) -> Round:
    round_ = Round()
    round_.xadd(
        STREAM,
        [f"r{i}" for i in range(count)],
        [b"x" * (i % 300) for i in range(count)],
        [("deadline", "1700000000000"), ("reply_to", INBOX)],
    )
    round_.lpop(INBOX, 1000)
    return round_


@pytest.fixture
def no_slow_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise AssertionError("read reply by reply: the hiredis loop was not used")

    monkeypatch.setattr(transport, "_read_each", refuse)
    monkeypatch.setattr(transport, "_aread_each", refuse)


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_hiredis_loop_reads_every_reply(
    redis_url: str, redis_client: redis.Redis, protocol: int, no_slow_path: None
) -> None:
    redis_client.rpush(INBOX, *[b"reply-%d" % i for i in range(1200)])
    client = redis.Redis.from_url(redis_url, protocol=protocol)
    replies = run(client, a_round())
    assert len(replies) == 501 and replies[-1] == [b"reply-%d" % i for i in range(1000)]
    entries = redis_client.xrange(STREAM)
    assert [f[b"id"] for _, f in entries] == [b"r%d" % i for i in range(500)]
    assert entries[7][1] == {
        b"id": b"r7",
        b"body": b"x" * 7,
        b"deadline": b"1700000000000",
        b"reply_to": INBOX.encode(),
    }
    assert [entry_id for entry_id, _ in entries] == replies[:500]  # each XADD's reply: its entry id
    client.close()


def test_an_error_reply_leaves_the_connection_in_step(
    redis_url: str, redis_client: redis.Redis, no_slow_path: None
) -> None:
    redis_client.set(INBOX, b"not a list")
    client = redis.Redis.from_url(redis_url)
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        run(client, a_round(3))
    assert redis_client.xlen(STREAM) == 3  # every command ran
    redis_client.delete(INBOX)
    assert run(client, a_round(2))[-1] is None  # same pooled connection, nothing left unread on it
    assert client.connection_pool._created_connections == 1  # the pool's own count
    client.close()


def test_a_connection_dropped_mid_read_is_a_connection_error_then_it_reconnects(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.ping()  # connected (and handshaken) before the drop is armed
    read = _HiredisParser.read_from_socket
    calls = []

    def drop(self: _HiredisParser, *args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionResetError(104, "Connection reset by peer")
        return read(self, *args, **kwargs)

    monkeypatch.setattr(_HiredisParser, "read_from_socket", drop)
    with pytest.raises(redis.exceptions.ConnectionError, match="reset"):
        run(client, a_round(10))
    monkeypatch.undo()
    assert run(client, a_round(10))[-1] is None  # a new connection: the old one was dropped
    assert redis_client.xlen(STREAM) == 20
    client.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_asyncio_hiredis_loop(
    redis_url: str, redis_client: redis.Redis, protocol: int, no_slow_path: None
) -> None:
    redis_client.rpush(INBOX, b"a", b"b")

    async def main() -> list:
        client = aioredis.Redis.from_url(redis_url, protocol=protocol)
        try:
            return await arun(client, a_round(300))
        finally:
            await client.aclose()

    replies = asyncio.run(main())
    assert len(replies) == 301 and replies[-1] == [b"a", b"b"]
    assert redis_client.xlen(STREAM) == 300


def test_an_asyncio_round_cancelled_mid_read_drops_its_connection(
    redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = _AsyncHiredisParser.read_from_socket

    async def slow(self: _AsyncHiredisParser) -> object:
        await asyncio.sleep(10)
        return await read(self)

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url)
        await client.ping()  # connected before reads are slowed
        monkeypatch.setattr(_AsyncHiredisParser, "read_from_socket", slow)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(arun(client, a_round(5)), 0.2)
        monkeypatch.undo()
        assert (await arun(client, a_round(5)))[-1] is None
        await client.aclose()

    asyncio.run(main())
    assert redis_client.xlen(STREAM) == 10
