"""AsyncProducer against fakeredis.aioredis, driven with asyncio.run (no plugin)."""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import Awaitable, Callable
from typing import Any

import fakeredis
import fakeredis.aioredis
import numpy as np
import pytest
import redis

from inferfleet.producer import AsyncProducer, errors
from inferfleet.producer.protocol import (
    GROUP,
    decode_body,
    encode_reply_error,
    encode_reply_ok,
    parse_entry,
)

X = np.arange(6, dtype=np.float32).reshape(2, 3)

Scenario = Callable[
    [AsyncProducer, fakeredis.aioredis.FakeRedis, fakeredis.FakeServer], Awaitable[Any]
]


def run(scenario: Scenario) -> Any:
    """Run ``scenario(producer, client, server)`` on a fresh fake server."""

    async def main() -> Any:
        server = fakeredis.FakeServer()
        client = fakeredis.aioredis.FakeRedis(server=server)
        producer = AsyncProducer(client=client, name="q")
        try:
            return await scenario(producer, client, server)
        finally:
            await producer.close()
            await client.aclose()

    return asyncio.run(main())


def ok_reply(rid: str, outputs: Any) -> bytes:
    return encode_reply_ok(rid, outputs, ("q", "v1"), {"batch_rows": 1})


async def fake_worker(server: fakeredis.FakeServer, stream: str, stop: asyncio.Event) -> None:
    """Answer every entry at its reply_to, newest first within each read."""
    client = fakeredis.aioredis.FakeRedis(server=server)
    last = b"0"
    try:
        while not stop.is_set():
            got = await client.xrange(stream, min=b"(" + last if last != b"0" else "-", count=50)
            if not got:
                await asyncio.sleep(0.002)
                continue
            last = got[-1][0]
            for _, fields in reversed(got):
                env = parse_entry(fields)
                inputs, _ = decode_body(env.body)
                key = env.reply_to or f"inferfleet:{{q}}:reply:{env.rid}"
                await client.rpush(key, ok_reply(env.rid, inputs * 10))
    finally:
        await client.aclose()


def test_submit_writes_one_entry_that_decodes_to_the_inputs() -> None:
    async def scenario(p: AsyncProducer, client: Any, _: Any) -> None:
        inbox = p.keys.inbox("a")
        rid = await p.submit([X, X[:, 0]], {"k": 1}, deadline_s=5, reply_to=inbox)
        written = await client.xrange("inferfleet:{q}:requests")
        assert len(written) == 1
        env = parse_entry(written[0][1])
        assert env.rid == rid
        assert env.reply_to == inbox
        assert env.deadline_ms is not None and env.deadline_ms > time.time() * 1000
        inputs, params = decode_body(env.body)
        assert params == {"k": 1}
        np.testing.assert_array_equal(inputs[0], X)
        np.testing.assert_array_equal(inputs[1], X[:, 0])

    run(scenario)


@pytest.mark.parametrize(
    "kwargs", [{"request_id": "bad id"}, {"reply_to": "inferfleet:{other}:inbox:x"}]
)
def test_submit_validates_and_writes_nothing(kwargs: dict) -> None:
    async def scenario(p: AsyncProducer, client: Any, _: Any) -> None:
        with pytest.raises(errors.ProtocolError):
            await p.submit(X, **kwargs)
        assert await client.exists(p.keys.requests) == 0

    run(scenario)


def test_result_returns_the_reply() -> None:
    async def scenario(p: AsyncProducer, client: Any, _: Any) -> None:
        rid = await p.submit(X)
        await client.rpush(p.keys.reply(rid), ok_reply(rid, X + 1))
        reply = await p.result(rid, timeout_s=1)
        assert reply.ok and reply.id == rid
        np.testing.assert_array_equal(reply.outputs, X + 1)

    run(scenario)


def test_result_waits_for_a_late_reply() -> None:
    async def scenario(p: AsyncProducer, client: Any, server: Any) -> None:
        rid = await p.submit(X)
        other = fakeredis.aioredis.FakeRedis(server=server)

        async def late() -> None:
            await asyncio.sleep(0.05)
            await other.rpush(p.keys.reply(rid), ok_reply(rid, X))

        task = asyncio.create_task(late())
        try:
            assert (await p.result(rid, timeout_s=5)).id == rid
        finally:
            await task
            await other.aclose()

    run(scenario)


def test_result_times_out() -> None:
    async def scenario(p: AsyncProducer, *_: Any) -> None:
        with pytest.raises(errors.ReplyTimeout):
            await p.result("nobody", timeout_s=0.05)

    run(scenario)


@pytest.mark.parametrize(
    "code,cls",
    [
        ("expired", errors.Expired),
        ("dead_letter", errors.DeadLetter),
        ("bad_request", errors.BadRequest),
    ],
)
def test_result_raises_the_matching_reply_error(code: str, cls: type[errors.ReplyError]) -> None:
    async def scenario(p: AsyncProducer, client: Any, _: Any) -> None:
        rid = await p.submit(X)
        await client.rpush(p.keys.reply(rid), encode_reply_error(rid, code, "m"))
        with pytest.raises(cls):
            await p.result(rid, timeout_s=1)
        await client.rpush(p.keys.reply(rid), encode_reply_error(rid, code, "m"))
        reply = await p.result(rid, timeout_s=1, raise_errors=False)
        assert reply.error_code == code

    run(scenario)


def test_map_returns_replies_in_input_order() -> None:
    inputs = [np.full((1, 3), i, np.float32) for i in range(20)]

    async def scenario(p: AsyncProducer, client: Any, server: Any) -> list:
        stop = asyncio.Event()
        worker = asyncio.create_task(fake_worker(server, p.keys.requests, stop))
        try:
            return await p.map(inputs, window=6, timeout_s=5)
        finally:
            stop.set()
            await worker

    replies = run(scenario)
    assert len(replies) == 20
    for i, reply in enumerate(replies):
        np.testing.assert_array_equal(reply.outputs, inputs[i] * 10)


def test_map_times_out_without_workers() -> None:
    async def scenario(p: AsyncProducer, *_: Any) -> None:
        with pytest.raises(errors.ReplyTimeout):
            await p.map([X], timeout_s=0.1)

    run(scenario)


def test_lag() -> None:
    async def scenario(p: AsyncProducer, client: Any, _: Any) -> None:
        assert await p.lag() == 0
        for _ in range(3):
            await p.submit(X)
        assert await p.lag() == 3
        await client.xgroup_create(p.keys.requests, GROUP, id="0")
        await client.xreadgroup(GROUP, "c", {p.keys.requests: ">"}, count=1)
        assert await p.lag() == 2

    run(scenario)


def test_close_then_submit_raises() -> None:
    async def scenario(p: AsyncProducer, client: Any, _: Any) -> None:
        await p.close()
        with pytest.raises(errors.InferfleetError, match="closed"):
            await p.submit(X)
        assert await client.exists(p.keys.requests) == 0

    run(scenario)


def test_connection_errors_are_translated() -> None:
    async def main() -> None:
        p = AsyncProducer("redis://127.0.0.1:1/0", "q")
        try:
            with pytest.raises(errors.ConnectionError) as info:
                await p.submit(X)
        finally:
            await p.close()
        assert isinstance(info.value, builtins.ConnectionError)
        assert isinstance(info.value.__cause__, redis.exceptions.ConnectionError)

    asyncio.run(main())
