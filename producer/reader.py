"""One reply reader per producer, shared by every call that waits on its inboxes.

A producer's ``infer``, ``map`` and ``imap`` calls, from any number of threads
(:class:`ReplyReader`, whichever waiting call's thread holds the reader's role) or
asyncio tasks
(:class:`AsyncReplyReader`, a task on the caller's loop), send requests whose
``reply_to`` is the producer's inbox and register their ids with the reader.
The reader pops the inbox in bulk (one BLPOP, then ``LPOP inbox 1000``) and
hands each reply to the call that waits for it
(:class:`~inferfleet.producer.waiting.Waiting`), so a process holds one
blocked connection however many calls wait, and no call takes another's
reply. While nothing waits the reader sends nothing.

If a read fails (Redis gone, the connection dropped) every waiting call ends
with :class:`~inferfleet.producer.errors.ConnectionError`: the replies that
read had popped are lost with it, so the message says what a caller can do.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from queue import Empty, SimpleQueue
from typing import Any

from inferfleet.producer import defaults, errors
from inferfleet.producer.connections import translated
from inferfleet.producer.transport import Round, arun, run
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

    def round(self, shards: list[int], most_s: float = defaults.WAIT_S) -> Round:
        """BLPOP every inbox (on a cluster, where one BLPOP spans one slot, the waiting shards'
        in turn, briefly), then LPOP each waiting shard's; the BLPOP blocks ``most_s`` at most."""
        round_ = Round()
        if not self.cluster:
            block_s = min(defaults.WAIT_S, most_s)
            queue_reads(round_, self.inboxes, self.inboxes, block_s, shards)
            return round_
        self._turn += 1
        block = [self.inboxes[shards[self._turn % len(shards)]]]
        block_s = defaults.WAIT_S if len(shards) == 1 else defaults.POLL_S
        queue_reads(round_, self.inboxes, block, min(block_s, most_s), shards)
        return round_


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


class _Turn:
    """Put in a waiting call's box: nobody reads the inbox now; this call may."""


_TURN = _Turn()


class ReplyReader(_Reader):
    """The reply reader of a :class:`~inferfleet.producer.Producer`: a role, not a thread.

    A call waiting in :meth:`collect` while no other call reads becomes the
    reader: it pops the inbox in its own thread and routes every reply to its
    call, its own among them. When its own replies are in (or its time is
    up) it hands the role to the longest-waiting call still in
    :meth:`collect`, by putting a turn in that call's box. A lone call (one
    ``map``) so reads its replies itself, with no thread hand-off; many
    threads' calls share one blocked read at a time.
    """

    def __init__(self, client: Any, inboxes: Sequence[str], cluster: bool) -> None:
        super().__init__(client, inboxes, cluster)
        self._lock = threading.Lock()
        self._reading = False
        self._followers: deque[SimpleQueue] = deque()

    def expect(self, sink: Sink, rids: Sequence[str], shard: int) -> None:
        """Hand the replies of ``rids`` to ``sink`` (a list of replies, or an exception)."""
        with self._lock:
            if self._closed:
                raise errors.InferfleetError("this producer is closed")
            self._waiting.add(sink, rids, shard)

    def forget(self, rids: Iterable[str]) -> None:
        """Stop waiting for ``rids``: a reply that still comes is dropped."""
        with self._lock:
            self._waiting.discard(rids)

    def close(self) -> None:
        """End every wait with an error (a call reading now stops after its current read)."""
        with self._lock:
            self._closed = True
            sinks = self._waiting.clear()
        for sink in sinks:
            sink(self._closed_error())

    def collect(self, box: SimpleQueue, wait_s: float) -> list[Any]:
        """What was put in ``box`` (lists of replies, or an exception), after waiting up to
        ``wait_s`` for the first; this call reads the inbox while no other call does."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                lead = box.empty() and not self._reading and not self._closed
                if lead:
                    self._reading = True
                elif box.empty():
                    self._followers.append(box)
            if lead:
                awaited = self._lead(box, deadline)
                items = _taken(box, 0.0)
            else:
                awaited = True
                items = _taken(box, deadline - time.monotonic())
                with self._lock:
                    if box in self._followers:
                        self._followers.remove(box)
                items += _taken(box, 0.0)  # a turn or replies put there as it stopped following
            got = [item for item in items if item is not _TURN]
            if got or not awaited or time.monotonic() >= deadline:
                if len(got) < len(items):  # a turn this call will not use: pass it on
                    with self._lock:
                        self._pass_turn()
                return got

    def _lead(self, box: SimpleQueue, deadline: float) -> bool:
        """Read rounds for every waiting call until ``box`` has something or time is up;
        False if no call waits for anything (nothing to read)."""
        try:
            while box.empty() and not self._closed:
                left = deadline - time.monotonic()
                with self._lock:
                    shards = self._waiting.shards()
                if not shards:
                    return False
                if left <= 0:
                    return True
                round_ = self._plan.round(shards, max(left, _MIN_BLOCK_S))
                try:
                    raws = popped_replies(run(self._client, round_))
                except Exception as exc:  # noqa: BLE001 - handed to every waiting call
                    self._fail(exc)
                    return True
                with self._lock:
                    routed = self._waiting.route(raws)
                for sink, replies in routed:
                    sink(replies)
            return True
        finally:
            with self._lock:
                self._reading = False
                self._pass_turn()

    def _pass_turn(self) -> None:
        """With the lock held: wake the longest-waiting follower to read, if nobody does."""
        if not self._reading and self._followers:
            self._followers.popleft().put(_TURN)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            sinks = self._waiting.clear()
        failure = lost_replies(exc)
        for sink in sinks:
            sink(failure)


def _taken(box: SimpleQueue, wait_s: float) -> list[Any]:
    """Everything in ``box``, after waiting up to ``wait_s`` for the first item."""
    try:
        items = [box.get(timeout=wait_s) if wait_s > 0 else box.get_nowait()]
    except Empty:
        return []
    while not box.empty():
        items.append(box.get_nowait())
    return items


class AsyncReplyReader(_Reader):
    """The reader task of an :class:`~inferfleet.producer.AsyncProducer`, on the callers' loop.

    Started by the first call that waits; a call from another loop (the first
    one closed) starts a new task there.
    """

    def __init__(self, client: Any, inboxes: Sequence[str], cluster: bool) -> None:
        super().__init__(client, inboxes, cluster)
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    def expect(self, sink: Sink, rids: Sequence[str], shard: int) -> None:
        """Hand the replies of ``rids`` to ``sink``; call from a coroutine on the callers' loop."""
        if self._closed:
            raise errors.InferfleetError("this producer is closed")
        self._waiting.add(sink, rids, shard)
        task = self._task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(self._wake))
        assert self._wake is not None
        self._wake.set()

    def forget(self, rids: Iterable[str]) -> None:
        """Stop waiting for ``rids``: a reply that still comes is dropped."""
        self._waiting.discard(rids)

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
            if not self._waiting:
                wake.clear()
                await wake.wait()
                continue
            try:
                raws = popped_replies(
                    await arun(self._client, self._plan.round(self._waiting.shards()))
                )
            except Exception as exc:  # noqa: BLE001 - handed to every waiting call
                failure = lost_replies(exc)
                for sink in self._waiting.clear():
                    sink(failure)
                continue
            for sink, replies in self._waiting.route(raws):
                sink(replies)
