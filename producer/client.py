"""Producer and AsyncProducer: enqueue inference requests and collect replies.

Both share :class:`ProducerBase`, which owns everything that is not I/O
(request ids, entry fields, shard routing, reply decoding); the two
subclasses only differ in how they talk to Redis. Every redis-py exception
is translated into the SDK's own (``inferfleet.producer.errors``) in :func:`_translate`.

A queue may be sharded into ``shards`` streams (``NAME.0`` ...), each in its
own Redis Cluster slot: a request goes to shard
:func:`~inferfleet.producer.protocol.shard_for` of its id, and so does its reply.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, count, islice
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from inferfleet.producer import errors
from inferfleet.producer.bulk import (
    InFlight,  # noqa: F401 - importable from here as before
    MapRun,
    ReplyScan,
    group_by_shard,
)
from inferfleet.producer.connections import (
    DEFAULT_REDIS_URL,
    block_slices,
    connect,
    connect_async,
    translate_errors,
)
from inferfleet.producer.connections import redis_url as resolve_url
from inferfleet.producer.protocol import (
    DEFAULT_PREFIX,
    GROUP,
    BodyEncoder,
    QueueKeys,
    Reply,
    decode_reply,
    encode_body,
    request_fields,
    shard_for,
    shard_keys,
    validate_request_id,
    validate_request_ids,
    workers_group,
)
from inferfleet.producer.sharing import (
    LIBRARY,
    cancel_keys,
    enqueue_keys,
    lane_keys,
    limits_key,
    validate_priority,
    validate_tenant,
)
from inferfleet.producer.tracing import current_traceparent, traceparent_fields
from inferfleet.producer.transport import Round, arun, run

__all__ = ["Producer", "AsyncProducer", "DEFAULT_REDIS_URL"]

_POLL_S = 0.05  # longest blocking wait between rounds of a map
_WAIT_S = 1.0  # longest wait of a results() round for the last reply it names (it returns when that comes)
_LIMITS_S = 1.0  # how often a producer looks whether fleet-wide limits are in force (one EXISTS)
_CANCEL_BOUND_MS = (
    3_600_000  # a cancel mark of a request without a deadline lives at most this long
)


def sum_shards(lengths: Sequence[int], groups: Sequence[list[dict]]) -> tuple[int | None, int]:
    """(lag, backlog) of a queue from each shard's stream length and XINFO GROUPS reply.

    Lags are summed, and the sum is unknown (None) if one shard's is; the
    backlog counts such a shard's length (an upper bound) instead. A shard
    whose group no worker has created yet is all backlog.
    """
    lag: int | None = 0
    backlog = 0
    for length, shard_groups in zip(lengths, groups):
        group = workers_group(shard_groups) if length else None
        one = 0 if not length else int(length) if group is None else group.lag
        backlog += length if one is None else one
        lag = None if lag is None or one is None else lag + one
    return lag, backlog


def missing_reply_message(
    request_id: str, timeout_s: float, keys: QueueKeys, groups: list | None
) -> str:
    """Why no reply came: ``groups`` is the XINFO GROUPS reply of the request's stream (None: no stream)."""
    head = f"no reply to {request_id!r} within {timeout_s} s"
    group = workers_group(groups) if groups is not None else None
    if group is None:
        return (
            f"{head}: no worker has ever served queue {keys.name!r} (no group {GROUP!r} on {keys.requests}): "
            f"start one with 'inferfleet worker --name {keys.name} --model MODEL'"
        )
    if group.lag == 0 and group.pending == 0:
        return (
            f"{head}, and queue {keys.name!r} has nothing waiting or in progress: its reply was already "
            f"collected (replies are read once, by the first result call), or outlived its TTL, or no "
            f"request had this id"
        )
    waiting = "an unknown number of" if group.lag is None else str(group.lag)
    return f"{head}: queue {keys.name!r} has {waiting} requests waiting and {group.pending} in progress"


