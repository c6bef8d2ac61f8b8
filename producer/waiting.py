"""Who waits for which reply: the routing table of a producer's one reply reader.

Every call of a producer that collects replies from its inbox (``infer``,
``map``, ``imap``, from any thread or task) registers the ids it sent here with
a *sink*, a callable that takes a list of replies (or an exception). The one
reader of the producer pops the inbox, and :meth:`Waiting.route` tells it which
sink gets which reply, so no call can ever take another call's reply. A reply
nobody waits for any more (its call timed out or was cancelled) is dropped.

No I/O and no locks: the readers (:mod:`~inferfleet.producer.reader`) hold
their own lock around it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

from inferfleet.producer.bulk import POP_COUNT
from inferfleet.producer.protocol import Reply, lazy_replies
from inferfleet.producer.transport import Round

__all__ = ["Sink", "Waiting", "popped_replies", "queue_reads"]

#: What a waiting call is handed: the replies of its own ids, or the error that ended the wait.
Sink = Callable[[Any], None]


class Waiting:
    """Request id -> (sink, shard) of every reply some call of this producer waits for."""

    def __init__(self, shards: int) -> None:
        self._where: dict[str, tuple[Sink, int]] = {}
        self._per_shard = [0] * shards
        #: replies popped that no call waited for (late, after a timeout or cancellation)
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._where)

    def add(self, sink: Sink, rids: Sequence[str], shard: int) -> None:
        """Wait for the replies of ``rids`` (all in ``shard``'s inbox), handed to ``sink``."""
        where = self._where
        if not where.keys().isdisjoint(rids):
            taken = next(rid for rid in rids if rid in where)
            raise ValueError(f"request id {taken!r} is already awaited by another call")
        before = len(where)
        # one C-level update for a whole map round: this runs for every request sent
        where.update(zip(rids, repeat((sink, shard))))
        self._per_shard[shard] += len(where) - before

    def discard(self, rids: Iterable[str]) -> None:
        """Stop waiting for ``rids`` (answered, timed out or cancelled); unknown ids are skipped."""
        where, per_shard = self._where, self._per_shard
        for rid in rids:
            found = where.pop(rid, None)
            if found is not None:
                per_shard[found[1]] -= 1

    def shards(self) -> list[int]:
        """Shards some call waits in: the inboxes worth reading."""
        return [shard for shard, count in enumerate(self._per_shard) if count]

    def route(self, raws: Sequence[bytes]) -> list[tuple[Sink, list[Reply]]]:
        """Each sink with the replies among ``raws`` that are its own; those ids stop waiting."""
        where, per_shard = self._where, self._per_shard
        routed: dict[int, tuple[Sink, list[Reply]]] = {}
        last: Sink | None = None
        mine: list[Reply] = []
        for reply in lazy_replies(raws):
            found = where.pop(reply.id, None)
            if found is None:
                self.dropped += 1
                continue
            sink, shard = found
            per_shard[shard] -= 1
            if sink is not last:  # replies come a call's batch at a time: look up only on a change
                last = sink
                mine = routed.setdefault(id(sink), (sink, []))[1]
            mine.append(reply)
        return list(routed.values())

    def clear(self) -> list[Sink]:
        """Stop waiting for everything; return every sink that waited (each once)."""
        sinks = {id(sink): sink for sink, _ in self._where.values()}
        self._where.clear()
        self._per_shard = [0] * len(self._per_shard)
        return list(sinks.values())


def queue_reads(
    round_: Round,
    inboxes: Sequence[str],
    block: Sequence[str],
    block_s: float,
    shards: Sequence[int],
) -> None:
    """One reader round: BLPOP ``block`` (up to ``block_s``), then LPOP each waiting shard's inbox.

    Redis runs the LPOPs once the BLPOP returns, so one round trip waits for a
    reply and collects the batch that came with it.
    """
    round_.blpop(block, block_s)
    for shard in shards:
        round_.lpop(inboxes[shard], POP_COUNT)


def popped_replies(results: Sequence[Any]) -> list[bytes]:
    """The raw replies a :func:`queue_reads` round took, in the order they were popped."""
    blocked, *popped = results
    raws = [blocked[1]] if blocked else []  # [key, reply], or None when the BLPOP timed out
    for some in popped:
        if some:
            raws += some
    return raws
