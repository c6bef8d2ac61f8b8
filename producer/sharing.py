"""Sharing a fleet (contract 1.1): priority lanes, tenants, fleet-wide limits and cancellation.

No I/O but :func:`read_lanes` (what status and the supervisor read): the key
names, the checks of what a caller passes, and the Redis Function library
(:data:`LIBRARY`) that every producer, every worker and any raw client
calls, so that the admission check and the XADD are one atomic step in
Redis. The library is loaded (``FUNCTION LOAD REPLACE``) by every worker
when it starts, by ``inferfleet limit`` and by a producer that finds limits
in force.

Keys, all under the queue's ``PREFIX:{NAME}:`` base (one cluster slot):

==========================  ======  ===============================================
key                         type    what
==========================  ======  ===============================================
``requests:high``           stream  the high lane (the contract's ``requests`` is normal)
``requests:low``            stream  the low lane
``limits``                  hash    ``max_backlog``, ``rate:T``, ``burst:T``, ``stamp``
``bucket:T``                hash    tenant T's token bucket (``t`` tokens, ``ts`` ms), with a TTL
``tenants``                 hash    ``accepted:T`` / ``refused:T`` counts while limits are in force
``cancels``                 zset    cancelled request id -> expiry (unix ms); the key expires with
its last ==========================  ======  ===============================================
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import QueueKeys, entry_time_ms, is_tenant, workers_group

__all__ = [
    "CANCEL_TTL_S",
    "LIBRARY",
    "LaneState",
    "MAX_TENANTS",
    "PRIORITIES",
    "cancel_keys",
    "cancels_key",
    "check_keys",
    "enqueue_keys",
    "is_tenant",
    "lane_keys",
    "lane_of",
    "limits_key",
    "read_lanes",
    "tenants_key",
    "validate_priority",
    "validate_rate",
    "validate_tenant",
]

#: The priorities, highest first; ``normal`` is the contract's own stream.
PRIORITIES = ("high", "normal", "low")
#: How many tenants may have a quota on one queue: the bound of the ``tenant`` metrics label.
MAX_TENANTS = 64
#: The longest a cancel mark lives when its request has no deadline.
CANCEL_TTL_S = 3600
#: The highest rate (requests a second) and burst a quota may have.
MAX_RATE = 1_000_000.0


def lane_keys(keys: QueueKeys) -> tuple[str, str, str]:
    """The high, normal and low lane streams of a queue (or shard)."""
    return keys.requests + ":high", keys.requests, keys.requests + ":low"


def validate_priority(priority: str) -> int:
    """The lane index (0 high, 1 normal, 2 low) of ``priority``; ProtocolError for anything else."""
    try:
        return PRIORITIES.index(priority)
    except ValueError:
        raise ProtocolError(
            f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}"
        ) from None


def lane_of(keys: QueueKeys, priority: str) -> str:
    """The stream a request of ``priority`` goes to."""
    return lane_keys(keys)[validate_priority(priority)]


def validate_tenant(tenant: str) -> str:
    """``tenant`` if valid, else ProtocolError naming the rule."""
    if not isinstance(tenant, str) or not tenant.isascii() or not is_tenant(tenant.encode()):
        raise ProtocolError(
            f"tenant must be 1 to 64 characters of A-Z a-z 0-9 . _ : @ -, got {tenant!r}"
        )
    return tenant


def validate_rate(rate: float, burst: float | None) -> tuple[float, float]:
    """(rate, burst) of a quota: a positive finite rate up to MAX_RATE a second; burst defaults to
    rate."""
    burst = rate if burst is None else burst
    for label, value in (("rate", rate), ("burst", burst)):
        if (
            not isinstance(value, int | float)
            or not math.isfinite(value)
            or not 0 < value <= MAX_RATE
        ):
            raise ProtocolError(
                f"{label} must be a number above 0 and at most {MAX_RATE:g}, got {value!r}"
            )
    if burst < 1:
        raise ProtocolError(f"burst must be at least 1 (one request), got {burst!r}")
    return float(rate), float(burst)


def limits_key(keys: QueueKeys) -> str:
    """The hash of the limits in force on a queue."""
    return keys.own("limits")


def tenants_key(keys: QueueKeys) -> str:
    """The hash of accepted / refused counts per tenant."""
    return keys.own("tenants")


def cancels_key(keys: QueueKeys) -> str:
    """The sorted set of cancelled request ids (score: when the mark expires, unix ms)."""
    return keys.own("cancels")


def _bucket_key(keys: QueueKeys, tenant: str) -> str:
    return keys.own("bucket:" + tenant) if tenant else limits_key(keys)


def enqueue_keys(keys: QueueKeys, lane: str, tenant: str) -> list[str]:
    """KEYS of ``FCALL inferfleet_enqueue``: lane, limits, bucket, tenants, high, normal, low."""
    return [lane, limits_key(keys), _bucket_key(keys, tenant), tenants_key(keys), *lane_keys(keys)]


def check_keys(keys: QueueKeys, tenants: list[str]) -> list[str]:
    """KEYS of ``FCALL inferfleet_check``: limits, tenants, the three lanes, one bucket per
    entry."""
    return [
        limits_key(keys),
        tenants_key(keys),
        *lane_keys(keys),
        *(_bucket_key(keys, t) for t in tenants),
    ]


def cancel_keys(keys: QueueKeys, rids: list[str]) -> list[str]:
    """KEYS of ``FCALL inferfleet_cancel``: the cancels set, the three lanes, each request's reply
    key."""
    return [cancels_key(keys), *lane_keys(keys), *(keys.reply(rid) for rid in rids)]


#: The Redis Function library (``producer/lua/library.lua``, which documents each function),
#: read once a process. Every function takes only the keys it is given (one cluster slot).
LIBRARY = (Path(__file__).with_name("lua") / "library.lua").read_text()


@dataclass(frozen=True)
class LaneState:
    """One lane as Redis shows it now: entries, undelivered (lag), pending, and how long its oldest
    undelivered entry has waited (0 when none)."""

    name: str
    length: int
    lag: int | None
    pending: int
    wait_s: float


def read_lanes(client: Any, keys: QueueKeys, now_ms: float | None = None) -> list[LaneState]:
    """The three lanes of a queue (or shard), highest first (a few commands a lane: status and
    scaling)."""
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    states = []
    for name, stream in zip(PRIORITIES, lane_keys(keys)):
        length = int(client.xlen(stream))
        group = workers_group(client.xinfo_groups(stream)) if length else None
        if group is None:
            first = client.xrange(stream, count=1) if length else []
            states.append(LaneState(name, length, length, 0, _waited(first, now_ms)))
            continue
        after = (
            client.xrange(stream, min="(" + group.last_delivered_id, count=1)
            if group.lag != 0
            else []
        )
        states.append(LaneState(name, length, group.lag, group.pending, _waited(after, now_ms)))
    return states


def _waited(entries: list, now_ms: float) -> float:
    return max(0.0, (now_ms - entry_time_ms(entries[0][0])) / 1000) if entries else 0.0
