"""Redis going away and coming back: the SDK raises then recovers; a worker waits it out."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import redis

from inferfleet.producer import Producer, errors
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.consumer import Consumer


@pytest.fixture
def aof_redis():
    with EmbeddedRedis(extra_args=("--appendonly", "yes", "--appendfsync", "always")) as server:
        yield server


def test_producer_raises_while_redis_is_down_and_works_after(aof_redis):
    producer = Producer(aof_redis.url, "q")
    first = producer.submit(np.ones((1, 16), np.float32))
    aof_redis.crash()
    with pytest.raises(errors.ConnectionError) as info:
        producer.submit(np.ones((1, 16), np.float32))
    assert isinstance(info.value.__cause__, redis.exceptions.ConnectionError)
    aof_redis.start()
    second = producer.submit(np.ones((1, 16), np.float32))  # reconnects on its own
    client = redis.Redis.from_url(aof_redis.url)
    ids = [f[b"id"].decode() for _, f in client.xrange("inferfleet:{q}:requests")]
    assert ids == [first, second]  # the accepted request survived the crash (AOF)
    client.close()
    producer.close()


def test_worker_waits_out_a_redis_restart_and_carries_on(aof_redis, models_dir, caplog):
    caplog.set_level(logging.WARNING, logger="inferfleet.worker.serving.consumer")
    settings = WorkerSettings(name="q", model=str(models_dir / "affine.pt"), redis_url=aof_redis.url,
                              consumer="c1", idle_block_ms=100, warmup_iters=1)
    consumer = Consumer(settings, load_runtime(settings), redis.Redis.from_url(aof_redis.url))
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        producer = Producer(aof_redis.url, "q")
        assert producer.infer(np.ones((1, 16), np.float32), timeout_s=10).shape == (1, 4)
        aof_redis.crash()
        time.sleep(1.0)
        assert thread.is_alive()
        aof_redis.start()
        replies = producer.map([np.ones((1, 16), np.float32)] * 100, timeout_s=20)
        assert all(r.ok for r in replies) and thread.is_alive()
        assert any("Redis unreachable" in r.getMessage() for r in caplog.records)
    finally:
        stop.set()
        thread.join(10)


def test_a_full_redis_is_waited_out_without_losing_replies(redis_url, redis_client, models_dir, caplog):
    """At maxmemory (noeviction) the reply script is refused: nothing is acknowledged, the round is retried."""
    caplog.set_level(logging.WARNING, logger="inferfleet.worker.serving.consumer")
    settings = WorkerSettings(name="q", model=str(models_dir / "affine.pt"), redis_url=redis_url,
                              consumer="c1", idle_block_ms=100, warmup_iters=1)
    consumer = Consumer(settings, load_runtime(settings), redis.Redis.from_url(redis_url))
    consumer.prepare()
    producer = Producer(redis_url, "q")
    rids = producer.submit_many([np.ones((1, 16), np.float32)] * 20)
    used = int(redis_client.info("memory")["used_memory"])
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", used)  # full: every write that grows memory is refused
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(stop,), daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 10
        while not any("out of memory" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the worker never hit the memory limit"
            time.sleep(0.05)
        assert redis_client.xpending("inferfleet:{q}:requests", "workers")["pending"] == 20  # nothing acked
        redis_client.config_set("maxmemory", 0)
        assert all(r.ok for r in producer.results(rids, timeout_s=15))
    finally:
        redis_client.config_set("maxmemory", 0)
        stop.set()
        thread.join(10)
    assert redis_client.xpending("inferfleet:{q}:requests", "workers")["pending"] == 0
