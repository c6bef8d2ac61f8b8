"""Producer: the blocking SDK client (see :mod:`~inferfleet.producer.base`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from queue import Empty, SimpleQueue
from typing import Any

import redis
from redis.cluster import RedisCluster

from inferfleet.producer import defaults, errors
from inferfleet.producer.base import ProducerBase, missing_reply_message, sum_shards
from inferfleet.producer.bulk import InOrder, MapRun, place
from inferfleet.producer.connections import (
    block_slices,
    close_client,
    connect,
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
from inferfleet.producer.reader import ReplyReader
from inferfleet.producer.sharing import (
    LIBRARY,
    limits_key,
    validate_priority,
)
from inferfleet.producer.streaming import ChunkStream
from inferfleet.producer.transport import Round, raise_first_error, run
from inferfleet.producer.writes import WriteBatcher

__all__ = ["Producer"]


_LIMITS_DOC = """
    ``default_deadline_s`` (60 s) is the deadline of every request sent
    without one: a worker answers ``expired`` instead of computing a request
    nobody waits for any more (``None``: no deadline). With ``max_backlog``
    set, sending while the queue's backlog (lag) is over it raises
    :class:`~inferfleet.producer.errors.QueueFull` (``on_full="raise"``) or waits up to
    ``full_wait_s`` for room (``on_full="wait"``): the bounded request buffer.

    redis-py's silent command retries are off: a retried XADD could enqueue a
    request twice and a retried pop could lose a reply. A dropped connection
    raises :class:`~inferfleet.producer.errors.ConnectionError`; the next call reconnects.

    ``shards`` (default 1) splits the queue into that many streams, queues
    ``NAME.0`` to ``NAME.{shards-1}``, each in its own Redis Cluster slot: a
    request goes to shard ``shard_for(id, shards)`` (CRC-32 of the id, mod
    ``shards``) and so does its reply. Every producer and worker of a queue
    must agree on ``shards``. ``cluster=True`` connects with redis-py's
    ``RedisCluster`` (the URL names any one node); it still follows MOVED and
    ASK redirects, which never re-run a command.
