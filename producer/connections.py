"""The SDK's Redis clients and its one seam for redis-py errors.

Every client the producer package uses is built here. redis-py's silent
command retries are off: a retried XADD whose reply was lost would enqueue a
request twice, and a retried pop could lose a reply. The caller sees a
:class:`~inferfleet.producer.errors.ConnectionError` instead and decides.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from inferfleet.producer import errors

__all__ = ["DEFAULT_REDIS_URL", "connect", "connect_async", "redis_url", "refusal", "translate_errors"]

#: Where clients connect when neither an argument nor ``$REDIS_URL`` says otherwise.
DEFAULT_REDIS_URL = "redis://localhost:6379/0"


def redis_url(url: str | None = None) -> str:
    """``url``, else ``$REDIS_URL``, else :data:`DEFAULT_REDIS_URL`."""
    return url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def _client_options() -> dict[str, Any]:
    return {"socket_connect_timeout": 5, "socket_keepalive": True}


def connect(url: str, cluster: bool = False) -> Any:
    """A redis.Redis, or a RedisCluster when asked, with redis-py's command retries off."""
    factory = RedisCluster.from_url if cluster else redis.Redis.from_url
    return factory(url, retry=Retry(NoBackoff(), 0), **_client_options())


def connect_async(url: str, cluster: bool = False) -> Any:
    """The asyncio twin of :func:`connect`."""
    factory = AsyncRedisCluster.from_url if cluster else aioredis.Redis.from_url
    return factory(url, retry=AsyncRetry(NoBackoff(), 0), **_client_options())


def refusal(message: str) -> errors.InferfleetError | None:
    """The SDK error for a refusal of the admission function (``inferfleet_enqueue``), else None.

    ``OVERLOADED backlog max ...`` is :class:`~inferfleet.producer.errors.QueueFull`,
    ``RATELIMITED retry_ms tenant ...`` is :class:`~inferfleet.producer.errors.RateLimited`.
    """
    word, _, rest = message.partition(" ")
    parts = rest.split(" ", 2)
    if word == "OVERLOADED" and len(parts) == 3 and parts[0].isdigit():
        return errors.QueueFull(f"the queue's backlog of {parts[0]} is over its fleet-wide max_backlog "
                                f"{parts[1]}: back off and retry", int(parts[0]))
    if word == "RATELIMITED" and len(parts) == 3 and parts[0].isdigit():
        retry_s = int(parts[0]) / 1000
        return errors.RateLimited(f"tenant {parts[1]!r} is over its fleet-wide rate: retry in {retry_s:.3f} s",
                                  parts[1], retry_s)
    return None


@contextmanager
def translate_errors() -> Iterator[None]:
    """The one seam where redis-py exceptions become the SDK's own (``raise ... from``)."""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise errors.ConnectionError(f"Redis connection failed: {exc}") from exc
    except redis.exceptions.ResponseError as exc:
        raise refusal(str(exc)) or errors.InferfleetError(f"Redis error: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise errors.InferfleetError(f"Redis error: {exc}") from exc
    except redis.exceptions.RedisClusterException as exc:  # not a RedisError: cross-slot and the like
        raise errors.InferfleetError(f"Redis Cluster error: {exc}") from exc
