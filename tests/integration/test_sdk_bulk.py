"""The SDK's bulk calls on a real redis-server, replies read by the hiredis loop.

A thread stands in for the fleet: it reads the request streams with a consumer
group and answers each batch with one MULTI/EXEC of RPUSHes (a worker's reply
script is one atomic write per batch too), in reverse order within a batch.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from inferfleet.producer import AsyncProducer, Producer, errors, transport
from inferfleet.producer.protocol import (
    GROUP,
    decode_body,
    encode_reply_error,
    encode_reply_ok,
    parse_entry,
)
from tests.helpers import wait_until

ROWS = [np.full((1, 4), i, np.float32) for i in range(3000)]


class BatchWorker:
    """Answers every request of ``streams`` with inputs * 10, ``batch`` at a time; fails ids in
    ``fail``."""

    def __init__(
        self, url: str, streams: list[str], batch: int = 100, fail: frozenset[str] = frozenset()
    ) -> None:
        self.client = redis.Redis.from_url(url)
        self.streams, self.batch, self.fail = streams, batch, fail
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        for stream in streams:
            self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)

    def __enter__(self) -> BatchWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        self.client.close()

    def run(self) -> None:
        while not self.stop.is_set():
            got = self.client.xreadgroup(
                GROUP, "w", dict.fromkeys(self.streams, ">"), count=self.batch, block=20
            )
            for stream, items in got or []:
                pipe = self.client.pipeline(transaction=True)
                for entry_id, fields in reversed(items):
                    env = parse_entry(fields)
                    key = env.reply_to or stream.decode().replace(":requests", f":reply:{env.rid}")
                    if env.rid in self.fail:
                        pipe.rpush(key, encode_reply_error(env.rid, "model_error", "planned"))
                    else:
                        pipe.rpush(
                            key,
                            encode_reply_ok(env.rid, decode_body(env.body)[0] * 10, ("q", "1"), {}),
                        )
                    pipe.xack(stream, GROUP, entry_id)
                pipe.execute()


@pytest.fixture
def hiredis_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*_: object) -> None:
        raise AssertionError("read reply by reply: the hiredis loop was not used")

    monkeypatch.setattr(transport, "_read_each", refuse)
    monkeypatch.setattr(transport, "_aread_each", refuse)
    yield


def check(replies: list, rows: list[np.ndarray]) -> None:
    assert len(replies) == len(rows)
    for reply, x in zip(replies, rows):
        assert reply.ok
        np.testing.assert_array_equal(reply.outputs, x * 10)


@pytest.mark.parametrize("shards", [1, 3])
def test_map_and_imap_in_input_order(
    redis_url: str, redis_client: redis.Redis, hiredis_only: None, shards: int
) -> None:
    with Producer(redis_url, "q", shards=shards) as producer:
        with BatchWorker(redis_url, [k.requests for k in producer.shard_keys], batch=64):
            check(producer.map(ROWS, window=500, timeout_s=20), ROWS)
            unordered = list(producer.imap(ROWS[:300], window=50, timeout_s=20))
            ordered = list(producer.imap(ROWS[:300], window=50, timeout_s=20, ordered=True))
        assert redis_client.exists(*producer.inboxes) == 0  # every reply collected
    assert sorted(float(r.outputs[0, 0]) for r in unordered) == [i * 10.0 for i in range(300)]
    check(ordered, ROWS[:300])


@pytest.mark.parametrize("shards", [1, 3])
def test_submit_many_then_results_behind_and_ahead_of_the_worker(
    redis_url: str, redis_client: redis.Redis, hiredis_only: None, shards: int
) -> None:
    with Producer(redis_url, "q", shards=shards) as producer:
        streams = [k.requests for k in producer.shard_keys]
        rids = producer.submit_many(ROWS, chunk=700)
        assert sum(redis_client.xlen(s) for s in streams) == len(ROWS)
        with BatchWorker(redis_url, streams, batch=50):
            check(producer.results(rids, timeout_s=30), ROWS)  # collected while the worker answers
            more = producer.submit_many(ROWS[:500])
            wait_until(  # all answered first
                lambda: len(redis_client.keys("inferfleet:*:reply:*")) == 500,
                20,
                "the 500 replies written",
                every_s=0.02,
            )
            check(producer.results(more[::-1], timeout_s=30), ROWS[:500][::-1])  # out of order
    assert not redis_client.keys("inferfleet:*:reply:*")


def test_results_raise_errors_and_timeouts(
    redis_url: str, redis_client: redis.Redis, hiredis_only: None
) -> None:
    with Producer(redis_url, "q") as producer:
        rids = producer.submit_many(ROWS[:200])
        with BatchWorker(redis_url, [producer.keys.requests], fail=frozenset({rids[150]})):
            replies = producer.results(rids, timeout_s=20)
        assert [r.ok for r in replies].count(False) == 1 and replies[
            150
        ].error_code == "model_error"
        more = producer.submit_many(ROWS[:3])
        with pytest.raises(errors.ReplyTimeout, match="3 of 3 replies missing"):
            producer.results(more, timeout_s=0.2)


def test_async_map(redis_url: str, redis_client: redis.Redis, hiredis_only: None) -> None:
    async def main() -> list:
        async with AsyncProducer(redis_url, "q") as producer:
            rids = await producer.submit_many(ROWS[:10])
            assert len(rids) == 10
            return await producer.map(ROWS, window=400, timeout_s=20)

    with BatchWorker(redis_url, ["inferfleet:{q}:requests"], batch=80):
        replies = asyncio.run(main())
    check(replies, ROWS)


def test_async_results(redis_url: str, redis_client: redis.Redis, hiredis_only: None) -> None:
    async def main(worker_up: bool) -> list:
        async with AsyncProducer(redis_url, "q") as producer:
            rids = await producer.submit_many(ROWS[:300], chunk=70)
            if worker_up:
                return await producer.results(rids, timeout_s=20)
            with pytest.raises(errors.ReplyTimeout, match="300 of 300 replies missing"):
                await producer.results(rids, timeout_s=0.2)
            return []

    asyncio.run(main(worker_up=False))
    redis_client.flushall()  # the unanswered requests must not reach the worker below
    with BatchWorker(redis_url, ["inferfleet:{q}:requests"], batch=50):
        replies = asyncio.run(main(worker_up=True))
    check(replies, ROWS[:300])


def test_async_imap(redis_url: str, redis_client: redis.Redis, hiredis_only: None) -> None:
    async def main(ordered: bool) -> list:
        async with AsyncProducer(redis_url, "q") as producer:
            replies = producer.imap(ROWS[:300], window=50, timeout_s=20, ordered=ordered)
            return [reply async for reply in replies]

    with BatchWorker(redis_url, ["inferfleet:{q}:requests"], batch=50):
        unordered = asyncio.run(main(ordered=False))
        ordered = asyncio.run(main(ordered=True))
    assert sorted(float(r.outputs[0, 0]) for r in unordered) == [i * 10.0 for i in range(300)]
    check(ordered, ROWS[:300])
