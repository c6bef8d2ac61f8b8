"""A fast-path round's reply call, sent behind the next read so that Redis runs it while the worker
computes.

A Columns round is answered by one EVALSHA of the reply script
(:mod:`~inferfleet.worker.serving.replies`). Sent and waited for at the end of
the round, the worker sits idle while Redis runs the script, then again while
Redis runs the next XREADGROUP. :class:`BehindRead` holds the call instead and
sends it in the same write as the next read, after it: Redis answers the read
first, the worker computes those entries while Redis runs the script, and the
script's answer is read before the next reply call (:meth:`BehindRead.settle`).
One round trip a round instead of two (issue 12's throughput; the figures are in
docs/benchmarks.md).

Nothing waits on it for long: a read that finds nothing settles the call before
the worker blocks for new entries, and so do every other reply write, a replay
of the consumer's own pending entries and stopping. The guarantees are the
script's: a call lost with its connection leaves its entries pending on this
consumer, and the replay (or, after a crash, another worker) answers them
exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from inferfleet.worker.resp import drop_held, read_answer, send_held

__all__ = ["BehindRead"]

#: What a held call does with the script's answer (as Redis gave it).
Done = Callable[[Any], None]


@dataclass
class _Held:
    packed: bytes  # the EVALSHA, as RESP
    done: Done
    conn: Any = None  # the connection it went out on, its answer not read yet


class BehindRead:
    """Holds at most one packed reply-script call until the next read, or until :meth:`settle`.

    ``send`` sends a packed call and returns its answer (the writer's own way);
    ``load`` loads the script again after NOSCRIPT.
    """

    def __init__(
        self, client: redis.Redis, send: Callable[[bytes], Any], load: Callable[[], None]
    ) -> None:
        self.pool = client.connection_pool
        self._send = send
        self._load = load
        self._held: _Held | None = None

    @property
    def unsent(self) -> bool:
        """Whether a call waits to go out with the next read."""
        return self._held is not None and self._held.conn is None

    def hold(self, packed: bytes, done: Done) -> None:
        """Keep ``packed`` for the next read (settling the call held before it)."""
        self.settle()
        self._held = _Held(packed, done)

    def send_with(self, before: bytes, answers: int) -> list[Any]:
        """Send ``before`` (commands that answer ``answers`` times), then the held call, in one
        write.

        Returns the answers to ``before``; the call's own answer is read by
        :meth:`settle`. On any error the connection is closed and the call
        forgotten: if it reached Redis it ran whole, else its entries are still
        pending on this consumer (the replay answers them).
        """
        held = self._held
        assert held is not None and held.conn is None, "send_with needs an unsent call"
        try:
            held.conn, out = send_held(self.pool, before, held.packed, answers)
        except BaseException:
            self._held = None
            raise
        return out

    def settle(self) -> None:
        """Send the held call if it has not gone out, read its answer and report it to its
        ``done``."""
        held, self._held = self._held, None
        if held is None:
            return
        held.done(self._send(held.packed) if held.conn is None else self._read(held))

    def _read(self, held: _Held) -> Any:
        assert held.conn is not None
        try:
            return read_answer(self.pool, held.conn)
        except redis.exceptions.NoScriptError:
            self._load()  # Redis restarted or flushed its scripts: nothing ran, send it again
            return self._send(held.packed)

    def drop(self) -> None:
        """Forget the held call (after a lost connection: its entries come back in the replay)."""
        held, self._held = self._held, None
        if held is not None and held.conn is not None:
            drop_held(self.pool, held.conn)
