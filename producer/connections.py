"""The SDK's Redis clients and its one seam for redis-py errors.

Every client the producer package uses is built here. redis-py's silent
command retries are off: a retried XADD whose reply was lost would enqueue a
request twice, and a retried pop could lose a reply. The caller sees a
:class:`~inferfleet.producer.errors.ConnectionError` instead and decides.

Timeouts are explicit, never redis-py's defaults (which changed: none up to
redis-py 7, a 5 s read timeout from 8 on). Every client reads with a socket
timeout (:data:`SOCKET_TIMEOUT_S`, or :func:`socket_timeout_for` a longer
block) so a silent partition surfaces as an error within a bounded time, and
sends TCP keepalives (:data:`KEEPALIVE_OPTIONS`). The health check (a PING
before a command on a connection idle :data:`HEALTH_CHECK_INTERVAL_S`) is
set explicitly too: on for the worker's clients, off for the SDK's and the
CLI's, whose documented ACL users (``producer``, ``operator``) may not PING;
with command retries off it would only turn a dead connection's error into
the same ConnectionError one command earlier, which the socket timeout and
keepalive already bound. A wait longer than
:data:`MAX_BLOCK_S` is made of several blocking reads of at most that long
(:func:`block_slices`), so each one ends well within the socket timeout of
any client, also one a caller built with redis-py 8's defaults.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from inferfleet.producer import errors
from inferfleet.producer.sentinel import SentinelURL, is_sentinel_url, parse_sentinel_url

__all__ = [
    "DEFAULT_REDIS_URL",
    "MAX_BLOCK_S",
    "SOCKET_TIMEOUT_S",
    "BLOCK_MARGIN_S",
    "HEALTH_CHECK_INTERVAL_S",
    "KEEPALIVE_OPTIONS",
    "block_slices",
    "client_options",
    "connect",
    "connect_async",
    "close_client",
    "aclose_client",
    "open_client",
    "redis_url",
    "refusal",
    "socket_timeout_for",
    "translate_errors",
    "translated",
]

#: Where clients connect when neither an argument nor ``$REDIS_URL`` says otherwise.
DEFAULT_REDIS_URL = "redis://localhost:6379/0"


def redis_url(url: str | None = None) -> str:
    """``url``, else ``$REDIS_URL``, else :data:`DEFAULT_REDIS_URL`."""
    return url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


#: The longest one blocking read (BLPOP, XREAD BLOCK) of the SDK and the CLI blocks in Redis; a
#: longer
#: wait is several such reads. Well under any client's read timeout, redis-py 8's default 5 s
#: included.
MAX_BLOCK_S = 2.0
#: The read timeout of every client's commands that do not block: a connection silent this long is
#: dead.
SOCKET_TIMEOUT_S = 10.0
#: What the read timeout of a blocking read adds to its block (:func:`socket_timeout_for`).
BLOCK_MARGIN_S = 5.0
#: Seconds to connect before giving up.
CONNECT_TIMEOUT_S = 5.0
#: A worker's connection idle this long is PINGed before its next command (redis-py's health check);
#: the SDK's clients pass 0 (off): see the module docstring.
HEALTH_CHECK_INTERVAL_S = 30
#: TCP keepalive: first probe after 10 s idle, then every 5 s, dead after 3 unanswered (where the OS
#: has them).
KEEPALIVE_OPTIONS: dict[int, int] = {
    option: value
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
    if (option := getattr(socket, name, None)) is not None
}


def socket_timeout_for(block_s: float = 0.0) -> float:
    """The read timeout of a client whose longest blocking read blocks ``block_s``: always longer
    than it."""
    return max(SOCKET_TIMEOUT_S, block_s + BLOCK_MARGIN_S)


def block_slices(timeout_s: float, clock: Callable[[], float] = time.monotonic) -> Iterator[float]:
    """The blocks of a wait of ``timeout_s``: each at most :data:`MAX_BLOCK_S`, together
    ``timeout_s``.

    The caller blocks for each value it gets and stops iterating once it has
    what it waited for; the first block is at least 10 ms (a zero timeout is
    "forever" to Redis).
    """
    deadline = clock() + timeout_s
    yield min(MAX_BLOCK_S, max(timeout_s, 0.01))
    while (left := deadline - clock()) > 0:
        yield min(MAX_BLOCK_S, max(left, 0.01))


def client_options(block_s: float = 0.0, health_check_s: int = 0) -> dict[str, Any]:
    """Every client's timeouts, keepalive and health check (``health_check_s``, 0: off),
    for reads that block at most ``block_s``."""
    return {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": socket_timeout_for(block_s),
        "socket_keepalive": True,
        "socket_keepalive_options": KEEPALIVE_OPTIONS,
        "health_check_interval": health_check_s,
    }


def connect(url: str, cluster: bool = False) -> Any:
    """A redis.Redis, or a RedisCluster when asked, with redis-py's command retries off."""
    return open_client(url, cluster, client_options(MAX_BLOCK_S))


