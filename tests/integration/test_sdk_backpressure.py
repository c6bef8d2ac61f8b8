"""Producer and AsyncProducer read the backlog alike: one cached read for a burst of sends.

Issue 28: the async backpressure used to read the backlog on every call. Both
now share ProducerBase's cache, so with a backlog limit set a burst of
submits costs one backlog read per BACKLOG_CACHE_S, counted here with the
server's own commandstats while the clock of the shared code is stepped.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest
import redis

from inferfleet.producer import AsyncProducer, Producer, base, defaults

SENDS = 60
STEP_EVERY = 10  # sends between two steps of the clock, each past the cache's interval
LANES = 3  # a backlog read is one XLEN per lane of the (unsharded) queue
ROW = np.zeros((1, 4), np.float32)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The shared code's monotonic clock, stepped by the test (wall time stays real)."""
    now = [time.monotonic()]
    fake = SimpleNamespace(monotonic=lambda: now[0], time=time.time)
    monkeypatch.setattr(base, "time", fake)
    return now


def _reads(client: redis.Redis) -> tuple[int, int]:
    """(backlog reads, limits reads) since the last CONFIG RESETSTAT."""
    stats = client.info("commandstats")
    xlen = stats.get("cmdstat_xlen", {}).get("calls", 0)
    exists = stats.get("cmdstat_exists", {}).get("calls", 0)
    return xlen // LANES, exists


def _step(clock: list[float], sent: int) -> None:
    if sent % STEP_EVERY == 0:
        clock[0] += defaults.BACKLOG_CACHE_S * 2


def _sync_reads(url: str, client: redis.Redis, clock: list[float]) -> tuple[int, int]:
    client.config_resetstat()
    with Producer(url, "bp-sync", max_backlog=10 * SENDS) as p:
        for sent in range(SENDS):
            _step(clock, sent)
            p.submit(ROW)
    return _reads(client)


def _async_reads(url: str, client: redis.Redis, clock: list[float]) -> tuple[int, int]:
    async def main() -> None:
        async with AsyncProducer(url, "bp-async", max_backlog=10 * SENDS) as p:
            for sent in range(SENDS):
                _step(clock, sent)
                await p.submit(ROW)

    client.config_resetstat()
    asyncio.run(main())
    return _reads(client)


def test_both_producers_read_the_backlog_once_per_interval(
    redis_url: str, redis_client: redis.Redis, clock: list[float]
) -> None:
    sync = _sync_reads(redis_url, redis_client, clock)
    aio = _async_reads(redis_url, redis_client, clock)
    assert sync == aio
    backlog_reads, limits_reads = sync
    assert backlog_reads == SENDS // STEP_EVERY  # one a step, not one a send
    assert limits_reads == 1  # the steps stay within LIMITS_S
