"""Priority lanes on the worker side: one XREADGROUP over the lanes, a weighted round robin per
read.

A queue (or shard) has three lanes, streams read by group ``workers``:
``requests:high``, ``requests`` (normal: the contract's stream) and
``requests:low`` (:func:`inferfleet.producer.sharing.lane_keys`).

Every read is one ``XREADGROUP ... COUNT n STREAMS high normal low > > >``:
with only the normal lane in use it costs what a one-stream read cost (the
reply is the same; Redis skips the empty lanes). Which lane goes first is
decided per read by a weighted round robin, :data:`WEIGHTS` (8 high, 3 normal,
1 low in a cycle of 12 reads): a read "favours" a lane and takes its entries
first, then the others highest first. So a saturated high lane still leaves 3
reads in 12 to the normal lane and 1 in 12 to the low one, and a lone low
request waits at most a cycle of reads.

A read returns up to ``n`` entries from each lane it names; what it does not
use now is *held* (pending on this consumer, like read-ahead entries) and a
lane with held entries is not read again until they are used: at most ``2n``
entries are held, and the weighting stays what :data:`WEIGHTS` says.

The same round trip asks ``EXISTS PREFIX:{NAME}:cancels`` right after the
read, so a round knows, at no extra round trip, whether any request may be
cancelled (and only then looks its requests up).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import redis

from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.producer.sharing import PRIORITIES, cancels_key, lane_keys
from inferfleet.worker.resp import pack_exists, pack_xreadgroup
from inferfleet.worker.serving.behind import BehindRead

__all__ = ["NORMAL", "WEIGHTS", "LaneReader", "favoured_order", "lane_view", "pick"]

#: Reads in a cycle that favour each lane: high, normal, low.
WEIGHTS = (8, 3, 1)
#: The lane index of the contract's stream.
NORMAL = 1
_CYCLE = tuple(lane for lane, weight in enumerate(WEIGHTS) for _ in range(weight))
_ORDERS = tuple((lane, *(other for other in range(3) if other != lane)) for lane in range(3))

Entry = tuple[bytes, Any]  # (entry id, fields) as the XREADGROUP reply has them


def lane_view(keys: QueueKeys, lane: int) -> QueueKeys:
    """``keys`` with ``requests`` naming the lane's stream: what Recovery and ReplyWriter of a lane
    use."""
    if lane == NORMAL:
        return keys
    view = copy.copy(keys)
    object.__setattr__(view, "requests", lane_keys(keys)[lane])
    return view


def favoured_order(read_no: int) -> tuple[int, ...]:
    """The lane order of read number ``read_no``: the favoured lane first, then highest first."""
    return _ORDERS[_CYCLE[read_no % len(_CYCLE)]]


def pick(
    order: Sequence[int], candidates: Sequence[list[Entry]], count: int
) -> tuple[list[Entry], list[int]]:
    """Take up to ``count`` entries from ``candidates`` (one list per lane, each consumed) in
    ``order``.

    Returns the entries and, in step, each one's lane. Pure: what is left in
    ``candidates`` is what the caller holds.
    """
    taken: list[Entry] = []
    lanes: list[int] = []
    for lane in order:
        room = count - len(taken)
        if room <= 0:
            break
        mine = candidates[lane][:room]
        del candidates[lane][:room]
        taken += mine
        lanes += [lane] * len(mine)
    return taken, lanes


def _by_stream(response: Any) -> list[tuple[bytes, list]]:
    """(stream, entries) of a multi-stream XREADGROUP reply: raw RESP2 list, RESP3 map or parsed."""
    if not response:
        return []
    if isinstance(response, dict):
        return [(k if isinstance(k, bytes) else str(k).encode(), v) for k, v in response.items()]
    return [(k if isinstance(k, bytes) else str(k).encode(), v) for k, v in response]


class LaneReader:
    """Reads one consumer's entries from the three lanes of one queue (or shard).

    :meth:`read` returns the entries and their lanes (None when every one is
    from the normal lane: the common case costs nothing more); ``cancels``
    says whether the queue had cancel marks right after the read.
    """

    def __init__(self, keys: QueueKeys) -> None:
        self.streams = lane_keys(keys)
        self.cancels_key = cancels_key(keys)
        self.cancels = True  # whether cancel marks existed at the last read
        self._lane_of = {stream.encode(): lane for lane, stream in enumerate(self.streams)}
        self.held: list[list[Entry]] = [[], [], []]
        self.reads = 0
        self.taken = [0, 0, 0]  # entries handed out per lane (status, metrics, the share test)

    @property
    def holding(self) -> int:
        """Entries read and not handed out yet (pending on this consumer)."""
        return len(self.held[0]) + len(self.held[1]) + len(self.held[2])

    def read(
        self, client: redis.Redis, consumer: str, count: int, block: int | None
    ) -> tuple[list[Entry], list[int] | None]:
        """One read of up to ``count`` entries; ``block`` ms as XREADGROUP takes it (None: do not
        block)."""
        wanted = [stream for lane, stream in enumerate(self.streams) if not self.held[lane]]
        if self.holding:
            block = None  # something is ready now
        pipe = client.pipeline(
            transaction=False
        )  # one round trip; replies in the client's own XREADGROUP form
        if wanted:
            pipe.xreadgroup(GROUP, consumer, dict.fromkeys(wanted, ">"), count=count, block=block)
        pipe.exists(self.cancels_key)
        *response, cancels = pipe.execute()
        return self.take(response[0] if response else None, cancels, count)

    def read_behind(
        self, behind: BehindRead | None, consumer: str, count: int
    ) -> tuple[list[Entry], list[int] | None]:
        """:meth:`read`, not blocking, with ``behind``'s unsent reply call after it in one write
        (behind.py).

        Nothing (``[]``) where no call waits to go out or entries are held.
        """
        if behind is None or not behind.unsent or self.holding:
            return [], None
        packed = pack_xreadgroup(GROUP, consumer, count, self.streams) + pack_exists(
            self.cancels_key
        )
        response, cancels = behind.send_with(packed, 2)
        return self.take(response, cancels, count)

    def take(self, response: Any, cancels: Any, count: int) -> tuple[list[Entry], list[int] | None]:
        """What :meth:`read` returns, from the answers to its XREADGROUP and EXISTS."""
        order = favoured_order(self.reads)
        self.reads += 1
        self.cancels = bool(cancels)
        found = _by_stream(response)
        if not self.holding and (
            not found or (len(found) == 1 and self._lane_of[found[0][0]] == NORMAL)
        ):
            entries = found[0][1] if found else []
            self.taken[NORMAL] += len(entries)
            return entries, None
        for stream, entries in found:
            self.held[self._lane_of[stream]].extend(entries)
        taken, lanes = pick(order, self.held, count)
        for lane in lanes:
            self.taken[lane] += 1
        return taken, lanes

    def drop_held(self) -> None:
        """Forget the held entries (after a lost connection: they come back as this consumer's
        pending)."""
        self.held = [[], [], []]

    def shares(self) -> dict[str, int]:
        """Entries handed out per lane name since start."""
        return dict(zip(PRIORITIES, self.taken))
