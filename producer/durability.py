"""Durability as a choice: a write counts as accepted once replicas confirm it (``WAIT``).

Redis replicates asynchronously: an ``XADD`` the primary answered may still be
lost if the primary dies before its replica has it, or if a switch-over leaves
it writable for a while after a replica was promoted (docs/reliability.md
measures both). With :class:`Durability` the SDK sends ``WAIT replicas
timeout_ms`` behind the writes of each round, on the connection that wrote them
(one round trip still), and a request counts as accepted only when enough
replicas acknowledged it. When they did not, every write of that round raises
:class:`~inferfleet.producer.errors.NotReplicated`, and the client's idle
connections are closed, so that the next call finds the primary again (through
Sentinel, or a moving DNS name).

The rule lives in two pure functions: :func:`queue_waits` adds the ``WAIT``
commands to a round, :func:`confirmed` reads their replies back. On Redis
Cluster one ``WAIT`` goes to each node holding one of the producer's streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inferfleet.producer import errors
from inferfleet.producer.transport import Round

__all__ = ["Durability", "confirmed", "queue_waits"]


@dataclass(frozen=True)
class Durability:
    """Wait for ``replicas`` replicas to confirm each round of writes, ``timeout_ms`` at most.

    ``replicas`` is the count ``WAIT`` must reach (1 with one replica: a promoted
    replica then holds every accepted request); ``timeout_ms`` bounds the wait
    (``WAIT`` with 0 would block for ever, so it is refused).
    """

    replicas: int = 1
    timeout_ms: int = 1000

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise TypeError(f"replicas must be an int, got {self.replicas!r}")
        if isinstance(self.timeout_ms, bool) or not isinstance(self.timeout_ms, int):
            raise TypeError(f"timeout_ms must be an int, got {self.timeout_ms!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.timeout_ms < 1:
            raise ValueError(
                f"timeout_ms must be at least 1 (WAIT 0 blocks for ever), got {self.timeout_ms}"
            )


def queue_waits(round_: Round, durability: Durability | None, nodes: Sequence[Any]) -> int:
    """Add one ``WAIT`` a node (``None``: the client's one server) behind the writes queued on
    ``round_``; return how many were added (0 without durability)."""
    if durability is None:
        return 0
    for node in nodes:
        round_.wait(durability.replicas, durability.timeout_ms, node)
    return len(nodes)


def confirmed(replies: list[Any], writes: int, waits: int, durability: Durability | None) -> list:
    """The replies to a round's first ``writes`` commands, its ``waits`` WAIT replies after them
    taken off: each write reply that is not an error becomes :class:`NotReplicated` when a
    ``WAIT`` fell short of ``durability.replicas`` (or failed)."""
    if not waits or durability is None:
        return replies
    told = replies[writes : writes + waits]
    kept = replies[:writes] + replies[writes + waits :]
    failed = next((reply for reply in told if isinstance(reply, Exception)), None)
    seen = min((int(reply) for reply in told if not isinstance(reply, Exception)), default=0)
    if failed is None and seen >= durability.replicas:
        return kept
    for i in range(writes):  # a WAIT that failed (NOPERM: not granted) fails the writes with it
        if not isinstance(kept[i], Exception):
            kept[i] = failed if failed is not None else not_replicated(durability, seen)
    return kept


def not_replicated(durability: Durability, seen: int) -> errors.NotReplicated:
    """The error a write gets when only ``seen`` replicas confirmed it."""
    return errors.NotReplicated(
        f"the request reached the primary, but {seen} of the {durability.replicas} replicas "
        f"asked for confirmed it within {durability.timeout_ms} ms: a failover now could lose "
        "it, and it may still be computed. Send it again (a new id) if you still need it; the "
        "next call reconnects (docs/reliability.md, section Durability)"
    )
