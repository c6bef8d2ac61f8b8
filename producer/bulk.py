"""The bookkeeping of the producer's bulk calls, with no I/O of its own.

:class:`MapRun` is one ``map``/``imap`` call between round trips: which
inputs the next round sends (at most ``window`` in flight), and which of the
replies the producer's reader handed it are this call's. :class:`ReplyScan` is one
``results`` call: which reply keys the next round polls, in input order, so
that a round probes about as many keys as are likely answered. The
producers (``client.py``) only run the :class:`~inferfleet.producer.transport.Round`
these fill and block when a round found nothing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any, Protocol

from inferfleet.producer import errors
from inferfleet.producer.protocol import BodyEncoder, Reply, lazy_replies, shard_for
from inferfleet.producer.transport import Round

__all__ = ["InFlight", "InOrder", "MapRun", "ReplyScan", "Sender", "group_by_shard", "place"]

POP_COUNT = 1000  # replies taken from an inbox per LPOP
MIN_PROBE = 64  # reply keys a results() round polls at least...
MAX_PROBE = 4096  # ...and at most


class Sender(Protocol):
    """What the bookkeeping needs of a producer: its shards, ids and entry fields."""

    shards: int
    inboxes: tuple[str, ...]

    def new_request_ids(self, count: int) -> list[str]: ...

    def deadline_fields(self, deadline_s: float | None) -> list[tuple[str, str]]: ...

    def queue_xadds(
        self,
        round_: Round,
        rids: list[str],
        bodies: list[bytes],
        fields: list[tuple[str, str]],
        to_inbox: bool,
        lane: int = 1,
    ) -> list[tuple[int, list[int]]]: ...


def group_by_shard(rids: Sequence[str], shards: int) -> list[tuple[int, list[int]]]:
    """(shard, positions in ``rids``) for every shard that ``rids`` go to, shard order."""
    if shards == 1:
        return [(0, list(range(len(rids))))]
    groups: dict[int, list[int]] = {}
    for position, rid in enumerate(rids):
        groups.setdefault(shard_for(rid, shards), []).append(position)
    return sorted(groups.items())


class InFlight:
    """The requests a map/imap call sent and has no reply for: id -> input index, per shard."""

    def __init__(self, shards: int) -> None:
        self._where: list[dict[str, int]] = [{} for _ in range(shards)]

    def __len__(self) -> int:
        return sum(map(len, self._where))

    def add(self, rid: str, shard: int, index: int) -> None:
        """One request of ``shard`` sent as input ``index``."""
        self._where[shard][rid] = index

    def add_many(self, shard: int, rids: Iterable[str], indexes: Iterable[int]) -> None:
        """Requests of one shard sent, with their input indexes."""
        self._where[shard].update(zip(rids, indexes))

    def take(self, replies: Iterable[Reply]) -> list[tuple[int, Reply]]:
        """(input index, reply) of each of ``replies`` this call sent, now answered (others are
        skipped): one dict lookup a reply, the bulk path's inner loop."""
        pop = self._where[0].pop if len(self._where) == 1 else self.pop
        return [(index, reply) for reply in replies if (index := pop(reply.id, None)) is not None]

    def pop(self, rid: str, shard: int | None = None) -> int | None:
        """The input index of ``rid`` (now answered), or None if this call did not send it."""
        for where in self._where if shard is None else (self._where[shard],):
            index = where.pop(rid, None)
            if index is not None:
                return index
        return None

    def ids(self) -> list[str]:
        """Every request id still owed a reply."""
        return [rid for where in self._where for rid in where]

    def shards(self) -> list[int]:
        """Shards with requests in flight: the inboxes worth popping."""
        return [shard for shard, where in enumerate(self._where) if where]


