"""Producer and AsyncProducer: enqueue inference requests and collect replies.

Both share :class:`_ProducerBase`, which owns everything that is not I/O
(request ids, entry fields, reply decoding); the two subclasses only differ
in how they talk to Redis. Every redis-py exception is translated into the
SDK's own (``producer.errors``) in :func:`_translate`.
"""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import contextmanager
from itertools import count, islice
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer import errors
from producer.protocol import (
    DEFAULT_PREFIX,
    GROUP,
    QueueKeys,
    Reply,
    decode_reply,
    encode_body,
    request_fields,
    validate_request_id,
)

__all__ = ["Producer", "AsyncProducer", "DEFAULT_REDIS_URL"]

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
_POP_COUNT = 1000  # replies taken from an inbox per round trip
_POLL_S = 0.05  # longest blocking wait between rounds of a bulk collect


@contextmanager
def _translate() -> Iterator[None]:
    """The one seam where redis-py exceptions become the SDK's own."""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise errors.ConnectionError(f"Redis connection failed: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise errors.InferfleetError(f"Redis error: {exc}") from exc


def _redis_url(url: str | None) -> str:
    return url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


class _ProducerBase:
    """What both producers share: names, ids, entry fields, limits and reply decoding."""

    def __init__(self, name: str, prefix: str = DEFAULT_PREFIX, default_deadline_s: float | None = 60.0,
                 max_backlog: int | None = None, on_full: str = "raise", full_wait_s: float = 30.0) -> None:
        if default_deadline_s is not None and default_deadline_s <= 0:
            raise ValueError(f"default_deadline_s must be positive or None, got {default_deadline_s}")
        if max_backlog is not None and max_backlog < 1:
            raise ValueError(f"max_backlog must be at least 1 or None, got {max_backlog}")
        if on_full not in ("raise", "wait"):
            raise ValueError(f"on_full must be 'raise' or 'wait', got {on_full!r}")
        self.keys = QueueKeys(name, prefix)
        self.name = name
        self.default_deadline_s = default_deadline_s
        self.max_backlog = max_backlog
        self.on_full = on_full
        self.full_wait_s = full_wait_s
        self._backlog_seen = (0.0, 0)  # (monotonic time, backlog): re-read at most every 50 ms
        token = os.urandom(6).hex()
        self._rid_base = f"{token}-"
        self._rids = count()
        self.inbox = self.keys.inbox(f"p-{token}")
        self._closed = False

    def new_request_id(self) -> str:
        """A request id unique to this producer (random base + counter)."""
        return f"{self._rid_base}{next(self._rids):x}"

    def _entry(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None,
        deadline_s: float | None,
        request_id: str | None = None,
        reply_to: str | None = None,
    ) -> tuple[str, dict]:
        self._check_open()
        rid = validate_request_id(request_id) if request_id is not None else self.new_request_id()
        deadline_ms = None
        deadline_s = self.default_deadline_s if deadline_s is None else deadline_s
        if deadline_s is not None:
            if deadline_s <= 0:
                raise errors.ProtocolError(f"deadline_s must be positive, got {deadline_s}")
            deadline_ms = int((time.time() + deadline_s) * 1000)
        if reply_to is not None and not self.keys.is_inbox(reply_to):
            raise errors.ProtocolError(
                f"reply_to must be a key under {self.keys.inbox_prefix!r}, got {reply_to!r}"
            )
        return rid, request_fields(rid, encode_body(inputs, params), deadline_ms, reply_to)

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InferfleetError("this producer is closed")

    def _over_limit(self, backlog: int, adding: int) -> bool:
        return self.max_backlog is not None and backlog + adding > self.max_backlog

    def _queue_full(self, backlog: int) -> errors.QueueFull:
        return errors.QueueFull(f"queue {self.name!r} has a backlog of {backlog}, over max_backlog "
                                f"{self.max_backlog}: back off and retry", backlog)

    @staticmethod
    def _finish(raw: bytes, raise_errors: bool) -> Reply:
        reply = decode_reply(raw)
        return reply.raise_for_error() if raise_errors else reply

    @staticmethod
    def _lag_from(groups: list[dict], length: int) -> int | None:
        for group in groups:
            gname = group.get("name")
            if gname in (GROUP, GROUP.encode()):
                lag = group.get("lag")
                return int(lag) if lag is not None else None
        return int(length)  # no worker has created the group yet: all is backlog


_LIMITS_DOC = """
    ``default_deadline_s`` (60 s) is the deadline of every request sent
    without one: a worker answers ``expired`` instead of computing a request
    nobody waits for any more (``None``: no deadline). With ``max_backlog``
    set, sending while the queue's backlog (lag) is over it raises
    :class:`~producer.errors.QueueFull` (``on_full="raise"``) or waits up to
    ``full_wait_s`` for room (``on_full="wait"``): the bounded request buffer.

    redis-py's silent command retries are off: a retried XADD could enqueue a
    request twice and a retried pop could lose a reply. A dropped connection
    raises :class:`~producer.errors.ConnectionError`; the next call reconnects.
"""


def _client_options() -> dict[str, Any]:
    return {"socket_connect_timeout": 5, "socket_keepalive": True}


class Producer(_ProducerBase):
    """Enqueue requests on queue ``name`` and collect their replies.

    >>> p = Producer("redis://localhost:6379/0", "ctr")      # doctest: +SKIP
    >>> rid = p.submit(np.zeros((1, 16), np.float32))        # doctest: +SKIP
    >>> p.result(rid, timeout_s=5).outputs                   # doctest: +SKIP

    ``redis_url`` defaults to ``$REDIS_URL``; pass ``client`` to reuse an
    existing ``redis.Redis`` (its ``decode_responses`` must be False).
    """

    __doc__ = (__doc__ or "") + _LIMITS_DOC

    def __init__(
        self,
        redis_url: str | None = None,
        name: str = "default",
        *,
        prefix: str = DEFAULT_PREFIX,
        client: redis.Redis | None = None,
        default_deadline_s: float | None = 60.0,
        max_backlog: int | None = None,
        on_full: str = "raise",
        full_wait_s: float = 30.0,
    ) -> None:
        super().__init__(name, prefix, default_deadline_s, max_backlog, on_full, full_wait_s)
        self._owns_client = client is None
        with _translate():
            self.redis = client or redis.Redis.from_url(
                _redis_url(redis_url), retry=Retry(NoBackoff(), 0), **_client_options()
            )

    def _make_room(self, adding: int) -> None:
        """Enforce max_backlog before sending ``adding`` requests (raise or wait)."""
        if self.max_backlog is None:
            return
        give_up = time.monotonic() + self.full_wait_s
        while True:
            seen_at, backlog = self._backlog_seen
            if time.monotonic() - seen_at > 0.05:
                backlog = self.backlog()
                self._backlog_seen = (time.monotonic(), backlog)
            if not self._over_limit(backlog, adding):
                self._backlog_seen = (seen_at, backlog + adding)
                return
            if self.on_full == "raise" or time.monotonic() > give_up:
                raise self._queue_full(backlog)
            time.sleep(0.02)

    # -- one request -------------------------------------------------------

    def submit(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        request_id: str | None = None,
        reply_to: str | None = None,
    ) -> str:
        """Enqueue one request and return its request id."""
        rid, fields = self._entry(inputs, params, deadline_s, request_id, reply_to)
        self._make_room(1)
        with _translate():
            self.redis.xadd(self.keys.requests, fields)
        return rid

    def result(self, request_id: str, timeout_s: float = 30.0, *, raise_errors: bool = True) -> Reply:
        """Wait up to ``timeout_s`` for the reply to ``request_id``.

        Any process can collect a reply; it is removed once collected. With
        ``raise_errors`` (the default) an ``ok: false`` reply raises the
        matching :class:`~producer.errors.ReplyError`.
        """
        key = self.keys.reply(validate_request_id(request_id))
        with _translate():
            popped = self.redis.blpop([key], timeout=max(timeout_s, 0.01))
        if popped is None:
            raise errors.ReplyTimeout(f"no reply to {request_id!r} within {timeout_s} s")
        return self._finish(popped[1], raise_errors)

    def infer(self, inputs: Any, params: Mapping[str, Any] | None = None, timeout_s: float = 30.0) -> Any:
        """Submit (with the timeout as deadline), wait and return the outputs (raises on an error reply)."""
        return self.result(self.submit(inputs, params, deadline_s=timeout_s), timeout_s).outputs

    # -- many requests -----------------------------------------------------

    def submit_many(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        chunk: int = 1000,
    ) -> list[str]:
        """Enqueue many requests with pipelined XADDs; return their ids in order."""
        rids: list[str] = []
        items = iter(inputs)
        while batch := list(islice(items, chunk)):
            self._make_room(len(batch))
            pipe = self.redis.pipeline(transaction=False)
            for one in batch:
                rid, fields = self._entry(one, params, deadline_s)
                pipe.xadd(self.keys.requests, fields)
                rids.append(rid)
            with _translate():
                pipe.execute()
        return rids

    def results(
        self, request_ids: Sequence[str], timeout_s: float = 30.0, *, raise_errors: bool = False
    ) -> list[Reply]:
        """Collect the replies to ``request_ids`` (in order), polling in pipelines.

        Raises ReplyTimeout if some are still missing after ``timeout_s``.
        """
        keys = {self.keys.reply(validate_request_id(r)): i for i, r in enumerate(request_ids)}
        found: dict[int, Reply] = {}
        deadline = time.monotonic() + timeout_s
        while keys:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.lpop(key)
            with _translate():
                popped = pipe.execute()
            for key, raw in zip(list(keys), popped):
                if raw is not None:
                    found[keys.pop(key)] = self._finish(raw, raise_errors)
            if keys and time.monotonic() > deadline:
                raise errors.ReplyTimeout(f"{len(keys)} of {len(request_ids)} replies missing after {timeout_s} s")
            if keys:
                time.sleep(0.002)
        return [found[i] for i in range(len(request_ids))]

    def map(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = 30.0,
        window: int = 2000,
        deadline_s: float | None = None,
        raise_errors: bool = False,
    ) -> list[Reply]:
        """Run every input through the fleet and return the replies in input order.

        Keeps at most ``window`` requests in flight, sends them pipelined and
        collects replies in bulk from this producer's own inbox, so thousands
        of requests cost a handful of round trips. ``timeout_s`` is the longest
        wait for any next reply; on a stall ReplyTimeout is raised.
        """
        return list(self.imap(inputs, params, timeout_s=timeout_s, window=window,
                              deadline_s=deadline_s, raise_errors=raise_errors, ordered=True))

    def imap(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = 30.0,
        window: int = 2000,
        deadline_s: float | None = None,
        raise_errors: bool = False,
        ordered: bool = False,
        on_send: Callable[[list[str]], None] | None = None,
    ) -> Iterator[Reply]:
        """Like :meth:`map`, but yields replies as they come (or in order).

        ``on_send``, if given, is called with the ids of each pipeline of
        requests just before it is sent (benchmarks time requests with it).
        """
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        items = iter(inputs)
        in_flight: dict[str, int] = {}
        ready: dict[int, Reply] = {}
        next_out = sent = 0
        exhausted = False
        last_progress = time.monotonic()
        while not exhausted or in_flight:
            pipe = self.redis.pipeline(transaction=False)
            batch: list[str] = []
            while not exhausted and len(in_flight) < window:
                one = next(items, _END)
                if one is _END:
                    exhausted = True
                    break
                rid, fields = self._entry(one, params, deadline_s, reply_to=self.inbox)
                pipe.xadd(self.keys.requests, fields)
                in_flight[rid] = sent
                batch.append(rid)
                sent += 1
            pipe.lpop(self.inbox, _POP_COUNT)
            if on_send is not None and batch:
                on_send(batch)
            with _translate():
                popped = pipe.execute()[-1] or []
                if not popped and in_flight:
                    got = self.redis.blpop([self.inbox], timeout=_POLL_S)
                    popped = [got[1]] if got else []
            for raw in popped:
                reply = decode_reply(raw)
                index = in_flight.pop(reply.id, None)
                if index is None:
                    continue  # a stale reply of an earlier, abandoned call
                if raise_errors:
                    reply.raise_for_error()
                last_progress = time.monotonic()
                if ordered:
                    ready[index] = reply
                else:
                    yield reply
            while ordered and next_out in ready:
                yield ready.pop(next_out)
                next_out += 1
            if in_flight and time.monotonic() - last_progress > timeout_s:
                raise errors.ReplyTimeout(
                    f"no reply for {timeout_s} s with {len(in_flight)} requests in flight"
                )

    # -- queue state and lifecycle -----------------------------------------

    def lag(self) -> int | None:
        """Requests waiting to be picked up, or None when Redis cannot tell."""
        return self._lag_and_length()[0]

    def backlog(self) -> int:
        """The lag, or the stream length (an upper bound) when the lag is unknown."""
        lag, length = self._lag_and_length()
        return length if lag is None else lag

    def _lag_and_length(self) -> tuple[int | None, int]:
        with _translate():
            length = int(self.redis.xlen(self.keys.requests))
            groups = self.redis.xinfo_groups(self.keys.requests) if length else []
        return (self._lag_from(groups, length) if length else 0), length

    def close(self) -> None:
        """Release the connection pool (if this producer created it)."""
        if not self._closed and self._owns_client:
            self.redis.close()
        self._closed = True

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_END = object()


class AsyncProducer(_ProducerBase):
    """The asyncio twin of :class:`Producer` (``await p.submit(...)``)."""

    def __init__(
        self,
        redis_url: str | None = None,
        name: str = "default",
        *,
        prefix: str = DEFAULT_PREFIX,
        client: aioredis.Redis | None = None,
        default_deadline_s: float | None = 60.0,
        max_backlog: int | None = None,
        on_full: str = "raise",
        full_wait_s: float = 30.0,
    ) -> None:
        super().__init__(name, prefix, default_deadline_s, max_backlog, on_full, full_wait_s)
        self._owns_client = client is None
        with _translate():
            self.redis = client or aioredis.Redis.from_url(
                _redis_url(redis_url), retry=AsyncRetry(NoBackoff(), 0), **_client_options()
            )

    async def _make_room(self, adding: int) -> None:
        """Enforce max_backlog before sending ``adding`` requests (raise or wait)."""
        if self.max_backlog is None:
            return
        give_up = time.monotonic() + self.full_wait_s
        while True:
            backlog = await self.backlog()
            if not self._over_limit(backlog, adding):
                return
            if self.on_full == "raise" or time.monotonic() > give_up:
                raise self._queue_full(backlog)
            await asyncio.sleep(0.02)

    async def submit(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        request_id: str | None = None,
        reply_to: str | None = None,
    ) -> str:
        """Enqueue one request and return its request id."""
        rid, fields = self._entry(inputs, params, deadline_s, request_id, reply_to)
        await self._make_room(1)
        with _translate():
            await self.redis.xadd(self.keys.requests, fields)
        return rid

    async def result(self, request_id: str, timeout_s: float = 30.0, *, raise_errors: bool = True) -> Reply:
        """Wait up to ``timeout_s`` for the reply to ``request_id``."""
        key = self.keys.reply(validate_request_id(request_id))
        with _translate():
            popped = await self.redis.blpop([key], timeout=max(timeout_s, 0.01))
        if popped is None:
            raise errors.ReplyTimeout(f"no reply to {request_id!r} within {timeout_s} s")
        return self._finish(popped[1], raise_errors)

    async def infer(self, inputs: Any, params: Mapping[str, Any] | None = None, timeout_s: float = 30.0) -> Any:
        """Submit (with the timeout as deadline), wait and return the outputs (raises on an error reply)."""
        return (await self.result(await self.submit(inputs, params, deadline_s=timeout_s), timeout_s)).outputs

    async def submit_many(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        chunk: int = 1000,
    ) -> list[str]:
        """Enqueue many requests with pipelined XADDs; return their ids in order."""
        rids: list[str] = []
        items = iter(inputs)
        while batch := list(islice(items, chunk)):
            await self._make_room(len(batch))
            pipe = self.redis.pipeline(transaction=False)
            for one in batch:
                rid, fields = self._entry(one, params, deadline_s)
                pipe.xadd(self.keys.requests, fields)
                rids.append(rid)
            with _translate():
                await pipe.execute()
        return rids

    async def map(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = 30.0,
        window: int = 2000,
        deadline_s: float | None = None,
        raise_errors: bool = False,
    ) -> list[Reply]:
        """Run every input through the fleet; replies in input order (see Producer.map)."""
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        items = iter(inputs)
        in_flight: dict[str, int] = {}
        found: dict[int, Reply] = {}
        sent = 0
        exhausted = False
        last_progress = time.monotonic()
        while not exhausted or in_flight:
            pipe = self.redis.pipeline(transaction=False)
            while not exhausted and len(in_flight) < window:
                one = next(items, _END)
                if one is _END:
                    exhausted = True
                    break
                rid, fields = self._entry(one, params, deadline_s, reply_to=self.inbox)
                pipe.xadd(self.keys.requests, fields)
                in_flight[rid] = sent
                sent += 1
            pipe.lpop(self.inbox, _POP_COUNT)
            with _translate():
                popped = (await pipe.execute())[-1] or []
                if not popped and in_flight:
                    got = await self.redis.blpop([self.inbox], timeout=_POLL_S)
                    popped = [got[1]] if got else []
            for raw in popped:
                reply = decode_reply(raw)
                index = in_flight.pop(reply.id, None)
                if index is None:
                    continue
                found[index] = reply.raise_for_error() if raise_errors else reply
                last_progress = time.monotonic()
            if in_flight and time.monotonic() - last_progress > timeout_s:
                raise errors.ReplyTimeout(
                    f"no reply for {timeout_s} s with {len(in_flight)} requests in flight"
                )
        return [found[i] for i in range(sent)]

    async def lag(self) -> int | None:
        """Requests waiting to be picked up, or None when Redis cannot tell."""
        return (await self._lag_and_length())[0]

    async def backlog(self) -> int:
        """The lag, or the stream length (an upper bound) when the lag is unknown."""
        lag, length = await self._lag_and_length()
        return length if lag is None else lag

    async def _lag_and_length(self) -> tuple[int | None, int]:
        with _translate():
            length = int(await self.redis.xlen(self.keys.requests))
            groups = await self.redis.xinfo_groups(self.keys.requests) if length else []
        return (self._lag_from(groups, length) if length else 0), length

    async def close(self) -> None:
        """Release the connection pool (if this producer created it)."""
        if not self._closed and self._owns_client:
            await self.redis.aclose()
        self._closed = True

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
