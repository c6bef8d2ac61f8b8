"""The dead-letter stream ``PREFIX:{NAME}:dead``: requests given up on, with the reason.

An entry delivered more than ``max_deliveries`` times (an input that kills
its worker, say) is copied here, answered ``dead_letter`` and only then
acknowledged: a crash in between duplicates the dead letter, never loses the
request. ``inferfleet dead list|show|replay|purge`` works on this stream.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis

from inferfleet.producer.protocol import QueueKeys

__all__ = [
    "DeadLetter",
    "dead_fields",
    "list_dead",
    "find_dead",
    "replay_dead",
    "purge_dead",
    "DEAD_MAXLEN",
]

#: The dead-letter stream keeps about this many entries (approximate trim).
DEAD_MAXLEN = 100_000
_COPIED = (b"id", b"body", b"deadline", b"reply_to")


def dead_fields(
    entry_id: bytes,
    fields: Mapping[bytes, bytes] | None,
    reason: str,
    deliveries: int,
    consumer: str,
) -> dict[bytes, Any]:
    """What a dead letter holds: the request's own fields plus why and when."""
    out: dict[bytes, Any] = {k: v for k, v in (fields or {}).items() if k in _COPIED}
    out.update(
        {
            b"entry": entry_id,
            b"reason": reason,
            b"deliveries": deliveries,
            b"consumer": consumer,
            b"dead_ms": int(time.time() * 1000),
        }
    )
    return out


@dataclass
class DeadLetter:
    """One entry of the dead-letter stream, as the CLI shows it."""

    dead_id: str
    request_id: str
    entry: str
    reason: str
    deliveries: int
    consumer: str
    dead_ms: int
    body_bytes: int
    fields: dict[bytes, bytes]

    @classmethod
    def from_entry(cls, dead_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
        """Parse one entry of the dead-letter stream."""

        def text(name: bytes) -> str:
            return fields.get(name, b"").decode(errors="replace")

        return cls(
            dead_id.decode(),
            text(b"id"),
            text(b"entry"),
            text(b"reason"),
            int(text(b"deliveries") or 0),
            text(b"consumer"),
            int(text(b"dead_ms") or 0),
            len(fields.get(b"body", b"")),
            fields,
        )


def list_dead(client: redis.Redis, keys: QueueKeys, count: int = 100) -> list[DeadLetter]:
    """The oldest ``count`` dead letters."""
    return [DeadLetter.from_entry(i, f) for i, f in client.xrange(keys.dead, "-", "+", count=count)]


def find_dead(client: redis.Redis, keys: QueueKeys, ident: str) -> DeadLetter | None:
    """A dead letter by its dead-stream id or by request id."""
    if "-" in ident and ident.replace("-", "").isdigit():
        rows = client.xrange(keys.dead, ident, ident)
        if rows:
            return DeadLetter.from_entry(*rows[0])
    for dead_id, fields in client.xrange(keys.dead, "-", "+"):
        if fields.get(b"id", b"").decode(errors="replace") == ident:
            return DeadLetter.from_entry(dead_id, fields)
    return None


def replay_dead(client: redis.Redis, keys: QueueKeys, letter: DeadLetter) -> bytes:
    """Put a dead letter back on the request stream (same request id) and remove it here.

    Its old deadline is dropped: a replay is a deliberate new attempt.
    """
    fields = {k: v for k, v in letter.fields.items() if k in (b"id", b"body", b"reply_to")}
    pipe = client.pipeline(transaction=True)
    pipe.xadd(keys.requests, fields)
    pipe.xdel(keys.dead, letter.dead_id)
    new_id, _ = pipe.execute()
    return new_id


def purge_dead(client: redis.Redis, keys: QueueKeys) -> int:
    """Delete every dead letter; returns how many there were."""
    pipe = client.pipeline(transaction=True)
    pipe.xlen(keys.dead)
    pipe.delete(keys.dead)
    count, _ = pipe.execute()
    return int(count)