class MapRun:
    """One map/imap call between round trips: what to send next, what is still owed."""

    def __init__(
        self,
        sender: Sender,
        inputs: Iterable[Any],
        params: Mapping[str, Any] | None,
        window: int,
        deadline_s: float | None,
        lane: int = 1,
        expect: Callable[[list[str], int], None] | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.sender = sender
        self.items: Iterator[Any] = iter(inputs)
        self.encoder = BodyEncoder(params)
        self.window = window
        self.deadline_s = deadline_s
        self.lane = lane  # 0 high, 1 normal, 2 low
        self.in_flight = InFlight(sender.shards)
        #: registers ids (with their shards) with the producer's reply reader before they are sent
        self.expect = expect
        self.sent = 0
        self.exhausted = False
        self.last_progress = time.monotonic()

    @property
    def active(self) -> bool:
        """True while inputs are left to send or replies to collect."""
        return not self.exhausted or bool(self.in_flight)

    def fill(self, round_: Round) -> list[str]:
        """Queue XADDs on ``round_`` until ``window`` requests are in flight; return their ids.

        Every input of the round is encoded before anything is queued, so one
        that breaks the contract raises with none of its round sent.
        """
        room = 0 if self.exhausted else self.window - len(self.in_flight)
        batch = list(islice(self.items, room)) if room > 0 else []
        self.exhausted = self.exhausted or len(batch) < room
        if not batch:
            return []
        bodies = [self.encoder.encode(one) for one in batch]
        rids = self.sender.new_request_ids(len(batch))
        fields = self.sender.deadline_fields(self.deadline_s)
        for shard, positions in self.sender.queue_xadds(
            round_, rids, bodies, fields, True, self.lane
        ):
            mine = [rids[p] for p in positions]
            self.in_flight.add_many(shard, mine, [self.sent + p for p in positions])
            if self.expect is not None:
                self.expect(mine, shard)
        self.sent += len(batch)
        return rids

    def take(self, replies: Iterable[Reply], raise_errors: bool) -> list[tuple[int, Reply]]:
        """(input index, reply) of each of ``replies`` this call sent (others are skipped)."""
        taken = self.in_flight.take(replies)
        if raise_errors:
            for _, reply in taken:
                reply.raise_for_error()
        if taken:
            self.last_progress = time.monotonic()
        return taken

    def check_stall(self, timeout_s: float) -> None:
        """Raise ReplyTimeout when no reply came for ``timeout_s`` with requests in flight."""
        if self.in_flight and time.monotonic() - self.last_progress > timeout_s:
            raise errors.ReplyTimeout(
                f"no reply for {timeout_s} s with {len(self.in_flight)} requests in flight"
            )


def place(replies: list[Any], taken: Sequence[tuple[int, Reply]]) -> None:
    """Put each (input index, reply) of ``taken`` at its index of ``replies`` (map's result),
    growing it as needed: once a round, not once a reply."""
    if taken:
        # max() compares (index, reply) pairs by index alone: no two share one
        replies += [None] * (max(taken)[0] + 1 - len(replies))
        for index, reply in taken:
            replies[index] = reply


class InOrder:
    """imap(ordered=True): hands replies on in input order as the gaps before them fill."""

    def __init__(self) -> None:
        self._ready: dict[int, Reply] = {}
        self._next = 0

    def release(self, taken: Iterable[tuple[int, Reply]]) -> list[Reply]:
        """The replies that ``taken`` lets out, in input order (none while an earlier one is
        missing)."""
        ready = self._ready
        ready.update(taken)
        out = []
        while self._next in ready:
            out.append(ready.pop(self._next))
            self._next += 1
        return out


class ReplyScan:
    """One results() call: the reply keys still to poll, in input order.

    A round is a BLPOP on the last of the next ``probe`` missing keys and
    LPOPs of the others: Redis runs the LPOPs once the BLPOP returns, at once
    when its reply is there, else right after the write that brings it, so
    one round trip waits and collects. Replies arrive about in input order, a
    worker's batch at a time, so by then the keys before it are mostly
    answered too: while a round finds every key it names, the next waits for
    twice as many (up to MAX_PROBE); after one that missed some, for as many
    as it found. A worker that is behind costs a round trip every few
    thousand replies, one that is ahead a few rounds in all.
    """

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(dict.fromkeys(keys))  # a key asked twice is polled once
        self._positions: list[int] | None = None
        if len(self.keys) < len(keys):
            order = {key: i for i, key in enumerate(self.keys)}
            self._positions = [order[key] for key in keys]
        self.found: list[Reply | None] = [None] * len(self.keys)
        self._missing = deque(range(len(self.keys)))
        self._probe = MIN_PROBE
        self._probed: list[int] = []
        self._waited = 0  # the key the last round's BLPOP named

    @property
    def missing(self) -> int:
        """How many replies are still missing."""
        return len(self._missing)

    def queue(self, round_: Round, timeout_s: float) -> None:
        """Queue the next round on ``round_``: a BLPOP (up to ``timeout_s``) on the last of the next
        ``probe`` missing keys, then an LPOP of each of the others (they run once the BLPOP
        returns)."""
        missing, keys = self._missing, self.keys
        probed = [missing.popleft() for _ in range(min(self._probe, len(missing)))]
        self._waited = probed.pop()
        self._probed = probed
        round_.blpop([keys[self._waited]], timeout_s)
        round_.lpops([keys[i] for i in probed])

    def take(self, replies: Sequence[Any], raise_errors: bool) -> None:
        """Record the replies of the round :meth:`queue` made and size the next one."""
        probed, waited = self._probed, self._waited
        blocked, replies = replies[0], replies[1:]
        if blocked:  # [key, reply], or None when the BLPOP timed out
            self._record([waited], [blocked[1]], raise_errors)
        left = [index for index, raw in zip(probed, replies) if raw is None]
        if len(left) < len(probed):
            self._record(
                [index for index, raw in zip(probed, replies) if raw is not None],
                [raw for raw in replies if raw is not None],
                raise_errors,
            )
        if not blocked:
            left.append(waited)
        self._missing.extendleft(reversed(left))
        found = len(probed) + 1 - len(left)
        # all found: wait for twice as many; else (out of order, or it timed out) for as many as
        # came
        self._probe = min(MAX_PROBE, 2 * self._probe if not left else max(MIN_PROBE, found))

    def _record(self, indexes: list[int], raws: list[bytes], raise_errors: bool) -> None:
        found = self.found
        for index, reply in zip(indexes, lazy_replies(raws)):
            found[index] = reply
            if raise_errors and not reply.ok:
                reply.raise_for_error()

    def replies(self) -> list[Reply]:
        """Every reply, in input order (the same reply for an id asked twice)."""
        found: list[Any] = self.found
        return found if self._positions is None else [found[i] for i in self._positions]
