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
    settings = WorkerSettings(
        name="q",
        model=str(models_dir / "affine.pt"),
        redis_url=aof_redis.url,
        consumer="c1",
        idle_block_ms=100,
        warmup_iters=1,
    )
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


def test_a_full_redis_is_waited_out_without_losing_replies(
    redis_url, redis_client, models_dir, caplog
):
    """At maxmemory (noeviction) the reply script is refused: nothing is acknowledged, the round is
    retried."""
    caplog.set_level(logging.WARNING, logger="inferfleet.worker.serving.consumer")
    settings = WorkerSettings(
        name="q",
        model=str(models_dir / "affine.pt"),
        redis_url=redis_url,
        consumer="c1",
        idle_block_ms=100,
        warmup_iters=1,
    )
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
        assert (
            redis_client.xpending("inferfleet:{q}:requests", "workers")["pending"] == 20
        )  # nothing acked
        redis_client.config_set("maxmemory", 0)
        assert all(r.ok for r in producer.results(rids, timeout_s=15))
    finally:
        redis_client.config_set("maxmemory", 0)
        stop.set()
        thread.join(10)
    assert redis_client.xpending("inferfleet:{q}:requests", "workers")["pending"] == 0


def test_redis_full_for_several_backoff_rounds_dead_letters_nothing(
    redis_url, redis_client, models_dir, caplog
):
    """Full for >= 6 s under load: each failed reply write makes the worker replay its own
    pending entries; those retries are not deliveries, so no innocent request is dead-lettered.

    maxmemory is set well below what Redis holds, so that every reply write of the period is
    refused (pinned at what it holds, memory hovers around the limit and whether a reply is
    refused is a matter of timing)."""
    caplog.set_level(logging.WARNING, logger="inferfleet.worker.serving.consumer")
    settings = WorkerSettings(
        name="q",
        model=str(models_dir / "affine.pt"),
        redis_url=redis_url,
        consumer="c1",
        idle_block_ms=100,
        warmup_iters=1,
        max_deliveries=3,
    )
    consumer = Consumer(settings, load_runtime(settings), redis.Redis.from_url(redis_url))
    consumer.prepare()  # joined before Redis is full: the rounds that fail are reply writes
    producer = Producer(redis_url, "q")
    accepted: list[str] = producer.submit_many([np.ones((1, 16), np.float32)] * 50)
    stop, stop_load = threading.Event(), threading.Event()

    def load() -> (
        None
    ):  # a steady stream of requests; the ones Redis refuses while full are not accepted
        while not stop_load.is_set():
            try:
                accepted.append(producer.submit(np.ones((1, 16), np.float32)))
            except errors.InferfleetError:
                pass
            time.sleep(0.005)

    threads = [
        threading.Thread(target=consumer.run, args=(stop,), daemon=True),
        threading.Thread(target=load, daemon=True),
    ]
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", int(redis_client.info("memory")["used_memory"]) // 2)
    for thread in threads:
        thread.start()
    try:
        time.sleep(6.5)  # full for several of the worker's backoff rounds (0.1, 0.2, 0.4 ... s)
        redis_client.config_set("maxmemory", 0)
        stop_load.set()
        threads[1].join(10)
        full_rounds = sum("out of memory" in r.getMessage() for r in caplog.records)
        assert (
            full_rounds >= 4
        )  # enough failed rounds to pass --max-deliveries 3 if retries counted
        replies = Producer(redis_url, "q").results(accepted, timeout_s=60)
    finally:
        redis_client.config_set("maxmemory", 0)
        stop_load.set()
        stop.set()
        threads[0].join(10)
    assert [r.error_code for r in replies if not r.ok] == []
    assert redis_client.xlen("inferfleet:{q}:dead") == 0
    assert redis_client.xpending("inferfleet:{q}:requests", "workers")["pending"] == 0
