"""One reply reader per producer, shared by every call that waits on its inboxes.

A producer's ``infer``, ``map`` and ``imap`` calls, from any number of threads
(:class:`ReplyReader`, a daemon thread) or asyncio tasks
(:class:`AsyncReplyReader`, a task on the caller's loop), send requests whose
``reply_to`` is the producer's inbox and register their ids with the reader.
The reader pops the inbox in bulk (one BLPOP, then ``LPOP inbox 1000``) and
hands each reply to the call that waits for it
(:class:`~inferfleet.producer.waiting.Waiting`), so a process holds one
blocked connection however many calls wait, and no call takes another's
reply. While no single call waits the reader sends nothing.

A bulk call (``map``, ``imap``) reads for itself instead (:meth:`ReplyReader.read_for`):
its round's XADDs and the inbox's BLPOP and LPOPs go out as one round trip in
its own thread or task, and every reply that read pops is routed through the
same table, so it needs no hand-off and no second round trip a round.

If a read fails (Redis gone, the connection dropped) every waiting call ends
with :class:`~inferfleet.producer.errors.ConnectionError`: the replies that
read had popped are lost with it, so the message says what a caller can do.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from inferfleet.producer import defaults, errors
from inferfleet.producer.connections import translated
from inferfleet.producer.transport import Round, arun, raise_first_error, run
from inferfleet.producer.waiting import Sink, Waiting, popped_replies, queue_reads

__all__ = ["AsyncReplyReader", "ReadPlan", "ReplyReader", "lost_replies"]

#: a BLPOP timeout of 0 blocks for ever: the shortest wait a round asks for
_MIN_BLOCK_S = 0.001


def lost_replies(exc: BaseException) -> errors.InferfleetError:
    """What every waiting call raises when the reader's read failed with ``exc``."""
    sdk = translated(exc)
    if not isinstance(sdk, errors.ConnectionError):
        return sdk if isinstance(sdk, errors.InferfleetError) else errors.InferfleetError(str(exc))
    lost = errors.ConnectionError(
        f"{sdk}; the replies the producer's reader had just popped from its inbox are lost, "
        "and the requests still in flight may yet be computed: send again what you still "
        "need (with submit/result a reply waits in its own key until collected)"
    )
    lost.__cause__ = exc
    return lost


class ReadPlan:
    """Which inboxes a round reads: the blocking key(s) and how long to block."""

    def __init__(self, inboxes: Sequence[str], cluster: bool) -> None:
        self.inboxes = list(inboxes)
        self.cluster = cluster
        self._turn = 0

    def round(
        self, shards: list[int], most_s: float = defaults.WAIT_S, into: Round | None = None
    ) -> Round:
        """BLPOP every inbox (on a cluster, where one BLPOP spans one slot, the waiting shards'
        in turn, briefly), then LPOP each waiting shard's; the BLPOP blocks ``most_s`` at most.

        Queued after what ``into`` holds (a call's own writes: one round trip sends and reads).
        """
        round_ = into if into is not None else Round()
        if not self.cluster:
            block_s = min(defaults.WAIT_S, most_s)
            queue_reads(round_, self.inboxes, self.inboxes, block_s, shards)
            return round_
        self._turn += 1
        block = [self.inboxes[shards[self._turn % len(shards)]]]
        block_s = defaults.WAIT_S if len(shards) == 1 else defaults.POLL_S
        queue_reads(round_, self.inboxes, block, min(block_s, most_s), shards)
        return round_


def _split(results: list[Any], sent: int) -> tuple[list[Any], list[bytes]]:
    """(the replies to a round's first ``sent`` commands, the raw replies its reads popped);
    an error reply among the reads raises (it fails every waiting call)."""
    reads = results[sent:]
    raise_first_error(reads)
    return results[:sent], popped_replies(reads)


class _Reader:
    """What both readers hold: the routing table and the plan of their reads."""

    def __init__(self, client: Any, inboxes: Sequence[str], cluster: bool) -> None:
        self._client = client
        self._plan = ReadPlan(inboxes, cluster)
        self._waiting = Waiting(len(inboxes))
        self._closed = False

    @property
    def dropped(self) -> int:
        """Replies popped that no call waited for any more."""
        return self._waiting.dropped

    @property
    def waiting(self) -> int:
        """Replies some call still waits for."""
        return len(self._waiting)

    def _closed_error(self) -> errors.InferfleetError:
        return errors.InferfleetError("this producer was closed while the call waited")