"""


def _missing(client: Any, keys: QueueKeys, request_id: str, timeout_s: float) -> str:
    """A wait's timeout message, saying why if the queue's state tells.

    One more round trip, on timeouts only.
    """
    try:
        groups = client.xinfo_groups(keys.requests) if client.exists(keys.requests) else None
    except redis.exceptions.RedisError:
        return f"no reply to {request_id!r} within {timeout_s} s"
    return missing_reply_message(request_id, timeout_s, keys, groups)


class Producer(ProducerBase):
    """Enqueue requests on queue ``name`` and collect their replies.

    >>> p = Producer("redis://localhost:6379/0", "ctr")      # doctest: +SKIP
    >>> rid = p.submit(np.zeros((1, 16), np.float32))        # doctest: +SKIP
    >>> p.result(rid, timeout_s=5).outputs                   # doctest: +SKIP

    ``redis_url`` defaults to ``$REDIS_URL``; pass ``client`` to reuse an
    existing ``redis.Redis`` or ``RedisCluster`` (its ``decode_responses``
    must be False).

    ``tenant`` names the caller in every entry (fleet-wide quotas apply to
    it); ``priority`` on the sending calls picks the lane (``high``,
    ``normal``, ``low``). While the queue has fleet-wide limits
    (``inferfleet limit``), entries go through the admission function:
    over the backlog limit a call raises QueueFull, over the tenant's quota
    RateLimited, with nothing written.
    """

    __doc__ = (__doc__ or "") + _LIMITS_DOC

    def __init__(
        self,
        redis_url: str | None = None,
        name: str = defaults.NAME,
        *,
        prefix: str = DEFAULT_PREFIX,
        client: redis.Redis | RedisCluster | None = None,
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
        self.cluster = cluster or isinstance(client, RedisCluster)
        with translate_errors():
            self.redis = client or connect(resolve_url(redis_url), self.cluster)
        self._reset_io()

    def _reset_io(self) -> None:
        """A new reply reader, write batcher and locks (at start, and in a forked child)."""
        self._limits_lock = threading.Lock()
        self._replies = ReplyReader(self.redis, self.inboxes, self.cluster)
        self._writes = WriteBatcher(self._send_round)

    def _send_round(self, round_: Round, keep_errors: bool = True) -> list[Any]:
        """Send a round of writes (followed by the ``WAIT`` durability asks for); one reply a
        write, an error reply (or NotReplicated) in its place."""
        writes = round_.replies
        waits = self.durable_waits(round_)
        replies = run(self.redis, round_, keep_errors=True)
        return self._confirmed(replies, writes, waits, keep_errors)

    def _confirmed(self, replies: list, writes: int, waits: int, keep_errors: bool) -> list:
        """``replies`` with durability's verdict applied (:func:`confirmed`); after a shortfall
        the idle connections are closed, so the next call finds the primary again."""
        out, stale = self.durable_verdict(replies, writes, waits)
        if stale is not None:
            stale.disconnect(inuse_connections=False)
        return out if keep_errors else raise_first_error(out)

    def _make_room(self, adding: int) -> None:
        """Enforce max_backlog before sending ``adding`` requests (raise or wait)."""
        if self.max_backlog is None:
            return
        give_up = time.monotonic() + self.full_wait_s
        while True:
            backlog = self._backlog_cached()
            if backlog is None:
                backlog = self._backlog_read(self.backlog())
            if self._room_taken(backlog, adding):
                return
            self._give_up(backlog, give_up)
            time.sleep(defaults.FULL_POLL_S)

    def _check_limits(self) -> bool:
        """Whether fleet-wide limits are in force.

        One EXISTS a second at most, however many threads send at once (one reads,
        the others wait for it); loads the functions once.
        """
        if self._limits_due():
            with self._limits_lock:
                if self._limits_due():
                    self._read_limits()
        return self._admitting()

    def _read_limits(self) -> None:
        with translate_errors():
            in_force = bool(self.redis.exists(limits_key(self.keys)))
            if in_force and not self._library_loaded:
                self._library_loaded = True
                # every worker loads it too: a producer user without FUNCTION LOAD does without
                try:
                    self.redis.function_load(LIBRARY, replace=True)
                except redis.exceptions.ResponseError:
                    pass
        self._limits_read(in_force)

    # -- one request -------------------------------------------------------

    def submit(
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
        self._send_one(rid, keys, fields, priority)
        return rid

    def stream(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        request_id: str | None = None,
        priority: str = defaults.PRIORITY,
        timeout_s: float = defaults.TIMEOUT_S,
    ) -> ChunkStream:
        """Enqueue one request that asks for a streamed reply; iterate the returned
        :class:`~inferfleet.producer.streaming.ChunkStream` for its chunks as they are made
        (``timeout_s``: the longest wait for the next one). Its ``request_id`` cancels it."""
        rid, keys, fields = self._entry(inputs, params, deadline_s, request_id, stream=True)
        self._send_one(rid, keys, fields, priority)
        return self.read_stream(rid, timeout_s=timeout_s)

    def read_stream(
        self, request_id: str, *, after: str = "0", timeout_s: float = defaults.TIMEOUT_S
    ) -> ChunkStream:
        """The chunks of request ``request_id``'s stream after entry id ``after`` (``0``: from
        the start; the ``entry_id`` of the last chunk seen: resume there), from any process."""
        key = self.keys_for(request_id).chunks(validate_request_id(request_id))
        return ChunkStream(self.redis, request_id, key, timeout_s, after)

    def _send_one(self, rid: str, keys: QueueKeys, fields: dict, priority: str) -> None:
        """One request's XADD (or FCALL), sent with the other threads' concurrent ones."""
        lane = self.lanes[self.shard_of(rid)][validate_priority(priority)]
        self._make_room(1)
        self._check_limits()
        with translate_errors():
            self._writes.write(self._write_args(keys, lane, rid, fields))

    def cancel(self, request_id: str) -> str:
        """Cancel a request no worker has computed yet: answered ``cancelled``, never computed.

        Returns ``cancelled`` (marked: the reply says whether a worker got to it first) or
        ``answered`` (its reply waits: it stands). An id in no lane of the queue raises
        ProtocolError, with nothing written.
        """
        return self._one_cancelled(request_id, self.cancel_many([request_id])[0])

    def cancel_many(self, request_ids: Sequence[str]) -> list[str]:
        """Cancel many requests, one round trip a shard; ``cancelled``, ``answered`` or ``unknown``
        (in no lane: nothing written) for each, in order."""
        found: dict[str, str] = {}
        with translate_errors():
            if not self._library_loaded:
                self._library_loaded = True
                try:  # every worker loads it too
                    self.redis.function_load(LIBRARY, replace=True)
                except redis.exceptions.ResponseError:
                    pass
            for args in self._cancel_args(request_ids):
                found.update(self._cancel_found(args, self.redis.execute_command("FCALL", *args)))
        return [found[rid] for rid in request_ids]

    def result(
        self, request_id: str, timeout_s: float = defaults.TIMEOUT_S, *, raise_errors: bool = True
    ) -> Reply:
        """Wait up to ``timeout_s`` for the reply to ``request_id``.

        Any process can collect a reply; it is removed once collected. With
        ``raise_errors`` (the default) an ``ok: false`` reply raises the
        matching :class:`~inferfleet.producer.errors.ReplyError`.
        """
        key = self.keys_for(request_id).reply(validate_request_id(request_id))
        popped = None
        with translate_errors():
            for block_s in block_slices(
                timeout_s
            ):  # each BLPOP well within the socket's read timeout
                popped = self.redis.blpop([key], timeout=block_s)
                if popped is not None:
                    break
        if popped is None:
            raise errors.ReplyTimeout(
                _missing(self.redis, self.keys_for(request_id), request_id, timeout_s)
            )
        return self._finish(popped[1], raise_errors)

    def infer(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
        timeout_s: float = defaults.TIMEOUT_S,
        *,
        priority: str = defaults.PRIORITY,
    ) -> Any:
        """Submit (with the timeout as deadline), wait and return the outputs.

        Raises on an error reply. The reply comes to this producer's inbox,
        where its one reader thread hands it to this call: any number of
        threads may call ``infer`` on one producer at once.
        """
        rid, keys, fields = self._entry(inputs, params, timeout_s, to_inbox=True)
        box: SimpleQueue = SimpleQueue()
        self._replies.expect(box.put, [rid], self.shard_of(rid))
        try:
            self._send_one(rid, keys, fields, priority)
            got = box.get(timeout=timeout_s)
        except Empty:
            raise errors.ReplyTimeout(_missing(self.redis, keys, rid, timeout_s)) from None
        finally:
            self._replies.forget([rid])
        if isinstance(got, Exception):
            raise got
        return got[0].raise_for_error().outputs

    # -- many requests -----------------------------------------------------

    def submit_many(
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
            self._make_room(len(batch))
            self._check_limits()
            sent, round_ = self._submit_round(batch, encoder, deadline_s, lane)
            with translate_errors():
                self._send_round(round_, keep_errors=False)
            rids += sent
        return rids

    def results(
        self,
        request_ids: Sequence[str],
        timeout_s: float = defaults.TIMEOUT_S,
        *,
        raise_errors: bool = False,
    ) -> list[Reply]:
        """Collect the replies to ``request_ids`` (in order), polling their reply keys in bulk.

        Each round trip blocks until the last of the next missing reply keys
        (up to a few thousand) is answered, then pops them all, so a busy
        worker is followed with a round trip every few thousand replies and
        no spinning. Raises ReplyTimeout if some are still missing after
        ``timeout_s``.
        """
        scan = self._reply_scan(request_ids)
        deadline = time.monotonic() + timeout_s
        while scan.missing:
            round_ = Round()
            scan.queue(round_, min(defaults.WAIT_S, deadline - time.monotonic()))
            with translate_errors():
                scan.take(run(self.redis, round_), raise_errors)
            if scan.missing and time.monotonic() > deadline:
                raise self._replies_missing(scan, len(request_ids), timeout_s)
        return scan.replies()

    def map(
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
        """Run every input through the fleet and return the replies in input order.

        Keeps at most ``window`` requests in flight, sends them pipelined and
        collects replies in bulk from this producer's own inbox, so thousands
        of requests cost a handful of round trips. ``timeout_s`` is the longest
        wait for any next reply; on a stall ReplyTimeout is raised.
        """
        replies: list[Any] = []
        for taken in self._mapped(
            inputs, params, timeout_s, window, deadline_s, raise_errors, None, priority
        ):
            place(replies, taken)
        return replies

    def imap(
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
    ) -> Iterator[Reply]:
        """Like :meth:`map`, but yields replies as they come (or in order).

        ``on_send``, if given, is called with the ids of each pipeline of
        requests just before it is sent (benchmarks time requests with it).
        """
        order = InOrder() if ordered else None
        for taken in self._mapped(
            inputs, params, timeout_s, window, deadline_s, raise_errors, on_send, priority
        ):
            yield from (reply for _, reply in taken) if order is None else order.release(taken)

    def _mapped(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None,
        timeout_s: float,
        window: int,
        deadline_s: float | None,
        raise_errors: bool,
        on_send: Callable[[list[str]], None] | None,
        priority: str,
    ) -> Iterator[list[tuple[int, Reply]]]:
        """(input index, reply) of a map/imap call, a round's at a time as replies come; its ids
        are forgotten at the end, however it ends (a reply that still comes is dropped)."""
        box: SimpleQueue = SimpleQueue()
        calls = MapRun(
            self,
            inputs,
            params,
            window,
            deadline_s,
            validate_priority(priority),
            lambda rids, shard: self._replies.expect(box.put, rids, shard, served=False),
        )
        try:
            while calls.active:
                yield self._map_round(calls, box, timeout_s, raise_errors, on_send)
        finally:
            self._replies.forget(calls.in_flight.ids(), served=False)

    def _map_round(
        self,
        calls: MapRun,
        box: SimpleQueue,
        timeout_s: float,
        raise_errors: bool,
        on_send: Callable[[list[str]], None] | None,
    ) -> list[tuple[int, Reply]]:
        """One round of a map/imap call: send what the window allows, take what the reader
        brought (waiting up to POLL_S for the first)."""
        round_ = Round()
        self._check_limits()
        batch = calls.fill(round_)
        if batch and on_send is not None:
            on_send(batch)
        # the sends go out with the first read where this call reads: one round trip
        sending = round_ if batch else None
        taken = calls.take(self._collected(box, defaults.POLL_S, sending), raise_errors)
        calls.check_stall(timeout_s)
        return taken

    def _collected(self, box: SimpleQueue, wait_s: float, sending: Round | None) -> list[Reply]:
        """Send ``sending`` and read the inbox (waiting up to ``wait_s``) in one round trip, then
        the replies put in ``box``; an error put there, or replied to ``sending``, is raised."""
        writes = sending.replies if sending is not None else 0
        waits = self.durable_waits(sending) if sending is not None else 0
        with translate_errors():
            self._confirmed(self._replies.read_for(sending, wait_s), writes, waits, False)
        replies: list[Reply] = []
        while not box.empty():
            item = box.get_nowait()
            if isinstance(item, Exception):
                raise item
            replies += item
        return replies

    # -- queue state and lifecycle -----------------------------------------

    def lag(self) -> int | None:
        """Requests waiting to be picked up (summed over the shards and lanes).

        None when Redis cannot tell.
        """
        return self._lag_and_backlog()[0]

    def backlog(self) -> int:
        """The lag, or the stream length (an upper bound) where the lag is unknown."""
        return self._lag_and_backlog()[1]

    def _lag_and_backlog(self) -> tuple[int | None, int]:
        with translate_errors():
            pipe = self.redis.pipeline(transaction=False)
            streams = [
                stream for lanes in self.lanes for stream in lanes
            ]  # every lane of every shard
            for stream in streams:
                pipe.xlen(stream)
            lengths = [int(n) for n in pipe.execute()]
            busy = [stream for stream, n in zip(streams, lengths) if n]
            pipe = self.redis.pipeline(transaction=False)
            for stream in busy:
                pipe.xinfo_groups(stream)
            found = iter(pipe.execute() if busy else [])
        return sum_shards(lengths, [next(found) if n else [] for n in lengths])

    def close(self) -> None:
        """Stop the reply reader and release the connection pool (if this producer created it).

        A call still waiting for a reply raises InferfleetError.
        """
        if not self._closed:
            self._replies.close()
            if self._owns_client:
                close_client(self.redis)
        self._closed = True

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
