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
from inferfleet.producer.transport import Round, arun, raise_first_error, run
from inferfleet.producer.waiting import Sink, Waiting, popped_replies, queue_reads

__all__ = ["AsyncBox", "AsyncReplyReader", "ReadPlan", "ReplyReader", "lost_replies"]

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

    def collect(self, box: SimpleQueue, wait_s: float, sending: Round | None = None) -> list[Any]:
        """What was put in ``box`` (lists of replies, or an exception), after waiting up to
        ``wait_s`` for the first; this call reads the inbox while no other call does.

        ``sending`` (this call's writes) goes out first: in the same round trip as
        the first read where this call reads, else on its own. An error reply to
        one of its commands is raised once the read's replies are handed out.
        """
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                lead = box.empty() and not self._reading and not self._closed
                if lead:
                    self._reading = True
                elif box.empty():
                    self._followers.append(box)
            if lead:
                awaited, sent = self._lead(box, deadline, sending)
                items = _taken(box, 0.0)
            else:
                sent = run(self._client, sending) if sending is not None else []
                awaited = True
                items = _taken(box, deadline - time.monotonic())
                with self._lock:
                    if box in self._followers:
                        self._followers.remove(box)
                items += _taken(box, 0.0)  # a turn or replies put there as it stopped following
            if sending is not None:
                sending = None
                raise_first_error(sent)
            got = [item for item in items if item is not _TURN]
            if got or not awaited or time.monotonic() >= deadline:
                if len(got) < len(items):  # a turn this call will not use: pass it on
                    with self._lock:
                        self._pass_turn()
                return got

    def _lead(
        self, box: SimpleQueue, deadline: float, sending: Round | None
    ) -> tuple[bool, list[Any]]:
        """Read rounds for every waiting call until ``box`` has something or time is up, the
        first one after ``sending``; (False if no call waits for anything, the replies to
        ``sending``)."""
        sent: list[Any] = []
        awaited = True
        try:
            while box.empty() and not self._closed:
                with self._lock:
                    shards = self._waiting.shards()
                left = deadline - time.monotonic()
                if not shards or left <= 0:
                    awaited = bool(shards)
                    break
                writes = 0 if sending is None else sending.replies
                round_ = self._plan.round(shards, max(left, _MIN_BLOCK_S), into=sending)
                sending = None
                try:
                    sent, raws = _split(run(self._client, round_, keep_errors=True), writes)
                except Exception as exc:  # noqa: BLE001 - handed to every waiting call
                    self._fail(exc)
                    break
                with self._lock:
                    routed = self._waiting.route(raws)
                for sink, replies in routed:
                    sink(replies)
        finally:
            with self._lock:
                self._reading = False
                self._pass_turn()
        if sending is not None:  # no read went out (nothing awaited, or closed): send alone
            sent = run(self._client, sending)
        return awaited, sent

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


class AsyncBox:
    """What an async call is handed by the reader: lists of replies, an error, or a turn."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:
        """The sink: keep ``item`` and wake the call if it waits."""
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> list[Any]:
        """Everything put here so far."""
        items, self.items = self.items, []
        return items

    async def wait(self, wait_s: float) -> None:
        """Until something is put here, ``wait_s`` at most (no task, no Queue: one future)."""
        if self.items or wait_s <= 0:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(wait_s, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _settle(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class AsyncReplyReader(_Reader):
    """The reply reader of an :class:`~inferfleet.producer.AsyncProducer`: a role, as in
    :class:`ReplyReader`, passed between the tasks waiting in :meth:`collect`.

    The reading call's round runs as a task of its own, awaited through
    :func:`asyncio.shield`: cancelling the call that reads never cancels a read,
    so the replies it pops still reach their calls, and the role passes on when
    the read ends.
    """

    def __init__(self, client: Any, inboxes: Sequence[str], cluster: bool) -> None:
        super().__init__(client, inboxes, cluster)
        self._round: asyncio.Task | None = None
        self._followers: deque[AsyncBox] = deque()

    def expect(self, sink: Sink, rids: Sequence[str], shard: int) -> None:
        """Hand the replies of ``rids`` to ``sink``; call from a coroutine on the callers' loop."""
        if self._closed:
            raise errors.InferfleetError("this producer is closed")
        self._waiting.add(sink, rids, shard)

    def forget(self, rids: Iterable[str]) -> None:
        """Stop waiting for ``rids``: a reply that still comes is dropped."""
        self._waiting.discard(rids)

    async def aclose(self) -> None:
        """End every wait with an error, and the read in flight (on this loop)."""
        self._closed = True
        for sink in self._waiting.clear():
            sink(self._closed_error())
        task, self._round = self._round, None
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def collect(self, box: AsyncBox, wait_s: float, sending: Round | None = None) -> list:
        """What was put in ``box`` after waiting up to ``wait_s`` for the first (see
        :meth:`ReplyReader.collect`; ``sending`` goes out with this call's first read)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        try:
            while True:
                if not box.items and not self._reading() and not self._closed:
                    awaited, sent = await self._lead(deadline, sending)
                elif sending is not None:
                    awaited, sent = True, await arun(self._client, sending)
                else:
                    awaited, sent = True, []
                    await self._follow(box, deadline - loop.time())
                if sending is not None:
                    sending = None
                    raise_first_error(sent)
                got = [item for item in box.take() if item is not _TURN]
                if got or not awaited or loop.time() >= deadline:
                    return got
        finally:
            self._pass_turn()

    async def _lead(self, deadline: float, sending: Round | None) -> tuple[bool, list[Any]]:
        """One read round (after ``sending``) for every waiting call; (False if no call waits for
        anything, the replies to ``sending``)."""
        shards = self._waiting.shards()
        left = deadline - asyncio.get_running_loop().time()
        if not shards or left <= 0:
            return bool(shards), [] if sending is None else await arun(self._client, sending)
        writes = 0 if sending is None else sending.replies
        round_ = self._plan.round(shards, max(left, _MIN_BLOCK_S), into=sending)
        task = self._round = asyncio.get_running_loop().create_task(self._read(round_, writes))
        try:
            sent = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._read_ended)  # the role passes on once the read is done
            raise
        if self._round is task:  # (a follower woken meanwhile may have started the next read)
            self._round = None
        return True, sent

    async def _read(self, round_: Round, writes: int) -> list[Any]:
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

    async def _follow(self, box: AsyncBox, wait_s: float) -> None:
        self._followers.append(box)
        try:
            await box.wait(wait_s)
        finally:
            if box in self._followers:
                self._followers.remove(box)

    def _reading(self) -> bool:
        """Whether a read is in flight on this loop (a task of a closed loop never ends)."""
        task = self._round
        return (
            task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop()
        )

    def _read_ended(self, task: asyncio.Task) -> None:
        if self._round is task:
            self._round = None
        self._pass_turn()

    def _pass_turn(self) -> None:
        """Wake the longest-waiting follower to read, if nobody does."""
        if not self._reading() and self._followers and not self._closed:
            self._followers.popleft().put(_TURN)
