"""The errors a new user meets first, against a real redis-server: each one says what happened."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inferfleet.producer import AsyncProducer, Producer
from inferfleet.producer.errors import ReplyTimeout
from tests.integration.test_consumer import drain, make_consumer


def test_waiting_on_a_queue_no_worker_ever_served_says_so(redis_url, redis_client):
    producer = Producer(redis_url, "nobody-serves-this")
    rid = producer.submit(np.ones((1, 16), np.float32))
    with pytest.raises(
        ReplyTimeout,
        match=r"no worker has ever served queue 'nobody-serves-this'.*inferfleet worker",
    ):
        producer.result(rid, timeout_s=0.1)


def test_the_async_client_says_so_too(redis_url, redis_client):
    async def wait() -> None:
        async with AsyncProducer(redis_url, "nobody-serves-this") as producer:
            await producer.result("never-sent", timeout_s=0.1)

    with pytest.raises(ReplyTimeout, match="no worker has ever served queue"):
        asyncio.run(wait())


def test_a_second_result_for_a_taken_reply_says_replies_are_read_once(
    redis_url, redis_client, models_dir
):
    consumer = make_consumer(redis_url, str(models_dir / "affine.pt"), idle_block_ms=50)
    producer = Producer(redis_url, "q")
    rid = producer.submit(np.ones((1, 16), np.float32))
    drain(consumer)
    assert producer.result(rid, timeout_s=5).ok
    with pytest.raises(ReplyTimeout, match="already collected \\(replies are read once"):
        producer.result(rid, timeout_s=0.1)


def test_a_wait_on_a_busy_queue_says_how_much_is_ahead(redis_url, redis_client, models_dir):
    make_consumer(
        redis_url, str(models_dir / "affine.pt"), idle_block_ms=50
    )  # the group exists; nobody reads
    producer = Producer(redis_url, "q")
    rids = producer.submit_many([np.ones((1, 16), np.float32)] * 3)
    with pytest.raises(ReplyTimeout, match="queue 'q' has 3 requests waiting and 0 in progress"):
        producer.result(rids[0], timeout_s=0.1)