class ProducerBase:
    """What both producers share: names, ids, entry fields, limits and reply decoding."""

    def __init__(
        self,
        name: str,
        prefix: str = DEFAULT_PREFIX,
        default_deadline_s: float | None = 60.0,
        max_backlog: int | None = None,
        on_full: str = "raise",
        full_wait_s: float = 30.0,
        shards: int = 1,
        tenant: str | None = None,
    ) -> None:
        if default_deadline_s is not None and default_deadline_s <= 0:
            raise ValueError(
                f"default_deadline_s must be positive or None, got {default_deadline_s}"
            )
        if max_backlog is not None and max_backlog < 1:
            raise ValueError(f"max_backlog must be at least 1 or None, got {max_backlog}")
        if on_full not in ("raise", "wait"):
            raise ValueError(f"on_full must be 'raise' or 'wait', got {on_full!r}")
        #: every shard's keys, shard 0 first; ``keys`` is shard 0 (the queue's own when unsharded)
        self.shard_keys = shard_keys(name, shards, prefix)
        self.keys = self.shard_keys[0]
        #: each shard's lane streams: high, normal, low
        self.lanes = tuple(lane_keys(keys) for keys in self.shard_keys)
        self.tenant = validate_tenant(tenant) if tenant is not None else None
        self._limits_seen = (
            -_LIMITS_S,
            False,
        )  # (monotonic time, limits in force): re-read every _LIMITS_S
        self._library_loaded = False
        self.shards = shards
        self.name = name
        self.default_deadline_s = default_deadline_s
        self.max_backlog = max_backlog
        self.on_full = on_full
        self.full_wait_s = full_wait_s
        self._backlog_seen = (0.0, 0)  # (monotonic time, backlog): re-read at most every 50 ms
        token = os.urandom(6).hex()
        self._rid_base = f"{token}-"
        self._rids = count()
        #: this producer's reply inbox in each shard (one BLPOP cannot span cluster slots)
        self.inboxes = tuple(keys.inbox(f"p-{token}") for keys in self.shard_keys)
        self.inbox = self.inboxes[0]
        self._turn = 0  # which shard's inbox a cluster client blocks on next
        self.cluster = False  # set by the subclass: one BLPOP may then name one shard's key only
        self._closed = False

    def new_request_id(self) -> str:
        """A request id unique to this producer (random base + counter)."""
        return f"{self._rid_base}{next(self._rids):x}"

    def shard_of(self, request_id: str) -> int:
        """The shard of ``request_id``: CRC-32 of its bytes mod ``shards`` (0 when unsharded)."""
        return shard_for(request_id, self.shards) if self.shards > 1 else 0

    def keys_for(self, request_id: str) -> QueueKeys:
        """The keys of the shard that request ``request_id`` (and its reply) lives in."""
        return self.shard_keys[self.shard_of(validate_request_id(request_id))]

    def _entry(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None,
        deadline_s: float | None,
        request_id: str | None = None,
        reply_to: str | None = None,
        *,
        to_inbox: bool = False,
    ) -> tuple[str, QueueKeys, dict]:
        """(request id, its shard's keys, entry fields); ``to_inbox``: reply to our inbox there."""
        self._check_open()
        rid = validate_request_id(request_id) if request_id is not None else self.new_request_id()
        shard = self.shard_of(rid)
        keys = self.shard_keys[shard]
        reply_to = self.inboxes[shard] if to_inbox else reply_to
        deadline_ms = None
        deadline_s = self.default_deadline_s if deadline_s is None else deadline_s
        if deadline_s is not None:
            if deadline_s <= 0:
                raise errors.ProtocolError(f"deadline_s must be positive, got {deadline_s}")
            deadline_ms = int((time.time() + deadline_s) * 1000)
        if reply_to is not None and not keys.is_inbox(reply_to):
            raise errors.ProtocolError(
                f"reply_to must be a key under {keys.inbox_prefix!r} (the shard of request {rid!r}), "
                f"got {reply_to!r}"
            )
        fields = request_fields(
            rid, encode_body(inputs, params), deadline_ms, reply_to, current_traceparent()
        )
        if self.tenant is not None:
            fields["tenant"] = self.tenant
        return rid, keys, fields

    # -- sharing a fleet: lanes, admission, cancellation (no I/O) --

    def _limits_due(self) -> bool:
        return time.monotonic() - self._limits_seen[0] > _LIMITS_S

    def _limits_read(self, in_force: bool) -> None:
        self._limits_seen = (time.monotonic(), in_force)

    def _admitting(self) -> bool:
        """True while the queue has fleet-wide limits: entries then go through ``inferfleet_enqueue``."""
        return self._limits_seen[1]

    def _fcall_args(
        self,
        keys: QueueKeys,
        lane: str,
        rids: Sequence[str],
        bodies: Sequence[bytes],
        fields: Iterable[tuple[str, Any]],
    ) -> list[Any]:
        """``FCALL inferfleet_enqueue`` arguments that send ``rids`` with ``bodies`` (one shard's) at once;
        ``fields`` are the other fields every entry carries."""
        common = [
            part
            for name, value in fields
            if name not in ("id", "body", "tenant")
            for part in (name, value)
        ]
        tenant = self.tenant or ""
        args: list[Any] = [
            "FCALL",
            "inferfleet_enqueue",
            7,
            *enqueue_keys(keys, lane, tenant),
            tenant,
            len(common) // 2,
            *common,
        ]
        args += chain.from_iterable(zip(rids, bodies))
        return args

    @staticmethod
    def _cancel_found(args: list[Any], statuses: list[bytes]) -> dict[str, str]:
        return dict(zip(args[-len(statuses) :], (status.decode() for status in statuses)))

    @staticmethod
    def _one_cancelled(request_id: str, status: str) -> str:
        if status == "unknown":
            raise errors.ProtocolError(
                f"request {request_id!r} is in no lane of this queue (never sent, "
                f"or answered and trimmed): nothing to cancel"
            )
        return status

    def _cancel_args(self, request_ids: Sequence[str]) -> list[list[Any]]:
        """One ``FCALL inferfleet_cancel`` argument list per shard of ``request_ids``."""
        rids = validate_request_ids(request_ids)
        calls = []
        for shard, positions in group_by_shard(rids, self.shards):
            mine = [rids[p] for p in positions]
            keys = cancel_keys(self.shard_keys[shard], mine)
            calls.append(["inferfleet_cancel", len(keys), *keys, _CANCEL_BOUND_MS, *mine])
        return calls

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InferfleetError("this producer is closed")

    def _over_limit(self, backlog: int, adding: int) -> bool:
        return self.max_backlog is not None and backlog + adding > self.max_backlog

    def _queue_full(self, backlog: int) -> errors.QueueFull:
        return errors.QueueFull(
            f"queue {self.name!r} has a backlog of {backlog}, over max_backlog "
            f"{self.max_backlog}: back off and retry",
            backlog,
        )

    @staticmethod
    def _finish(raw: bytes, raise_errors: bool) -> Reply:
        reply = decode_reply(raw)
        return reply.raise_for_error() if raise_errors else reply

    # -- bulk calls: what a round sends (no I/O: commands are queued on a Round) --

    def new_request_ids(self, count: int) -> list[str]:
        """``count`` request ids, as :meth:`new_request_id` makes them."""
        base, rids = self._rid_base, self._rids
        return [f"{base}{next(rids):x}" for _ in range(count)]

    def deadline_fields(self, deadline_s: float | None) -> list[tuple[str, str]]:
        """The ``deadline`` entry field of requests sent now (none without a deadline), and the
        ``traceparent`` of the caller's current OpenTelemetry span (asked once per round)."""
        deadline_s = self.default_deadline_s if deadline_s is None else deadline_s
        if deadline_s is None:
            return traceparent_fields()
        if deadline_s <= 0:
            raise errors.ProtocolError(f"deadline_s must be positive, got {deadline_s}")
        return [("deadline", str(int((time.time() + deadline_s) * 1000))), *traceparent_fields()]

    def queue_xadds(
        self,
        round_: Round,
        rids: list[str],
        bodies: list[bytes],
        fields: list[tuple[str, str]],
        to_inbox: bool,
        lane: int = 1,
    ) -> list[tuple[int, list[int]]]:
        """Queue the XADDs of ``rids`` on ``round_``, a shard at a time; return (shard, positions in rids).

        ``to_inbox``: each entry names this producer's inbox in its shard as ``reply_to``. ``lane``:
        0 high, 1 normal, 2 low. With fleet-wide limits in force, each shard's entries are one
        ``FCALL inferfleet_enqueue`` instead: admitted all together, or refused with none written.
        """
        groups = group_by_shard(rids, self.shards)
        if self.tenant is not None:
            fields = [*fields, ("tenant", self.tenant)]
        for shard, positions in groups:
            extra = [*fields, ("reply_to", self.inboxes[shard])] if to_inbox else fields
            mine = (
                (rids, bodies)
                if len(groups) == 1
                else ([rids[p] for p in positions], [bodies[p] for p in positions])
            )
            stream = self.lanes[shard][lane]
            if self._admitting():
                round_.command(self._fcall_args(self.shard_keys[shard], stream, *mine, extra))
            else:
                round_.xadd(stream, *mine, extra)
        return groups

    def _submit_round(
        self, batch: list[Any], encoder: BodyEncoder, deadline_s: float | None, lane: int = 1
    ) -> tuple[list[str], Round]:
        """(ids, Round of XADDs) for one chunk of submit_many, every input encoded first."""
        self._check_open()
        fields = self.deadline_fields(deadline_s)
        bodies = [encoder.encode(one) for one in batch]
        rids = self.new_request_ids(len(batch))
        round_ = Round()
        self.queue_xadds(round_, rids, bodies, fields, False, lane)
        return rids, round_

    def _reply_scan(self, request_ids: Sequence[str]) -> ReplyScan:
        rids = validate_request_ids(request_ids)
        if self.shards == 1:
            base = self.keys.reply("")
            return ReplyScan([base + rid for rid in rids])
        return ReplyScan([self.shard_keys[shard_for(rid, self.shards)].reply(rid) for rid in rids])

    def _block_keys(self, waiting: list[int]) -> list[str]:
        """Inboxes a map round's BLPOP waits on: every waiting one, or on a cluster
        (where one BLPOP cannot span slots) one shard's in turn; the round's LPOPs
        still pop every waiting inbox once the BLPOP returns."""
        if not self.cluster or len(waiting) == 1:
            return [self.inboxes[shard] for shard in waiting]
        self._turn += 1
        return [self.inboxes[waiting[self._turn % len(waiting)]]]

    @staticmethod
    def _replies_missing(scan: ReplyScan, asked: int, timeout_s: float) -> errors.ReplyTimeout:
        return errors.ReplyTimeout(f"{scan.missing} of {asked} replies missing after {timeout_s} s")


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
    """A wait's timeout message, saying why if the queue's state tells (one more round trip, on timeouts only)."""
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
        name: str = "default",
        *,
        prefix: str = DEFAULT_PREFIX,
        client: redis.Redis | RedisCluster | None = None,
        default_deadline_s: float | None = 60.0,
        max_backlog: int | None = None,
        on_full: str = "raise",
        full_wait_s: float = 30.0,
        shards: int = 1,
        cluster: bool = False,
        tenant: str | None = None,
    ) -> None:
        super().__init__(
            name, prefix, default_deadline_s, max_backlog, on_full, full_wait_s, shards, tenant
        )
        self._owns_client = client is None
        self.cluster = cluster or isinstance(client, RedisCluster)
        with translate_errors():
            self.redis = client or connect(resolve_url(redis_url), self.cluster)

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

    def _check_limits(self) -> bool:
        """Whether fleet-wide limits are in force (one EXISTS a second at most; loads the functions once)."""
        if self._limits_due():
            with translate_errors():
                in_force = bool(self.redis.exists(limits_key(self.keys)))
                if in_force and not self._library_loaded:
                    self._library_loaded = True
                    try:  # every worker loads it too: a producer user without FUNCTION LOAD does without
                        self.redis.function_load(LIBRARY, replace=True)
                    except redis.exceptions.ResponseError:
                        pass
            self._limits_read(in_force)
        return self._admitting()

    # -- one request -------------------------------------------------------

    def submit(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        request_id: str | None = None,
        reply_to: str | None = None,
        priority: str = "normal",
    ) -> str:
        """Enqueue one request on the lane of ``priority`` and return its request id."""
        rid, keys, fields = self._entry(inputs, params, deadline_s, request_id, reply_to)
        lane = self.lanes[self.shard_of(rid)][validate_priority(priority)]
        self._make_room(1)
        with translate_errors():
            if self._check_limits():
                self.redis.execute_command(
                    *self._fcall_args(keys, lane, [rid], [fields["body"]], fields.items())
                )
            else:
                self.redis.xadd(lane, fields)
        return rid

    def cancel(self, request_id: str) -> str:
        """Cancel a request no worker has computed yet: it is answered ``cancelled``, never computed.

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
        self, request_id: str, timeout_s: float = 30.0, *, raise_errors: bool = True
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
        timeout_s: float = 30.0,
        *,
        priority: str = "normal",
    ) -> Any:
        """Submit (with the timeout as deadline), wait and return the outputs (raises on an error reply)."""
        return self.result(
            self.submit(inputs, params, deadline_s=timeout_s, priority=priority), timeout_s
        ).outputs

    # -- many requests -----------------------------------------------------

    def submit_many(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        chunk: int = 1000,
        priority: str = "normal",
    ) -> list[str]:
        """Enqueue many requests, ``chunk`` XADDs a round trip; return their ids in order.

        Each reply waits in a key of its own until collected: ``map`` costs Redis less (docs/operations.md)."""
        rids: list[str] = []
        encoder = BodyEncoder(params)
        items = iter(inputs)
        lane = validate_priority(priority)
        while batch := list(islice(items, chunk)):
            self._make_room(len(batch))
            self._check_limits()
            sent, round_ = self._submit_round(batch, encoder, deadline_s, lane)
            with translate_errors():
                run(self.redis, round_)
            rids += sent
        return rids

    def results(
        self, request_ids: Sequence[str], timeout_s: float = 30.0, *, raise_errors: bool = False
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
            scan.queue(round_, min(_WAIT_S, deadline - time.monotonic()))
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
        timeout_s: float = 30.0,
        window: int = 2000,
        deadline_s: float | None = None,
        raise_errors: bool = False,
        priority: str = "normal",
    ) -> list[Reply]:
        """Run every input through the fleet and return the replies in input order.

        Keeps at most ``window`` requests in flight, sends them pipelined and
        collects replies in bulk from this producer's own inbox, so thousands
        of requests cost a handful of round trips. ``timeout_s`` is the longest
        wait for any next reply; on a stall ReplyTimeout is raised.
        """
        calls = MapRun(self, inputs, params, window, deadline_s, validate_priority(priority))
        replies: list[Any] = []
        while calls.active:
            taken = self._map_round(calls, timeout_s, raise_errors, None)
            replies += [None] * (calls.sent - len(replies))
            for index, reply in taken:
                replies[index] = reply
        return replies

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
        priority: str = "normal",
    ) -> Iterator[Reply]:
        """Like :meth:`map`, but yields replies as they come (or in order).

        ``on_send``, if given, is called with the ids of each pipeline of
        requests just before it is sent (benchmarks time requests with it).
        """
        calls = MapRun(self, inputs, params, window, deadline_s, validate_priority(priority))
        ready: dict[int, Reply] = {}
        next_out = 0
        while calls.active:
            for index, reply in self._map_round(calls, timeout_s, raise_errors, on_send):
                if ordered:
                    ready[index] = reply
                else:
                    yield reply
            while ordered and next_out in ready:
                yield ready.pop(next_out)
                next_out += 1

    def _map_round(
        self,
        calls: MapRun,
        timeout_s: float,
        raise_errors: bool,
        on_send: Callable[[list[str]], None] | None,
    ) -> list[tuple[int, Reply]]:
        """One round trip of a map/imap call: send what the window allows, wait for and pop replies."""
        round_ = Round()
        self._check_limits()
        batch = calls.fill(round_)
        calls.queue_pops(round_, self._block_keys, _POLL_S)
        if on_send is not None and batch:
            on_send(batch)
        with translate_errors():
            popped = calls.popped(run(self.redis, round_))
        taken = calls.take(popped, raise_errors)
        calls.check_stall(timeout_s)
        return taken

    # -- queue state and lifecycle -----------------------------------------

    def lag(self) -> int | None:
        """Requests waiting to be picked up (summed over the shards and lanes), or None when Redis cannot tell."""
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
        """Release the connection pool (if this producer created it)."""
        if not self._closed and self._owns_client:
            self.redis.close()
        self._closed = True

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncProducer(ProducerBase):
    """The asyncio twin of :class:`Producer` (``await p.submit(...)``)."""

    def __init__(
        self,
        redis_url: str | None = None,
        name: str = "default",
        *,
        prefix: str = DEFAULT_PREFIX,
        client: aioredis.Redis | AsyncRedisCluster | None = None,
        default_deadline_s: float | None = 60.0,
        max_backlog: int | None = None,
        on_full: str = "raise",
        full_wait_s: float = 30.0,
        shards: int = 1,
        cluster: bool = False,
        tenant: str | None = None,
    ) -> None:
        super().__init__(
            name, prefix, default_deadline_s, max_backlog, on_full, full_wait_s, shards, tenant
        )
        self._owns_client = client is None
        self.cluster = cluster or isinstance(client, AsyncRedisCluster)
        with translate_errors():
            self.redis = client or connect_async(resolve_url(redis_url), self.cluster)

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

    async def _check_limits(self) -> bool:
        """Whether fleet-wide limits are in force (one EXISTS a second at most; loads the functions once)."""
        if self._limits_due():
            with translate_errors():
                in_force = bool(await self.redis.exists(limits_key(self.keys)))
                if in_force and not self._library_loaded:
                    self._library_loaded = True
                    try:  # every worker loads it too: a producer user without FUNCTION LOAD does without
                        await self.redis.function_load(LIBRARY, replace=True)
                    except redis.exceptions.ResponseError:
                        pass
            self._limits_read(in_force)
        return self._admitting()

    async def submit(
        self,
        inputs: Any,
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        request_id: str | None = None,
        reply_to: str | None = None,
        priority: str = "normal",
    ) -> str:
        """Enqueue one request on the lane of ``priority`` and return its request id."""
        rid, keys, fields = self._entry(inputs, params, deadline_s, request_id, reply_to)
        lane = self.lanes[self.shard_of(rid)][validate_priority(priority)]
        await self._make_room(1)
        with translate_errors():
            if await self._check_limits():
                await self.redis.execute_command(
                    *self._fcall_args(keys, lane, [rid], [fields["body"]], fields.items())
                )
            else:
                await self.redis.xadd(lane, fields)
        return rid

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
        self, request_id: str, timeout_s: float = 30.0, *, raise_errors: bool = True
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
        timeout_s: float = 30.0,
        *,
        priority: str = "normal",
    ) -> Any:
        """Submit (with the timeout as deadline), wait and return the outputs (raises on an error reply)."""
        rid = await self.submit(inputs, params, deadline_s=timeout_s, priority=priority)
        return (await self.result(rid, timeout_s)).outputs

    async def submit_many(
        self,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
        *,
        chunk: int = 1000,
        priority: str = "normal",
    ) -> list[str]:
        """Enqueue many requests, ``chunk`` XADDs a round trip; return their ids in order.

        Each reply waits in a key of its own until collected: ``map`` costs Redis less (docs/operations.md)."""
        rids: list[str] = []
        encoder = BodyEncoder(params)
        items = iter(inputs)
        lane = validate_priority(priority)
        while batch := list(islice(items, chunk)):
            await self._make_room(len(batch))
            await self._check_limits()
            sent, round_ = self._submit_round(batch, encoder, deadline_s, lane)
            with translate_errors():
                await arun(self.redis, round_)
            rids += sent
        return rids

    async def results(
        self, request_ids: Sequence[str], timeout_s: float = 30.0, *, raise_errors: bool = False
    ) -> list[Reply]:
        """Collect the replies to ``request_ids`` in order (see Producer.results)."""
        scan = self._reply_scan(request_ids)
        deadline = time.monotonic() + timeout_s
        while scan.missing:
            round_ = Round()
            scan.queue(round_, min(_WAIT_S, deadline - time.monotonic()))
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
        timeout_s: float = 30.0,
        window: int = 2000,
        deadline_s: float | None = None,
        raise_errors: bool = False,
        priority: str = "normal",
    ) -> list[Reply]:
        """Run every input through the fleet; replies in input order (see Producer.map)."""
        calls = MapRun(self, inputs, params, window, deadline_s, validate_priority(priority))
        replies: list[Any] = []
        while calls.active:
            taken = await self._map_round(calls, timeout_s, raise_errors, None)
            replies += [None] * (calls.sent - len(replies))
            for index, reply in taken:
                replies[index] = reply
        return replies

    async def imap(
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
        priority: str = "normal",
    ) -> AsyncIterator[Reply]:
        """Like :meth:`map`, but an async iterator of replies as they come (see Producer.imap)."""
        calls = MapRun(self, inputs, params, window, deadline_s, validate_priority(priority))
        ready: dict[int, Reply] = {}
        next_out = 0
        while calls.active:
            for index, reply in await self._map_round(calls, timeout_s, raise_errors, on_send):
                if ordered:
                    ready[index] = reply
                else:
                    yield reply
            while ordered and next_out in ready:
                yield ready.pop(next_out)
                next_out += 1

    async def _map_round(
        self,
        calls: MapRun,
        timeout_s: float,
        raise_errors: bool,
        on_send: Callable[[list[str]], None] | None,
    ) -> list[tuple[int, Reply]]:
        """One round trip of map/imap: send what the window allows, wait for and pop replies."""
        round_ = Round()
        await self._check_limits()
        batch = calls.fill(round_)
        calls.queue_pops(round_, self._block_keys, _POLL_S)
        if on_send is not None and batch:
            on_send(batch)
        with translate_errors():
            popped = calls.popped(await arun(self.redis, round_))
        taken = calls.take(popped, raise_errors)
        calls.check_stall(timeout_s)
        return taken

    async def lag(self) -> int | None:
        """Requests waiting to be picked up (summed over the shards and lanes), or None when Redis cannot tell."""
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
        """Release the connection pool (if this producer created it)."""
        if not self._closed and self._owns_client:
            await self.redis.aclose()
        self._closed = True

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
