"""Recovery of entries whose consumer died, and of a consumer's own orphans.

A worker proves it is alive with its heartbeat (``inferfleet.worker.heartbeat``), which
a thread refreshes even during a long batch. Entries pending on a consumer
with no live heartbeat are taken over by a live worker once they have been
idle ``claim_idle_s``: seconds after a crash, never from a worker that is
merely busy. Such entries are *suspects*: the caller computes them one at a
time, counting a delivery each time it starts one, so an input that keeps
killing its workers is dead-lettered while its batch-mates are answered.

Only deliveries to a worker that then died or hung count. A worker that
replays its *own* pending entries because of its own trouble (a reply it
could not write to a full Redis, a connection it lost) retries them without
counting a delivery (XCLAIM JUSTID leaves the count alone): however long
Redis stays full, an innocent request is never dead-lettered for it. The
first replay after a start still counts, since the process that held the
entries under this consumer name is gone.

:class:`Recovery` is one consumer's side of it: its suspects, the replay of
its own pending entries (after a start, a reconnect or a lost reply), and
the housekeeping that trims the stream, finds orphans and takes over a dead
consumer's entries.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from inferfleet.producer.protocol import GROUP, QueueKeys, workers_group
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.heartbeat import read_heartbeats

__all__ = ["Delivery", "Recovery", "dead_consumers", "claim_from", "own_pending", "start_attempt"]

log = logging.getLogger(__name__)

#: (entry id, fields or None if the entry was deleted, times delivered including this one)
Delivery = tuple[bytes, Any, int]


def _name(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def dead_consumers(client: redis.Redis, keys: QueueKeys, me: str) -> list[str]:
    """Consumers of the group that hold pending entries but have no live heartbeat."""
    try:
        consumers = client.xinfo_consumers(keys.requests, GROUP)
    except redis.exceptions.ResponseError:  # no group yet
        return []
    live = {beat.consumer for beat in read_heartbeats(client, keys)} | {me}
    return [
        _name(c["name"])
        for c in consumers
        if int(c["pending"]) > 0 and _name(c["name"]) not in live
    ]


def _fields_of(client: redis.Redis, keys: QueueKeys, ids: list[bytes]) -> dict[bytes, Any]:
    pipe = client.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xrange(keys.requests, entry_id, entry_id)
    return {rows[0][0]: rows[0][1] for rows in pipe.execute() if rows}


def _suspects(client: redis.Redis, keys: QueueKeys, rows: list[dict]) -> list[Delivery]:
    counts = {row["message_id"]: int(row["times_delivered"]) for row in rows}
    fields = _fields_of(client, keys, list(counts))
    return [(eid, fields.get(eid), count) for eid, count in counts.items()]


def claim_from(
    client: redis.Redis, keys: QueueKeys, dead: str, me: str, min_idle_ms: int, count: int
) -> list[Delivery]:
    """Take over up to ``count`` of ``dead``'s entries idle at least ``min_idle_ms``.

    Claimed with JUSTID, which leaves delivery counts alone: a count goes up
    only when a worker starts computing the entry (:func:`start_attempt`), so
    requests that merely shared a batch with a crashing one are not blamed.
    XCLAIM's own idle check makes two claimers racing safe.
    """
    rows = client.xpending_range(
        keys.requests, GROUP, min="-", max="+", count=count, consumername=dead, idle=min_idle_ms
    )
    if not rows:
        return []
    claimed = set(
        client.xclaim(
            keys.requests, GROUP, me, min_idle_ms, [row["message_id"] for row in rows], justid=True
        )
    )
    return _suspects(client, keys, [row for row in rows if row["message_id"] in claimed])


def own_pending(
    client: redis.Redis, keys: QueueKeys, me: str, count: int = 100_000
) -> list[Delivery]:
    """This consumer's pending entries (after a restart or a reply lost in a reconnect)."""
    rows = client.xpending_range(
        keys.requests, GROUP, min="-", max="+", count=count, consumername=me
    )
    return _suspects(client, keys, rows) if rows else []


