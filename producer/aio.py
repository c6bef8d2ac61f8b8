"""AsyncProducer: the asyncio SDK client, the same calls as Producer, awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from inferfleet.producer import defaults, errors
from inferfleet.producer.base import ProducerBase, missing_reply_message, sum_shards
from inferfleet.producer.bulk import InOrder, MapRun, place
from inferfleet.producer.connections import (
    aclose_client,
    block_slices,
    connect_async,
    translate_errors,
)
from inferfleet.producer.connections import redis_url as resolve_url
from inferfleet.producer.durability import Durability
from inferfleet.producer.protocol import (
    DEFAULT_PREFIX,
    BodyEncoder,
    QueueKeys,
    Reply,
    validate_request_id,
)
from inferfleet.producer.reader import AsyncReplyReader
from inferfleet.producer.sharing import (
    LIBRARY,
    limits_key,
    validate_priority,
)
from inferfleet.producer.streaming import AsyncChunkStream
from inferfleet.producer.transport import Round, arun, raise_first_error
from inferfleet.producer.writes import AsyncWriteBatcher

__all__ = ["AsyncProducer"]


class AsyncProducer(ProducerBase):
    """The asyncio twin of :class:`Producer` (``await p.submit(...)``)."""

    def __init__(
        self,
        redis_url: str | None = None,
        name: str = defaults.NAME,
        *,
        prefix: str = DEFAULT_PREFIX,
        client: aioredis.Redis | AsyncRedisCluster | None = None,
        default_deadline_s: float | None = defaults.DEADLINE_S,
        max_backlog: int | None = None,
        on_full: str = defaults.ON_FULL,
        full_wait_s: float = defaults.FULL_WAIT_S,
        shards: int = defaults.SHARDS,
        cluster: bool = False,
        tenant: str | None = None,
        durability: Durability | None = None,
    ) -> None:
        super().__init__(
            name,
            prefix,
            default_deadline_s,
            max_backlog,
            on_full,
            full_wait_s,
            shards,
            tenant,
            durability,
        )
        self._owns_client = client is None
        self.cluster = cluster or isinstance(client, AsyncRedisCluster)
        self._url = resolve_url(redis_url)
        with translate_errors():
            self.redis = client or connect_async(self._url, self.cluster)
        self._fresh_io()

    def _fresh_io(self) -> None:
        self._limits_reading: asyncio.Future | None = None
        self._replies = AsyncReplyReader(self.redis, self.inboxes, self.cluster)
        self._writes = AsyncWriteBatcher(self._send_round)

    async def _send_round(self, round_: Round, keep_errors: bool = True) -> list[Any]:
        """The twin of :meth:`Producer._send_round
        <inferfleet.producer.sync.Producer._send_round>`."""
        writes = round_.replies
        waits = self.durable_waits(round_)
        replies = await arun(self.redis, round_, keep_errors=True)
        return await self._confirmed(replies, writes, waits, keep_errors)

    async def _confirmed(self, replies: list, writes: int, waits: int, keep_errors: bool) -> list:
        """``replies`` with durability's verdict applied; after a shortfall the idle connections
        are closed, so the next call finds the primary again."""
        out, stale = self.durable_verdict(replies, writes, waits)
        if stale is not None:
            await stale.disconnect(inuse_connections=False)
        return out if keep_errors else raise_first_error(out)

    def _reset_io(self) -> None:
        """In a forked child: new connections where this producer made its client (asyncio
        connections know nothing of forks; a client passed in is the caller's to replace),
        a new reply reader and write batcher."""
        if self._owns_client:
            self.redis = connect_async(self._url, self.cluster)
        self._fresh_io()

    async def _make_room(self, adding: int) -> None:
        """Enforce max_backlog before sending ``adding`` requests (raise or wait)."""
        if self.max_backlog is None:
            return
        give_up = time.monotonic() + self.full_wait_s
        while True:
            backlog = self._backlog_cached()
            if backlog is None:
                backlog = self._backlog_read(await self.backlog())
            if self._room_taken(backlog, adding):
                return
            self._give_up(backlog, give_up)
            await asyncio.sleep(defaults.FULL_POLL_S)

    async def _check_limits(self) -> bool:
        """Whether fleet-wide limits are in force.

        One EXISTS a second at most, however many tasks send at once (they await
        the same read); loads the functions once.
        """
        if self._limits_due():
            reading = self._limits_reading
            if reading is None or reading.done():
                reading = self._limits_reading = asyncio.ensure_future(self._read_limits())
            await asyncio.shield(reading)
        return self._admitting()

    async def _read_limits(self) -> None:
        with translate_errors():
            in_force = bool(await self.redis.exists(limits_key(self.keys)))
            if in_force and not self._library_loaded:
                self._library_loaded = True
                # every worker loads it too: a producer user without FUNCTION LOAD does without
                try:
                    await self.redis.function_load(LIBRARY, replace=True)
                except redis.exceptions.ResponseError:
                    pass
        self._limits_read(in_force)

    async def submit(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        request_id: str | None = None,
        reply_to: str | None = None,
        priority: str = defaults.PRIORITY,
    ) -> str:
        """Enqueue one request on the lane of ``priority`` and return its request id."""
        rid, keys, fields = self._entry(inputs, params, deadline_s, request_id, reply_to)
        await self._send_one(rid, keys, fields, priority)
        return rid

    async def stream(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        request_id: str | None = None,
        priority: str = defaults.PRIORITY,
        timeout_s: float = defaults.TIMEOUT_S,
    ) -> AsyncChunkStream:
        """Enqueue one request that asks for a streamed reply (see Producer.stream); ``async
        for`` over the returned stream gives its chunks as they are made."""
        rid, keys, fields = self._entry(inputs, params, deadline_s, request_id, stream=True)
        await self._send_one(rid, keys, fields, priority)
        return await self.read_stream(rid, timeout_s=timeout_s)

    async def read_stream(
        self, request_id: str, *, after: str = "0", timeout_s: float = defaults.TIMEOUT_S
    ) -> AsyncChunkStream:
        """The chunks of request ``request_id``'s stream after entry id ``after`` (see
        Producer.read_stream); awaited like every call of this client, it reads nothing yet."""
        key = self.keys_for(request_id).chunks(validate_request_id(request_id))
        return AsyncChunkStream(self.redis, request_id, key, timeout_s, after)

    async def _send_one(self, rid: str, keys: QueueKeys, fields: dict, priority: str) -> None:
        """One request's XADD (or FCALL), sent with the other tasks' of this loop tick."""
        lane = self.lanes[self.shard_of(rid)][validate_priority(priority)]
        await self._make_room(1)
        await self._check_limits()
        with translate_errors():
            await self._writes.write(self._write_args(keys, lane, rid, fields))

    async def cancel(self, request_id: str) -> str:
        """Cancel a request no worker has computed yet (see Producer.cancel)."""
        return self._one_cancelled(request_id, (await self.cancel_many([request_id]))[0])

    async def cancel_many(self, request_ids: Sequence[str]) -> list[str]:
        """Cancel many requests (see Producer.cancel_many)."""
        found: dict[str, str] = {}
        with translate_errors():
            if not self._library_loaded:
                self._library_loaded = True
                try:  # every worker loads it too
                    await self.redis.function_load(LIBRARY, replace=True)
                except redis.exceptions.ResponseError:
                    pass
            for args in self._cancel_args(request_ids):
                found.update(
                    self._cancel_found(args, await self.redis.execute_command("FCALL", *args))
                )
        return [found[rid] for rid in request_ids]

    async def result(
        self, request_id: str, timeout_s: float = defaults.TIMEOUT_S, *, raise_errors: bool = True
    ) -> Reply:
        """Wait up to ``timeout_s`` for the reply to ``request_id``."""
        key = self.keys_for(request_id).reply(validate_request_id(request_id))
        popped = None
        with translate_errors():
            for block_s in block_slices(timeout_s):
                popped = await self.redis.blpop([key], timeout=block_s)
                if popped is not None:
                    break
        if popped is None:
            raise errors.ReplyTimeout(await self._missing(request_id, timeout_s))
        return self._finish(popped[1], raise_errors)

    async def _missing(self, request_id: str, timeout_s: float) -> str:
        """The timeout's message, saying why if the queue's state tells (on timeouts only)."""
        keys = self.keys_for(request_id)
        try:
            groups = (
                await self.redis.xinfo_groups(keys.requests)
                if await self.redis.exists(keys.requests)
                else None
            )
        except redis.exceptions.RedisError:
            return f"no reply to {request_id!r} within {timeout_s} s"
        return missing_reply_message(request_id, timeout_s, keys, groups)

    async def infer(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
        timeout_s: float = defaults.TIMEOUT_S,
        *,
        priority: str = defaults.PRIORITY,
    ) -> Any:
        """Submit (with the timeout as deadline), wait and return the outputs.

        Raises on an error reply. The reply comes to this producer's inbox, where
        its one reader task hands it to this call: any number of tasks of one loop
        may await ``infer`` on one producer; cancelling one leaves the others be.
        """
        rid, keys, fields = self._entry(inputs, params, timeout_s, to_inbox=True)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def hand(got: Any) -> None:
            if not done.done():
                done.set_result(got)

        self._replies.expect(hand, [rid], self.shard_of(rid))
        timer = loop.call_later(timeout_s, hand, None)
        try:
            await self._send_one(rid, keys, fields, priority)
            got = await done
        finally:
            timer.cancel()
            self._replies.forget([rid])
        if got is None:
            raise errors.ReplyTimeout(await self._missing(rid, timeout_s))
        if isinstance(got, Exception):
            raise got
        return got[0].raise_for_error().outputs

    async def submit_many(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        chunk: int = defaults.CHUNK,
        priority: str = defaults.PRIORITY,
    ) -> list[str]:
        """Enqueue many requests, ``chunk`` XADDs a round trip; return their ids in order.

        Each reply waits in a key of its own until collected: ``map`` costs Redis less
        (docs/operations.md).
        """
        rids: list[str] = []
        encoder = BodyEncoder(params)
        items = iter(inputs)
        lane = validate_priority(priority)
        while batch := list(islice(items, chunk)):
            await self._make_room(len(batch))
            await self._check_limits()
            sent, round_ = self._submit_round(batch, encoder, deadline_s, lane)
            with translate_errors():
                await self._send_round(round_, keep_errors=False)
            rids += sent
        return rids

    async def results(
        self,
        request_ids: Sequence[str],
        timeout_s: float = defaults.TIMEOUT_S,
        *,
        raise_errors: bool = False,
    ) -> list[Reply]:
        """Collect the replies to ``request_ids`` in order (see Producer.results)."""
        scan = self._reply_scan(request_ids)
        deadline = time.monotonic() + timeout_s
        while scan.missing:
            round_ = Round()
            scan.queue(round_, min(defaults.WAIT_S, deadline - time.monotonic()))
            with translate_errors():
                scan.take(await arun(self.redis, round_), raise_errors)
            if scan.missing and time.monotonic() > deadline:
                raise self._replies_missing(scan, len(request_ids), timeout_s)
        return scan.replies()

    async def map(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = defaults.TIMEOUT_S,
        window: int = defaults.WINDOW,
        deadline_s: float | None = None,
        raise_errors: bool = False,
        priority: str = defaults.PRIORITY,
    ) -> list[Reply]:
        """Run every input through the fleet; replies in input order (see Producer.map)."""
        replies: list[Any] = []
        async for taken in self._mapped(
            inputs, params, timeout_s, window, deadline_s, raise_errors, None, priority
        ):
            place(replies, taken)
        return replies

    async def imap(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = defaults.TIMEOUT_S,
        window: int = defaults.WINDOW,
        deadline_s: float | None = None,
        raise_errors: bool = False,
        ordered: bool = False,
        on_send: Callable[[list[str]], None] | None = None,
        priority: str = defaults.PRIORITY,
    ) -> AsyncIterator[Reply]:
        """Like :meth:`map`, but an async iterator of replies as they come (see Producer.imap)."""
        order = InOrder() if ordered else None
        async for taken in self._mapped(
            inputs, params, timeout_s, window, deadline_s, raise_errors, on_send, priority
        ):
            for reply in (reply for _, reply in taken) if order is None else order.release(taken):
                yield reply

    async def _mapped(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None,
        timeout_s: float,
        window: int,
        deadline_s: float | None,
        raise_errors: bool,
        on_send: Callable[[list[str]], None] | None,
        priority: str,
    ) -> AsyncIterator[list[tuple[int, Reply]]]:
        """(input index, reply) of a map/imap call, a round's at a time as they come (see
        Producer._mapped): one async-generator step a round, not one a reply."""
        box: list[Any] = []  # what the reads put here: lists of replies, or an error
        calls = MapRun(
            self,
            inputs,
            params,
            window,
            deadline_s,
            validate_priority(priority),
            lambda rids, shard: self._replies.expect(box.append, rids, shard, served=False),
        )
        try:
            while calls.active:
                yield await self._map_round(calls, box, timeout_s, raise_errors, on_send)
        finally:
            self._replies.forget(calls.in_flight.ids(), served=False)

    async def _map_round(
        self,
        calls: MapRun,
        box: list[Any],
        timeout_s: float,
        raise_errors: bool,
        on_send: Callable[[list[str]], None] | None,
    ) -> list[tuple[int, Reply]]:
        """One round of map/imap: send what the window allows (with the first read where this
        call reads: one round trip), take what the reader brought."""
        round_ = Round()
        await self._check_limits()
        batch = calls.fill(round_)
        if batch and on_send is not None:
            on_send(batch)
        writes = round_.replies
        waits = self.durable_waits(round_) if batch else 0
        with translate_errors():
            sent = await self._replies.read_for(round_ if batch else None, defaults.POLL_S)
            await self._confirmed(sent, writes, waits, False)
        items, box[:] = box[:], []
        replies: list[Reply] = []
        for item in items:
            if isinstance(item, Exception):
                raise item
            replies += item
        taken = calls.take(replies, raise_errors)
        calls.check_stall(timeout_s)
        return taken

    async def lag(self) -> int | None:
        """Requests waiting to be picked up (summed over the shards and lanes).

        None when Redis cannot tell.
        """
        return (await self._lag_and_backlog())[0]

    async def backlog(self) -> int:
        """The lag, or the stream length (an upper bound) where the lag is unknown."""
        return (await self._lag_and_backlog())[1]

    async def _lag_and_backlog(self) -> tuple[int | None, int]:
        with translate_errors():
            pipe = self.redis.pipeline(transaction=False)
            streams = [
                stream for lanes in self.lanes for stream in lanes
            ]  # every lane of every shard
            for stream in streams:
                pipe.xlen(stream)
            lengths = [int(n) for n in await pipe.execute()]
            busy = [stream for stream, n in zip(streams, lengths) if n]
            pipe = self.redis.pipeline(transaction=False)
            for stream in busy:
                pipe.xinfo_groups(stream)
            found = iter(await pipe.execute() if busy else [])
        return sum_shards(lengths, [next(found) if n else [] for n in lengths])

    async def close(self) -> None:
        """Stop the reply reader and release the connection pool (if this producer created it).

        A call still waiting for a reply raises InferfleetError.
        """
        if not self._closed:
            await self._replies.aclose()
            if self._owns_client:
                await aclose_client(self.redis)
        self._closed = True

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