def connect_async(url: str, cluster: bool = False) -> Any:
    """The asyncio twin of :func:`connect`."""
    return open_client(url, cluster, client_options(MAX_BLOCK_S), asyncio=True)


def open_client(url: str, cluster: bool, options: dict[str, Any], asyncio: bool = False) -> Any:
    """The one place a client is made from a URL: a Redis, a RedisCluster, or the primary a
    Sentinel URL names (:mod:`~inferfleet.producer.sentinel`), each with redis-py's command
    retries off and ``options`` (:func:`client_options`). ValueError for a bad URL."""
    retry = AsyncRetry(NoBackoff(), 0) if asyncio else Retry(NoBackoff(), 0)
    if is_sentinel_url(url):
        if cluster:
            raise ValueError("a Sentinel URL names one primary, not a cluster: drop --cluster")
        return _primary(parse_sentinel_url(url), retry, options, asyncio)
    if cluster:
        factory = AsyncRedisCluster.from_url if asyncio else RedisCluster.from_url
    else:
        factory = aioredis.Redis.from_url if asyncio else redis.Redis.from_url
    return factory(url, retry=retry, **options)


def close_client(client: Any) -> None:
    """Close ``client``'s connections, and its Sentinels' where a Sentinel URL made it."""
    client.close()
    for sentinel in _sentinels_of(client):
        sentinel.close()


async def aclose_client(client: Any) -> None:
    """The asyncio twin of :func:`close_client`."""
    await client.aclose()
    for sentinel in _sentinels_of(client):
        await sentinel.aclose()


def _sentinels_of(client: Any) -> list[Any]:
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    return list(getattr(manager, "sentinels", []))


def _primary(target: SentinelURL, retry: Any, options: dict[str, Any], asyncio: bool) -> Any:
    """A client of the primary the Sentinels name, asked again on every new connection."""
    sentinel_kwargs = {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "username": target.sentinel_username,
        "password": target.sentinel_password,
    }
    cls = AsyncSentinel if asyncio else Sentinel
    sentinels = cls(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
    return sentinels.master_for(
        target.service,
        db=target.db,
        username=target.username,
        password=target.password,
        ssl=target.tls,
        retry=retry,
        **options,
    )


def refusal(message: str) -> errors.InferfleetError | None:
    """The SDK error for a refusal of the admission function (``inferfleet_enqueue``), else None.

    ``OVERLOADED backlog max ...`` is :class:`~inferfleet.producer.errors.QueueFull`,
    ``RATELIMITED retry_ms tenant ...`` is :class:`~inferfleet.producer.errors.RateLimited`.
    """
    word, _, rest = message.partition(" ")
    parts = rest.split(" ", 2)
    if word == "OVERLOADED" and len(parts) == 3 and parts[0].isdigit():
        return errors.QueueFull(
            f"the queue's backlog of {parts[0]} is over its fleet-wide max_backlog "
            f"{parts[1]}: back off and retry",
            int(parts[0]),
        )
    if word == "RATELIMITED" and len(parts) == 3 and parts[0].isdigit():
        retry_s = int(parts[0]) / 1000
        return errors.RateLimited(
            f"tenant {parts[1]!r} is over its fleet-wide rate: retry in {retry_s:.3f} s",
            parts[1],
            retry_s,
        )
    return None


#: redis-py's class for an ``OOM`` error reply (its message then lacks the ``OOM`` word)
_OUT_OF_MEMORY = getattr(redis.exceptions, "OutOfMemoryError", redis.exceptions.ResponseError)
if _OUT_OF_MEMORY is redis.exceptions.ResponseError:  # pragma: no cover - an old redis-py
    _OUT_OF_MEMORY = ()  # type: ignore[assignment]


def translated(exc: BaseException) -> BaseException:
    """The SDK's exception for a redis-py one (any other is returned as it is).

    A write refused because Redis is at ``maxmemory`` (``OOM ...``) is
    :class:`~inferfleet.producer.errors.QueueFull`: nothing was written, and
    backing off is what a caller does about a full queue and a full Redis alike.
    """
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return errors.ConnectionError(f"Redis connection failed: {exc}")
    if isinstance(exc, redis.exceptions.ResponseError):
        if isinstance(exc, _OUT_OF_MEMORY) or str(exc).startswith("OOM "):
            return errors.QueueFull(
                f"Redis is out of memory and refused the write ({exc}): nothing was enqueued; "
                "back off and retry once workers have drained the queue (or raise maxmemory)",
                None,
            )
        return refusal(str(exc)) or errors.InferfleetError(f"Redis error: {exc}")
    if isinstance(exc, redis.exceptions.RedisError):
        return errors.InferfleetError(f"Redis error: {exc}")
    if isinstance(exc, redis.exceptions.RedisClusterException):  # not a RedisError: cross-slot
        return errors.InferfleetError(f"Redis Cluster error: {exc}")
    return exc


@contextmanager
def translate_errors() -> Iterator[None]:
    """The one seam where redis-py exceptions become the SDK's own (``raise ... from``)."""
    try:
        yield
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise translated(exc) from exc
