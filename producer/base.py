"""What Producer and AsyncProducer share: everything that is not I/O.

:class:`ProducerBase` owns request ids, entry fields, shard routing, the
limits and backlog bookkeeping (when each is read again), reply scans and the
errors a call raises; :mod:`~inferfleet.producer.sync` and
:mod:`~inferfleet.producer.aio` only differ in how they talk to Redis.

A queue may be sharded into ``shards`` streams (``NAME.0`` ...), each in its
own Redis Cluster slot: a request goes to shard
:func:`~inferfleet.producer.protocol.shard_for` of its id, and so does its reply.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain, count
from typing import Any

from inferfleet.producer import defaults, errors
from inferfleet.producer.bulk import (
    ReplyScan,
    group_by_shard,
)
from inferfleet.producer.durability import Durability, confirmed, queue_waits
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
    CANCEL_TTL_S,
    cancel_keys,
    enqueue_keys,
    lane_keys,
    validate_tenant,
)
from inferfleet.producer.tracing import current_traceparent, traceparent_fields
from inferfleet.producer.transport import Round

#: Every producer of this process, so that a forked child can give each a new identity.
_LIVE: weakref.WeakSet[ProducerBase] = weakref.WeakSet()


def _after_fork() -> None:
    for producer in list(_LIVE):
        producer._forked()


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_after_fork)


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
    """Why no reply came: ``groups`` is the XINFO GROUPS reply of the request's stream.

    None: the stream does not exist.
    """
    head = f"no reply to {request_id!r} within {timeout_s} s"
    group = workers_group(groups) if groups is not None else None
    if group is None:
        return (
            f"{head}: no worker has ever served queue {keys.name!r} "
            f"(no group {GROUP!r} on {keys.requests}): "
            f"start one with 'inferfleet worker --name {keys.name} --model MODEL'"
        )
    if group.lag == 0 and group.pending == 0:
        return (
            f"{head}, and queue {keys.name!r} has nothing waiting or in progress: "
            f"its reply was already collected (replies are read once, by the first "
            f"result call), or outlived its TTL, or no "
            f"request had this id"
        )
    waiting = "an unknown number of" if group.lag is None else str(group.lag)
    return (
        f"{head}: queue {keys.name!r} has {waiting} requests waiting "
        f"and {group.pending} in progress"
    )


class ProducerBase:
    """What both producers share: names, ids, entry fields, limits and reply decoding."""

    def __init__(
        self,
        name: str,
        prefix: str = DEFAULT_PREFIX,
        default_deadline_s: float | None = defaults.DEADLINE_S,
        max_backlog: int | None = None,
        on_full: str = defaults.ON_FULL,
        full_wait_s: float = defaults.FULL_WAIT_S,
        shards: int = defaults.SHARDS,
        tenant: str | None = None,
        durability: Durability | None = None,
    ) -> None:
        if durability is not None and not isinstance(durability, Durability):
            raise TypeError(f"durability must be a Durability or None, got {durability!r}")
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
            -defaults.LIMITS_S,
            False,
        )  # (monotonic time, limits in force): re-read every defaults.LIMITS_S
        self._library_loaded = False
        self.shards = shards
        self.name = name
        #: wait for replicas to confirm every write (None: Redis's asynchronous replication)
        self.durability = durability
        self.default_deadline_s = default_deadline_s
        self.max_backlog = max_backlog
        self.on_full = on_full
        self.full_wait_s = full_wait_s
        # (monotonic time of the last read, backlog since): re-read every BACKLOG_CACHE_S
        self._backlog_seen = (-defaults.BACKLOG_CACHE_S, 0)
        self._new_identity()
        _LIVE.add(self)
        self.cluster = False  # set by the subclass: one BLPOP may then name one shard's key only
        self._closed = False

    def _new_identity(self) -> None:
        """Draw the token behind this producer's request ids and inboxes, and its id counter.

        Drawn again in a forked child (:func:`_after_fork`): a child that kept the
        parent's would send the same ids and pop the same inbox.
        """
        token = os.urandom(6).hex()
        self._rid_base = f"{token}-"
        self._rids = count()
        #: this producer's reply inbox in each shard (one BLPOP cannot span cluster slots)
        self.inboxes = tuple(keys.inbox(f"p-{token}") for keys in self.shard_keys)
        self.inbox = self.inboxes[0]

    def _forked(self) -> None:
        """In a forked child: a new identity, and none of the parent's in-flight state."""
        self._new_identity()
        self._reset_io()

    def _reset_io(self) -> None:
        """Drop the reader, the write batcher and their locks (the subclasses have them)."""

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
        stream: bool = False,
    ) -> tuple[str, QueueKeys, dict]:
        """(request id, its shard's keys, entry fields); ``to_inbox``: reply to our inbox there;
        ``stream``: ask for a streamed reply."""
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
                f"reply_to must be a key under {keys.inbox_prefix!r} "
                f"(the shard of request {rid!r}), "
                f"got {reply_to!r}"
            )
        fields = request_fields(
            rid, encode_body(inputs, params), deadline_ms, reply_to, current_traceparent(), stream
        )
        if self.tenant is not None:
            fields["tenant"] = self.tenant
        return rid, keys, fields

    def _write_args(self, keys: QueueKeys, lane: str, rid: str, fields: dict) -> list[Any]:
        """The one command that sends one request: its XADD, or its FCALL while the queue has
        fleet-wide limits (call ``_check_limits`` first)."""
        if self._admitting():
            return self._fcall_args(keys, lane, [rid], [fields["body"]], fields.items())
        return ["XADD", lane, "*", *chain.from_iterable(fields.items())]

    # -- sharing a fleet: lanes, admission, cancellation (no I/O) --

    def _limits_due(self) -> bool:
        return time.monotonic() - self._limits_seen[0] > defaults.LIMITS_S

    def _limits_read(self, in_force: bool) -> None:
        self._limits_seen = (time.monotonic(), in_force)

    def _admitting(self) -> bool:
        """True while the queue has fleet-wide limits.

        Entries then go through ``inferfleet_enqueue``.
        """
        return self._limits_seen[1]

    def _fcall_args(
        self,
        keys: QueueKeys,
        lane: str,
        rids: Sequence[str],
        bodies: Sequence[bytes],
        fields: Iterable[tuple[str, Any]],
    ) -> list[Any]:
        """``FCALL inferfleet_enqueue`` arguments that send ``rids`` with ``bodies`` at once.

        All of one shard; ``fields`` are the other fields every entry carries.
        """
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
            calls.append(["inferfleet_cancel", len(keys), *keys, CANCEL_TTL_S * 1000, *mine])
        return calls

    def _check_open(self) -> None:
        if self._closed:
            raise errors.InferfleetError("this producer is closed")

    def _over_limit(self, backlog: int, adding: int) -> bool:
        return self.max_backlog is not None and backlog + adding > self.max_backlog

    # -- backpressure: one cached backlog for both producers (no I/O) --

    def _backlog_cached(self) -> int | None:
        """The backlog last read plus what was sent since, or None once it is due a read.

        A read stands for BACKLOG_CACHE_S, so a burst of sends costs one read, not one each.
        """
        seen_at, backlog = self._backlog_seen
        if time.monotonic() - seen_at > defaults.BACKLOG_CACHE_S:
            return None
        return backlog

    def _backlog_read(self, backlog: int) -> int:
        self._backlog_seen = (time.monotonic(), backlog)
        return backlog

    def _room_taken(self, backlog: int, adding: int) -> bool:
        """Whether ``adding`` more fit under max_backlog; if so they count in the cached backlog."""
        if self._over_limit(backlog, adding):
            return False
        self._backlog_seen = (self._backlog_seen[0], backlog + adding)
        return True

    def _give_up(self, backlog: int, give_up: float) -> None:
        """Raise QueueFull when a send over the limit may not (or may no longer) wait."""
        if self.on_full == "raise" or time.monotonic() > give_up:
            raise self._queue_full(backlog)

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
        """Queue the XADDs of ``rids`` on ``round_``, a shard at a time.

        Returns (shard, positions in rids) for each shard.

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

    def wait_nodes(self) -> list[Any]:
        """Where a round's ``WAIT`` goes: the one server (``None``), or on a cluster each node
        that holds one of this producer's shards now (read at each round: a failover moves
        them)."""
        if not self.cluster:
            return [None]
        nodes = {}
        for keys in self.shard_keys:
            node = self.redis.get_node_from_key(keys.requests)  # type: ignore[attr-defined]
            nodes[node.name] = node
        return list(nodes.values())

    def durable_waits(self, round_: Round) -> int:
        """Queue the ``WAIT`` (s) durability asks for behind the writes of ``round_``."""
        return queue_waits(round_, self.durability, self.wait_nodes() if self.durability else [])

    def durable_verdict(self, replies: list, writes: int, waits: int) -> tuple[list, Any]:
        """(``replies`` with durability's verdict applied, the connection pool to close idle
        connections of, or None): after a shortfall the next call must find the primary again
        (a cluster follows MOVED, so it has none to close)."""
        out = confirmed(replies, writes, waits, self.durability)
        if waits and any(isinstance(one, errors.NotReplicated) for one in out):
            return out, getattr(self.redis, "connection_pool", None)  # type: ignore[attr-defined]
        return out, None

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

    @staticmethod
    def _replies_missing(scan: ReplyScan, asked: int, timeout_s: float) -> errors.ReplyTimeout:
        return errors.ReplyTimeout(f"{scan.missing} of {asked} replies missing after {timeout_s} s")
