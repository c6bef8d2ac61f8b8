"""Concurrent callers' writes sent together: one round trip for what arrives at once.

A web service calls ``infer`` from many threads or tasks at once; each call's
XADD on its own round trip costs redis-py's per-command work and a system
call on both sides. Here the writes that arrive while one round is out go
out together as the next (group commit, as databases flush their logs):

- :class:`WriteBatcher` (threads): the first caller to find no round in
  flight sends every pending write, hands each its own reply, then passes the
  lead to the first write that arrived meanwhile (if any) and returns.
- :class:`AsyncWriteBatcher` (asyncio): the first write of a loop tick
  schedules a flush; every write queued before it runs goes in its round.

Each write gets its own reply or error: one refused XADD does not fail the
others of its round. Nothing waits for a timer, so a lone caller pays no
added latency.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis import exceptions as redis_errors

from inferfleet.producer.transport import Round

__all__ = ["AsyncWriteBatcher", "WriteBatcher"]

#: Send one round of commands; one reply (or error instance) a command, in order.
Send = Callable[[Round], list[Any]]


#: A write whose round was interrupted (KeyboardInterrupt, a cancelled flush): it may have gone out.
_INTERRUPTED = redis_errors.ConnectionError("interrupted: the write may or may not have been sent")


def _round_of(commands: Sequence[Sequence[Any]]) -> Round:
    round_ = Round()
    for args in commands:
        round_.command(args)
    return round_


def _outcomes(send: Send, commands: list[Sequence[Any]]) -> list[Any]:
    """One reply or exception a command; a failure of the whole round is every command's."""
    try:
        return send(_round_of(commands))
    except Exception as exc:  # noqa: BLE001 - each caller raises it in its own frame
        return [exc] * len(commands)


class _Write:
    __slots__ = ("args", "done", "lead", "outcome")

    def __init__(self, args: Sequence[Any]) -> None:
        self.args = args
        self.done = threading.Lock()
        self.done.acquire()  # released once the outcome is in, or the lead passes here
        self.outcome: Any = None
        self.lead = False


class WriteBatcher:
    """Group commit for threads: :meth:`write` sends a command, batched with concurrent ones."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._pending: list[_Write] = []
        self._busy = False
        #: rounds sent, and commands in them (a write-batching figure for benchmarks)
        self.rounds = 0
        self.commands = 0

    def write(self, args: Sequence[Any]) -> Any:
        """Send ``args``; return its reply, or raise its error reply (a redis-py exception)."""
        mine = _Write(args)
        with self._lock:
            self._pending.append(mine)
            lead = not self._busy
            self._busy = True
        if not lead:
            mine.done.acquire()
            lead = mine.lead
        if lead:
            self._flush()
        if isinstance(mine.outcome, Exception):
            raise mine.outcome
        return mine.outcome

    def _flush(self) -> None:
        """Send every pending write (the leader's among them), then pass the lead on."""
        with self._lock:
            batch, self._pending = self._pending, []
        outcomes: list[Any] = [_INTERRUPTED] * len(batch)
        try:
            outcomes = _outcomes(self._send, [one.args for one in batch])
        finally:  # even when interrupted, no follower is left waiting
            self.rounds += 1
            self.commands += len(batch)
            for one, outcome in zip(batch, outcomes):
                one.outcome = outcome
                if not one.lead:
                    one.done.release()
            self._pass_lead()

    def _pass_lead(self) -> None:
        with self._lock:
            if self._pending:
                follower = self._pending[0]
                follower.lead = True
                follower.done.release()
            else:
                self._busy = False


class AsyncWriteBatcher:
    """Group commit for one event loop: every write of a loop tick is one round trip."""

    def __init__(self, send: Callable[[Round], Awaitable[list[Any]]]) -> None:
        self._send = send
        self._pending: list[tuple[Sequence[Any], asyncio.Future]] = []
        self.rounds = 0
        self.commands = 0

    async def write(self, args: Sequence[Any]) -> Any:
        """Send ``args``; return its reply, or raise its error reply.

        Cancelling the caller does not take the write back: it is sent with its round.
        """
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if not self._pending:
            loop.call_soon(self._start_flush, loop)
        self._pending.append((args, done))
        return await done

    def _start_flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        loop.create_task(self._flush(batch))

    async def _flush(self, batch: list[tuple[Sequence[Any], asyncio.Future]]) -> None:
        outcomes: list[Any] = [_INTERRUPTED] * len(batch)
        try:
            outcomes = await self._send(_round_of([args for args, _ in batch]))
        except Exception as exc:  # noqa: BLE001 - each caller raises it in its own frame
            outcomes = [exc] * len(batch)
        finally:  # cancelled too (the loop closing): no caller is left waiting
            self._settle(batch, outcomes)

    def _settle(self, batch: list[tuple[Sequence[Any], asyncio.Future]], outcomes: list) -> None:
        self.rounds += 1
        self.commands += len(batch)
        for (_, done), outcome in zip(batch, outcomes):
            if done.done():  # its caller was cancelled
                continue
            if isinstance(outcome, Exception):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)
