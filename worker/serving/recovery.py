"""Recovery of entries whose consumer died, and of a consumer's own orphans.

A worker proves it is alive with its heartbeat (``inferfleet.worker.heartbeat``), which
a thread refreshes even during a long batch. Entries pending on a consumer
with no live heartbeat are taken over by a live worker once they have been
idle ``claim_idle_s``: seconds after a crash, never from a worker that is
merely busy. Such entries are *suspects*: the caller computes them one at a
time, counting a delivery each time it starts one, so an input that keeps
killing its workers is dead-lettered while its batch-mates are answered.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.worker.heartbeat import read_heartbeats

__all__ = ["Delivery", "dead_consumers", "claim_from", "own_pending", "start_attempt"]

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
    return [_name(c["name"]) for c in consumers if int(c["pending"]) > 0 and _name(c["name"]) not in live]


def _fields_of(client: redis.Redis, keys: QueueKeys, ids: list[bytes]) -> dict[bytes, Any]:
    pipe = client.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xrange(keys.requests, entry_id, entry_id)
    return {rows[0][0]: rows[0][1] for rows in pipe.execute() if rows}


def _suspects(client: redis.Redis, keys: QueueKeys, rows: list[dict]) -> list[Delivery]:
    counts = {row["message_id"]: int(row["times_delivered"]) for row in rows}
    fields = _fields_of(client, keys, list(counts))
    return [(eid, fields.get(eid), count) for eid, count in counts.items()]


def claim_from(client: redis.Redis, keys: QueueKeys, dead: str, me: str, min_idle_ms: int,
               count: int) -> list[Delivery]:
    """Take over up to ``count`` of ``dead``'s entries idle at least ``min_idle_ms``.

    Claimed with JUSTID, which leaves delivery counts alone: a count goes up
    only when a worker starts computing the entry (:func:`start_attempt`), so
    requests that merely shared a batch with a crashing one are not blamed.
    XCLAIM's own idle check makes two claimers racing safe.
    """
    rows = client.xpending_range(keys.requests, GROUP, min="-", max="+", count=count,
                                 consumername=dead, idle=min_idle_ms)
    if not rows:
        return []
    claimed = set(client.xclaim(keys.requests, GROUP, me, min_idle_ms,
                                [row["message_id"] for row in rows], justid=True))
    return _suspects(client, keys, [row for row in rows if row["message_id"] in claimed])


def own_pending(client: redis.Redis, keys: QueueKeys, me: str, count: int = 100_000) -> list[Delivery]:
    """This consumer's pending entries (after a restart or a reply lost in a reconnect)."""
    rows = client.xpending_range(keys.requests, GROUP, min="-", max="+", count=count, consumername=me)
    return _suspects(client, keys, rows) if rows else []


def start_attempt(client: redis.Redis, keys: QueueKeys, me: str, entry_id: bytes) -> bool:
    """Count one more delivery of ``entry_id`` (XCLAIM to ourselves) before computing it.

    False if the entry is no longer pending on us: another worker answered it.
    """
    return bool(client.xclaim(keys.requests, GROUP, me, 0, [entry_id]))