def start_attempt(
    client: redis.Redis, keys: QueueKeys, me: str, entry_id: bytes, counted: bool = True
) -> bool:
    """Count one more delivery of ``entry_id`` (XCLAIM to ourselves) before computing it;
    with ``counted`` False only make sure it is still ours (JUSTID: the count stays).

    False if the entry is no longer pending on us: another worker answered it.
    """
    return bool(client.xclaim(keys.requests, GROUP, me, 0, [entry_id], justid=not counted))


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class Recovery:
    """What one consumer owes besides new entries, and the housekeeping that finds it.

    ``suspects`` are computed one at a time, before any new entry;
    ``replay_own`` asks for this consumer name's pending entries to become
    suspects (true at start; the consumer sets it again after a lost
    connection). Housekeeping runs every ``housekeeping_s``.
    """

    def __init__(
        self, client: redis.Redis, keys: QueueKeys, settings: WorkerSettings, metrics: Counters
    ) -> None:
        self.redis = client
        self.keys = keys
        self.settings = settings
        self.metrics = (
            metrics  # the consumer's counters: the queue depth reaches Prometheus through them
        )
        self.suspects: list[Delivery] = []  # replayed or taken over: computed one at a time
        self.replay_own = True  # first thing after start or reconnect
        self._next_housekeeping = 0.0
        self._started = (
            False  # the first replay (of a previous process's entries) counts deliveries
        )
        self._retries: set[bytes] = (
            set()
        )  # suspects replayed for our own trouble: no delivery counted

    def replay_own_pending(self) -> None:
        """Replay what this consumer name holds but never answered (a restart or a lost reply).

        After the first replay of this process, a replay is this process's own
        retry: its entries are computed again without counting a delivery.
        """
        owed = {
            entry_id for entry_id, _, _ in self.suspects if entry_id not in self._retries
        }  # taken over, not
        self.suspects = own_pending(
            self.redis, self.keys, self.settings.consumer
        )  # started yet: they still count
        self._retries = (
            {entry_id for entry_id, _, _ in self.suspects} - owed if self._started else set()
        )
        if self.suspects:
            log.info(
                "replaying %d pending entries of consumer %s, one at a time%s",
                len(self.suspects),
                self.settings.consumer,
                " (our own retry: no delivery counted)" if self._started else "",
            )
        self._started = True
        self.replay_own = False

    def next_suspect(self) -> Delivery | None:
        """The oldest suspect still to compute, if any."""
        return self.suspects.pop(0) if self.suspects else None

    def start_attempt(self, entry_id: bytes, delivered: int) -> int | None:
        """Count a delivery of ``entry_id`` (delivered ``delivered`` times so far), then compute.

        Returns the delivery this attempt is (``delivered`` again for our own
        retry, which counts none), or None if the entry is no longer ours.
        """
        counted = entry_id not in self._retries
        self._retries.discard(entry_id)
        if not start_attempt(self.redis, self.keys, self.settings.consumer, entry_id, counted):
            return None
        return delivered + 1 if counted else delivered

    def housekeeping_due(self, now: float) -> bool:
        """True once every ``housekeeping_s`` of ``now`` (a monotonic clock); schedules the next."""
        if now < self._next_housekeeping:
            return False
        self._next_housekeeping = now + self.settings.housekeeping_s
        return True

    def housekeep(self, read_ahead: int) -> None:
        """Trim the stream, replay orphans, take over a dead consumer's entries if no suspect waits.

        ``read_ahead``: entries the consumer holds read ahead (pending on it, not orphans).
        """
        self._trim()
        self._check_orphans(read_ahead)
        if not self.suspects:
            self.reclaim()

    def _trim(self) -> None:
        """Drop entries every group is done with: everything below the oldest one still needed.

        In each group, entries after its last-delivered id may be undelivered
        and entries from its oldest pending id on are still owed a reply.
        Neither bound can move backwards, so a concurrent read is safe.
        """
        bound: tuple[int, int] | None = None
        groups = self.redis.xinfo_groups(self.keys.requests)
        ours = workers_group(groups)
        if ours is not None:  # the metrics' queue depth, at no extra round trip
            self.metrics.queue_depth(ours.lag, ours.pending)
        for group in groups:
            need = _id_key(group["last-delivered-id"])
            if int(group["pending"]):
                pending = self.redis.xpending(self.keys.requests, group["name"])
                if pending["pending"]:
                    need = min(need, _id_key(pending["min"]))
            bound = need if bound is None else min(bound, need)
        if bound is not None and bound > (0, 0):
            self.redis.xtrim(self.keys.requests, minid=f"{bound[0]}-{bound[1]}", approximate=False)

    def reclaim(self) -> None:
        """Take over the pending entries of consumers whose heartbeat has lapsed."""
        for dead in dead_consumers(self.redis, self.keys, self.settings.consumer):
            taken = claim_from(
                self.redis,
                self.keys,
                dead,
                self.settings.consumer,
                int(self.settings.claim_idle_s * 1000),
                self.settings.max_batch_rows * 4,
            )
            if taken:
                log.warning(
                    "consumer %s took over %d entries of %s (no heartbeat)",
                    self.settings.consumer,
                    len(taken),
                    dead,
                )
                self.suspects.extend(taken)
                return

    def _check_orphans(self, read_ahead: int) -> None:
        """Entries pending on us that we do not hold were lost in transit (a reply lost
        on a dropped connection): replay them. Between rounds we hold only the suspects
        and the read-ahead entries."""
        for consumer in self.redis.xinfo_consumers(self.keys.requests, GROUP):
            name = consumer["name"]
            if (name.decode() if isinstance(name, bytes) else name) == self.settings.consumer:
                if int(consumer["pending"]) > len(self.suspects) + read_ahead:
                    self.replay_own = True
                return
