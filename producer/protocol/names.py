"""Names and keys of the wire contract: the group, every Redis key of a queue, the shards.

:class:`QueueKeys` names every key of one queue; :func:`shard_keys` and
:func:`shard_for` name and pick the shards of a sharded one;
:func:`workers_group` reads the group's state off XINFO GROUPS.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol.rules import validate_name, validate_prefix

__all__ = [
    "CONTRACT_VERSION",
    "DEFAULT_PREFIX",
    "DEFAULT_REPLY_TTL_S",
    "ERROR_CODES",
    "GROUP",
    "MAX_SHARDS",
    "GroupInfo",
    "QueueKeys",
    "entry_time_ms",
    "shard_for",
    "shard_keys",
    "shard_name",
    "workers_group",
]

CONTRACT_VERSION = 1
DEFAULT_PREFIX = "inferfleet"
GROUP = "workers"
DEFAULT_REPLY_TTL_S = 300
MAX_SHARDS = 1024
ERROR_CODES = (
    "bad_request",
    "too_large",
    "expired",
    "model_error",
    "dead_letter",
    "cancelled",
    "rate_limited",
    "overloaded",
)  # the last three: contract 1.1


@dataclass(frozen=True)
class GroupInfo:
    """Group ``workers`` of one request stream, as XINFO GROUPS reports it."""

    #: Entries not yet delivered to any worker; None where Redis cannot tell
    #: (after an XDEL or XTRIM of undelivered entries).
    lag: int | None
    #: Entries delivered but not yet acknowledged.
    pending: int
    last_delivered_id: str


def workers_group(groups: Sequence[Mapping[Any, Any]]) -> GroupInfo | None:
    """Group ``workers`` in an XINFO GROUPS reply (names as str or bytes), or None if it is missing.

    The one place that reads that reply: the SDK's backpressure, the
    supervisor, ``inferfleet status`` and the worker's trim all use it.
    """
    for group in groups:
        if group.get("name") in (GROUP, GROUP.encode()):
            lag = group.get("lag")
            last = group.get("last-delivered-id", b"0-0")
            return GroupInfo(
                None if lag is None else int(lag),
                int(group.get("pending", 0)),
                last.decode() if isinstance(last, bytes) else str(last),
            )
    return None


@dataclass(frozen=True)
class QueueKeys:
    """Every Redis key of one queue. The braces are a Redis Cluster hash tag."""

    name: str
    prefix: str = DEFAULT_PREFIX
    base: str = field(init=False)
    requests: str = field(init=False)
    dead: str = field(init=False)
    inbox_prefix: str = field(init=False)

    def __post_init__(self) -> None:
        validate_name(self.name)
        validate_prefix(self.prefix)
        base = f"{self.prefix}:{{{self.name}}}:"
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "requests", base + "requests")
        object.__setattr__(self, "dead", base + "dead")
        object.__setattr__(self, "inbox_prefix", base + "inbox:")

    def reply(self, rid: str) -> str:
        """The default reply list of request ``rid``."""
        return f"{self.base}reply:{rid}"

    def chunks(self, rid: str) -> str:
        """The reply stream of request ``rid`` when it asked for one (contract 1.3: stream.py)."""
        return f"{self.base}chunks:{rid}"

    def inbox(self, suffix: str) -> str:
        """A shared reply inbox a client may name in ``reply_to``."""
        if not suffix or any(c in suffix for c in "{} \t\r\n"):
            raise ProtocolError(f"invalid inbox suffix {suffix!r}")
        return self.inbox_prefix + suffix

    def own(self, what: str) -> str:
        """An implementation key under this queue's prefix (heartbeats, version...)."""
        return self.base + what

    def is_inbox(self, key: str) -> bool:
        """True if ``key`` is a reply inbox of this queue (what ``reply_to`` may name)."""
        return (
            key.startswith(self.inbox_prefix)
            and len(key) > len(self.inbox_prefix)
            and len(key) <= len(self.inbox_prefix) + 256
            and not any(c in key[len(self.inbox_prefix) :] for c in "{} \t\r\n")
        )


# --------------------------------------------------------------------------- shards


def _check_shards(shards: int) -> int:
    if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= MAX_SHARDS:
        raise ProtocolError(f"shards must be an integer from 1 to {MAX_SHARDS}, got {shards!r}")
    return shards


def shard_for(request_id: str, shards: int) -> int:
    """The shard (0 to ``shards - 1``) that request ``request_id`` goes to.

    CRC-32/IEEE (what zlib.crc32 computes) of the id's UTF-8 bytes, mod
    ``shards``: any language can reproduce it, so any producer and any tool
    finds the same shard for the same id.
    """
    return zlib.crc32(request_id.encode("utf-8")) % _check_shards(shards)


def shard_name(name: str, shard: int, shards: int) -> str:
    """The queue name of shard ``shard``: ``NAME`` itself when unsharded, else ``NAME.shard``.

    A shard name must itself be a valid queue name (64 characters at most),
    so a sharded queue's own name is shorter by the suffix; this says by how much.
    """
    validate_name(name)
    if _check_shards(shards) == 1:
        return name
    if not isinstance(shard, int) or not 0 <= shard < shards:
        raise ProtocolError(f"shard must be an integer from 0 to {shards - 1}, got {shard!r}")
    longest = len(name) + 1 + len(str(shards - 1))
    if longest > 64:
        raise ProtocolError(
            f"queue name {name!r} is too long for {shards} shards: shard names such as "
            f"{name}.{shards - 1} must fit 64 characters, so use at most {64 - longest + len(name)}"
        )
    return f"{name}.{shard}"


def shard_keys(name: str, shards: int = 1, prefix: str = DEFAULT_PREFIX) -> tuple[QueueKeys, ...]:
    """The keys of every shard of queue ``name``, shard 0 first.

    Shard ``s`` is keyed exactly like a queue named ``NAME.s`` (its own hash
    tag, so its own cluster slot); with one shard the queue is ``NAME``'s own.
    """
    return tuple(
        QueueKeys(shard_name(name, s, shards), prefix) for s in range(_check_shards(shards))
    )


def entry_time_ms(entry_id: bytes | str) -> int:
    """The millisecond timestamp part of a stream entry id (Redis server clock)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])