class ReplyReader(_Reader):
    """The reader thread of a :class:`~inferfleet.producer.Producer`; started on first use."""

    def __init__(self, client: Any, inboxes: Sequence[str], cluster: bool) -> None:
        super().__init__(client, inboxes, cluster)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._served = 0  # single calls waiting: the thread reads only for them

    def expect(self, sink: Sink, rids: Sequence[str], shard: int, served: bool = True) -> None:
        """Hand the replies of ``rids`` to ``sink`` (a list of replies, or an exception);
        ``served=False``: the call reads for itself with :meth:`read_for`."""
        with self._cond:
            if self._closed:
                raise errors.InferfleetError("this producer is closed")
            self._waiting.add(sink, rids, shard)
            if not served:
                return
            self._served += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="inferfleet-replies", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def forget(self, rids: Iterable[str], served: bool = True) -> None:
        """Stop waiting for ``rids``: a reply that still comes is dropped."""
        with self._cond:
            self._waiting.discard(rids)
            self._served -= served

    def read_for(self, sending: Round | None, wait_s: float) -> list[Any]:
        """One read in the caller's thread, after ``sending`` in the same round trip: every reply
        it pops goes to its call's sink; returns the replies to ``sending`` (an error reply among
        them is raised)."""
        with self._cond:
            shards = self._waiting.shards()
        if not shards:
            return [] if sending is None else run(self._client, sending)
        writes = 0 if sending is None else sending.replies
        round_ = self._plan.round(shards, max(wait_s, _MIN_BLOCK_S), into=sending)
        return raise_first_error(self._read(round_, writes))

    def close(self) -> None:
        """Stop the thread (after its current read) and end every wait with an error."""
        with self._cond:
            self._closed = True
            sinks = self._waiting.clear()
            self._cond.notify()
        for sink in sinks:
            sink(self._closed_error())

    def _run(self) -> None:
        while True:
            with self._cond:
                # a single call's reply routed and its forget still to come: nothing to read
                while not (self._served and self._waiting) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                shards = self._waiting.shards()
            self._read(self._plan.round(shards), 0)

    def _read(self, round_: Round, writes: int) -> list[Any]:
        """Send ``round_``, hand what its reads popped to their calls; the replies to its first
        ``writes`` commands (none if it failed: every waiting call got the error)."""
        try:
            sent, raws = _split(run(self._client, round_, keep_errors=True), writes)
        except Exception as exc:  # noqa: BLE001 - handed to every waiting call
            self._fail(exc)
            return []
        with self._cond:
            routed = self._waiting.route(raws)
        for sink, replies in routed:
            sink(replies)
        return sent

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            sinks = self._waiting.clear()
        failure = lost_replies(exc)
        for sink in sinks:
            sink(failure)


class AsyncReplyReader(_Reader):
    """The reader task of an :class:`~inferfleet.producer.AsyncProducer`, on the callers' loop.

    Started by the first single call that waits; a call from another loop (the
    first one closed) starts a new task there.
    """

    def __init__(self, client: Any, inboxes: Sequence[str], cluster: bool) -> None:
        super().__init__(client, inboxes, cluster)
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._served = 0

    def expect(self, sink: Sink, rids: Sequence[str], shard: int, served: bool = True) -> None:
        """Hand the replies of ``rids`` to ``sink``; call from a coroutine on the callers' loop
        (``served=False``: the call reads for itself with :meth:`read_for`)."""
        if self._closed:
            raise errors.InferfleetError("this producer is closed")
        self._waiting.add(sink, rids, shard)
        if not served:
            return
        self._served += 1
        task = self._task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(self._wake))
        assert self._wake is not None
        self._wake.set()

    def forget(self, rids: Iterable[str], served: bool = True) -> None:
        """Stop waiting for ``rids``: a reply that still comes is dropped."""
        self._waiting.discard(rids)
        self._served -= served

    async def read_for(self, sending: Round | None, wait_s: float) -> list[Any]:
        """The twin of :meth:`ReplyReader.read_for`. The read runs as a task of its own behind
        :func:`asyncio.shield`: cancelling the caller never cancels a read whose replies
        may be other calls'."""
        shards = self._waiting.shards()
        if not shards:
            return [] if sending is None else await arun(self._client, sending)
        writes = 0 if sending is None else sending.replies
        round_ = self._plan.round(shards, max(wait_s, _MIN_BLOCK_S), into=sending)
        task = asyncio.get_running_loop().create_task(self._read(round_, writes))
        return raise_first_error(await asyncio.shield(task))

    async def aclose(self) -> None:
        """Cancel the task and end every wait with an error."""
        self._closed = True
        for sink in self._waiting.clear():
            sink(self._closed_error())
        task, self._task = self._task, None
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self, wake: asyncio.Event) -> None:
        while not self._closed:
            if not self._served or not self._waiting:
                wake.clear()
                await wake.wait()
                continue
            await self._read(self._plan.round(self._waiting.shards()), 0)

    async def _read(self, round_: Round, writes: int) -> list[Any]:
        """Send ``round_``, route what its reads popped; the replies to its first ``writes``."""
        try:
            sent, raws = _split(await arun(self._client, round_, keep_errors=True), writes)
        except Exception as exc:  # noqa: BLE001 - handed to every waiting call
            failure = lost_replies(exc)
            for sink in self._waiting.clear():
                sink(failure)
            return []
        for sink, replies in self._waiting.route(raws):
            sink(replies)
        return sent
