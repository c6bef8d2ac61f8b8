"""Waits longer than any client library's default read timeout, and connections that go silent.

redis-py 8 reads with a 5 s socket timeout by default, redis-py 5 to 7 with
none: a wait must not depend on either. Every client the project builds sets
its own timeouts, and a long wait is several short blocking reads, so

* a reply 7 s away is waited for through the SDK, the async SDK and
  ``inferfleet enqueue --wait``, on every supported redis-py;
* a silent partition (a TCP proxy that stops forwarding) is an error within
  a bounded time for the SDK and the worker, which then serves again once
  the network is back.

tests/integration/test_redis_py_range.py runs this module again under the
oldest supported redis-py (``INFERFLEET_EXPECT_REDIS_PY`` names the version it
must find).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis

from inferfleet.producer import AsyncProducer, Producer, errors
from inferfleet.producer.connections import (
    BLOCK_MARGIN_S,
    HEALTH_CHECK_INTERVAL_S,
    MAX_BLOCK_S,
    SOCKET_TIMEOUT_S,
    block_slices,
)
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import admin_client, worker_client
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.consumer import Consumer
from tests.conftest import ROOT, worker_env
from tests.stallproxy import StallProxy

#: The reply comes this long after the clients start waiting: longer than redis-py 8's 5 s default.
DELAY_S = 7.0


def test_the_redis_py_under_test_is_the_one_asked_for():
    expected = os.environ.get("INFERFLEET_EXPECT_REDIS_PY")
    if (
        expected
    ):  # set by test_redis_py_range.py: the oldest supported version must really be the one loaded
        assert redis.__version__ == expected
    assert tuple(int(p) for p in redis.__version__.split(".")[:2]) >= (5, 0)


def _start_consumer(
    redis_url: str, models_dir, stop: threading.Event, url: str | None = None, block_s: float = 0.1
) -> threading.Thread:
    settings = WorkerSettings(
        name="q",
        model=str(models_dir / "affine.pt"),
        redis_url=url or redis_url,
        consumer="c1",
        idle_block_ms=int(block_s * 1000),
        warmup_iters=1,
        housekeeping_s=0.2,
    )
    consumer = Consumer(
        settings, load_runtime(settings), worker_client(settings.redis_url, block_s=block_s)
    )
    thread = threading.Thread(target=consumer.run, args=(stop,), daemon=True)
    thread.start()
    return thread


def test_a_reply_7_s_away_reaches_the_sdk_the_async_sdk_and_the_cli(
    redis_url, redis_client, models_dir, tmp_path
):
    x = np.ones((1, 16), np.float32)
    np.save(tmp_path / "x.npy", x)
    producer = Producer(redis_url, "q")
    rids = [producer.submit(x), producer.submit(x)]
    got: dict[str, object] = {}

    async def async_wait() -> None:
        async with AsyncProducer(redis_url, "q") as client:
            got["async"] = await client.result(rids[1], timeout_s=30)

    waiters = [
        threading.Thread(target=lambda: got.update(sdk=producer.result(rids[0], timeout_s=30))),
        threading.Thread(target=lambda: asyncio.run(async_wait())),
    ]
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferfleet",
            "enqueue",
            "--name",
            "q",
            "--input",
            str(tmp_path / "x.npy"),
            "--wait",
            "--timeout-s",
            "30",
        ],
        env=worker_env(redis_url),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    for waiter in waiters:
        waiter.start()
    time.sleep(DELAY_S)  # nobody serves the queue yet: every client is still waiting
    assert all(w.is_alive() for w in waiters) and cli.poll() is None
    stop = threading.Event()
    worker = _start_consumer(redis_url, models_dir, stop)
    try:
        out, err = cli.communicate(timeout=60)
        for waiter in waiters:
            waiter.join(60)
    finally:
        stop.set()
        worker.join(10)
    assert cli.returncode == 0, err.decode(errors="replace")
    assert json.loads(out)["ok"] is True
    for kind in ("sdk", "async"):
        reply = got[kind]
        assert reply.ok and reply.outputs.shape == (1, 4), kind  # type: ignore[attr-defined]
        assert reply.timing["queued_ms"] >= DELAY_S * 1000  # type: ignore[attr-defined]  # it really waited


def test_a_long_wait_is_several_short_blocking_reads():
    now = [0.0]

    def clock() -> float:
        return now[0]

    blocks = []
    for block in block_slices(7.0, clock):
        blocks.append(block)
        now[0] += block
    assert blocks == [MAX_BLOCK_S] * 3 + [1.0]
    assert list(block_slices(0, clock)) == [0.01]  # never 0: that is "forever" to Redis


@pytest.mark.parametrize(
    ("build", "health_check_s"),
    [
        (lambda url: Producer(url, "q").redis, 0),  # the producer ACL user may not PING
        (admin_client, 0),  # nor may the operator user
        (worker_client, HEALTH_CHECK_INTERVAL_S),
        (lambda url: worker_client(url, block_s=60.0), HEALTH_CHECK_INTERVAL_S),
    ],
)
def test_every_client_reads_with_a_timeout_longer_than_its_blocks(build, health_check_s, redis_url):
    client = build(redis_url)
    options = client.connection_pool.connection_kwargs
    assert options["socket_timeout"] >= max(SOCKET_TIMEOUT_S, MAX_BLOCK_S + BLOCK_MARGIN_S)
    assert (
        options["socket_keepalive"] is True and options["health_check_interval"] == health_check_s
    )
    if hasattr(__import__("socket"), "TCP_KEEPIDLE"):
        assert options["socket_keepalive_options"]
    client.close()


def test_a_long_idle_block_gets_a_longer_read_timeout(redis_url):
    client = worker_client(redis_url, block_s=60.0)
    assert client.connection_pool.connection_kwargs["socket_timeout"] == 60.0 + BLOCK_MARGIN_S
    client.close()


def test_the_sdk_reports_a_silent_partition_instead_of_hanging(redis_server, redis_client):
    with StallProxy(redis_server.port) as proxy:
        producer = Producer(proxy.url, "q")
        rid = producer.submit(np.ones((1, 16), np.float32))
        proxy.stall()
        with pytest.raises(errors.ConnectionError) as info:
            producer.result(
                rid, timeout_s=600
            )  # without a read timeout this would hang for 10 minutes
        assert "imeout" in str(info.value)
        producer.close()


def test_a_worker_notices_a_silent_partition_and_serves_again_after_it(
    redis_server, redis_client, models_dir, caplog
):
    caplog.set_level(logging.WARNING, logger="inferfleet.worker.serving.consumer")
    stop = threading.Event()
    with StallProxy(redis_server.port) as proxy:
        worker = _start_consumer(redis_server.url, models_dir, stop, url=proxy.url)
        try:
            producer = Producer(
                redis_server.url, "q"
            )  # straight to Redis: only the worker is cut off
            assert producer.infer(np.ones((1, 16), np.float32), timeout_s=30).shape == (1, 4)
            proxy.stall()
            rid = producer.submit(np.ones((1, 16), np.float32))
            deadline = (
                time.monotonic() + 4 * SOCKET_TIMEOUT_S
            )  # redis-py 5-7's default: hours of waiting
            while not any("Timeout" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, (
                    "the worker never noticed the stalled connection"
                )
                time.sleep(0.1)
            proxy.resume()
            assert producer.result(rid, timeout_s=60).ok
        finally:
            stop.set()
            worker.join(30)
    assert not worker.is_alive()
