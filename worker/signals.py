"""Signal handlers that take no lock: what a signal asks for runs on a relay thread.

A Python signal handler runs in the main thread between two bytecodes, and
so possibly while that thread holds a lock. ``threading.Event.set()`` takes
the event's condition lock, which is not reentrant: a handler that calls it
while the main thread is inside ``set()`` or ``wait()`` of the same event
waits for itself forever. That happened: the kernel sends the parent-death
signal once per exiting thread of the parent, the second one landed while
the first handler was inside ``stop.set()``, and an orphaned worker served
on with a live heartbeat and its main thread stuck for good.

So a handler installed here only puts the signal on a
:class:`queue.SimpleQueue`, whose ``put`` is reentrant by design (safe in a
signal handler), and one daemon thread per process runs the action: it may
log, set events, or exit. Signals are handled one at a time, in the order
they came.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["on_signals"]

log = logging.getLogger(__name__)

Action = Callable[[int], None]

_relay: _Relay | None = None
_relay_lock = threading.Lock()


class _Relay:
    """The one thread that runs what the signals of this process ask for."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[Action, int]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="signal-relay", daemon=True).start()

    def _run(self) -> None:
        while True:
            action, signum = self.queue.get()
            try:
                action(signum)
            except Exception:  # the next signal must still be handled
                log.exception("handling %s failed", signal.Signals(signum).name)


def _the_relay() -> _Relay:
    global _relay
    with _relay_lock:  # taken at install time, never in a handler
        if _relay is None:
            _relay = _Relay()
        return _relay


def on_signals(signums: Iterable[int], action: Action) -> None:
    """Run ``action(signum)`` on the relay thread whenever one of ``signums`` arrives.

    Call it from the main thread (``signal.signal`` must be). The handler
    itself only queues the signal, so the main thread can be interrupted
    anywhere, inside a lock included, and a second signal can land while the
    first is being handled.
    """
    relay = _the_relay()

    def handle(signum: int, frame: Any) -> None:
        relay.queue.put((action, signum))

    for signum in signums:
        signal.signal(signum, handle)
