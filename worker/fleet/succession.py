"""One supervisor per queue per host, and what a dead supervisor leaves behind.

A supervisor SIGKILLed (not its process group) and started again must not
double the fleet. Three things see to it:

* **Workers follow their supervisor.** A supervised worker asks the kernel
  for a signal when its parent dies (``PR_SET_PDEATHSIG`` on Linux) and also
  checks its parent's pid every second (:func:`watch_parent`): either way it
  drains (finishes its batch, replies, acknowledges, leaves the group) and
  exits.
* **Names are unique per incarnation.** Each supervisor draws a token and
  names its slots ``NAME-sN-TOKEN``: two supervisors, on one host or two,
  never share a consumer name, so they never overwrite each other's
  heartbeat or replay each other's in-flight entries.
* **A lease per queue and host.** ``PREFIX:{NAME}:supervisor:lease:HOST``
  (a hash: token, pid, with a TTL renewed every tick) is held by one
  supervisor of the queue on the host. A second one started while the
  holder lives is refused with an error naming its pid; one started after
  the holder died (its pid is gone) takes the lease over at once.

What a dead predecessor left is adopted or cleaned up when the lease is
taken: its workers still running on this host (a live heartbeat of a slot
name with another token, and a pid still alive) are asked to drain and
waited for, killed after the drain timeout, before any new worker starts;
entries pending on its consumers are taken over by the new workers like any
dead consumer's (:mod:`inferfleet.worker.serving.recovery`), and its
consumers, once they hold nothing and have no heartbeat, are deleted from
the group (:func:`prune_consumers`, atomic: never one holding an entry).

The lease and the pruning use only commands the documented ``worker`` ACL
user has (HGETALL, HSET, PEXPIRE, DEL, XPENDING, XGROUP DELCONSUMER in Lua).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.worker.connections import script
from inferfleet.worker.errors import ConfigError
from inferfleet.worker.heartbeat import HeartbeatInfo
from inferfleet.worker.keys import supervisor_lease_key
from inferfleet.worker.signals import on_signals

__all__ = [
    "LeaseHeld",
    "SupervisorLease",
    "Predecessor",
    "incarnation_token",
    "slot_consumer",
    "is_slot_of",
    "predecessor_workers",
    "prune_consumers",
    "pid_alive",
    "watch_parent",
]

log = logging.getLogger(__name__)

#: Linux prctl option: the signal this process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def incarnation_token() -> str:
    """A fresh token for one supervisor's lifetime (6 hex digits)."""
    return secrets.token_hex(3)


def slot_consumer(name: str, index: int, token: str) -> str:
    """The consumer name of slot ``index`` of the supervisor with ``token``: ``NAME-sN-TOKEN``."""
    return f"{name}-s{index}-{token}"


def is_slot_of(consumer: str, name: str) -> bool:
    """Whether ``consumer`` is a supervisor's slot of queue ``name`` (any incarnation, or an unnamed
    older one)."""
    return re.fullmatch(rf"{re.escape(name)}-s\d+(-[0-9a-f]{{6}})?", consumer) is not None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (ours to signal or not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LeaseHeld(ConfigError):
    """Another live supervisor manages this queue on this host."""


@dataclass(frozen=True)
class Predecessor:
    """A worker of a dead supervisor still running on this host."""

    consumer: str
    pid: int


def predecessor_workers(
    beats: Iterable[HeartbeatInfo], name: str, host: str, token: str, own_pids: Sequence[int] = ()
) -> list[Predecessor]:
    """The live heartbeats of this queue's slot workers on ``host`` that are not ours (pure)."""
    return [
        Predecessor(b.consumer, b.pid)
        for b in beats
        if b.host == host
        and is_slot_of(b.consumer, name)
        and not b.consumer.endswith(f"-{token}")
        and b.pid not in own_pids
        and b.pid != os.getpid()
    ]


class SupervisorLease:
    """This supervisor's hold on its queue on this host (see the module docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        token: str,
        ttl_s: float,
        host: str | None = None,
    ) -> None:
        self.redis = client
        self.host = host or socket.gethostname()
        self.key = supervisor_lease_key(keys, self.host)
        self.queue = keys.name
        self.token = token
        self.ttl_ms = int(ttl_s * 1000)

    def acquire(self) -> None:
        """Take the lease, from a dead holder too; raise :class:`LeaseHeld` if a live one has it."""
        ok, holder, pid = self._try("")
        if ok:
            return
        if pid_alive(pid):
            raise LeaseHeld(
                f"another supervisor (pid {pid}) already manages queue {self.queue} on "
                f"host {self.host}; stop it first, or run this one on another host"
            )
        log.warning(
            "the previous supervisor of this queue on %s (pid %s) is gone: taking over its lease",
            self.host,
            pid,
        )
        ok, _, pid = self._try(holder)
        if not ok:
            raise LeaseHeld(f"another supervisor (pid {pid}) took the lease of {self.key} first")

    def renew(self) -> bool:
        """Extend the lease (re-taking it if Redis lost it); False if another supervisor holds it
        now."""
        return self._try("")[0]

    def release(self) -> None:
        """Give the lease up (only if it is still ours)."""
        script(self.redis, "lease_release")(keys=[self.key], args=[self.token])

    def _try(self, replaceable: str) -> tuple[bool, str, int]:
        ok, holder, pid = script(
            self.redis, "lease_acquire"
        )(  # registered on use: built without touching Redis
            keys=[self.key], args=[self.token, os.getpid(), self.ttl_ms, self.host, replaceable]
        )
        text = holder.decode() if isinstance(holder, bytes) else str(holder)
        return bool(int(ok)), text, int(pid or 0)


def prune_consumers(
    client: redis.Redis, keys: QueueKeys, name: str, live: set[str], min_idle_ms: int
) -> list[str]:
    """Delete this queue's slot consumers that have no heartbeat, hold nothing and were idle
    ``min_idle_ms``: what SIGKILLed workers and supervisors leave in the group."""
    try:
        consumers = client.xinfo_consumers(keys.requests, GROUP)
    except redis.exceptions.ResponseError:  # no stream or group yet
        return []
    prune = script(client, "prune_consumer")
    gone = []
    for row in consumers:
        consumer = row["name"].decode() if isinstance(row["name"], bytes) else str(row["name"])
        if (
            consumer not in live
            and is_slot_of(consumer, name)
            and int(row["pending"]) == 0
            and int(row["idle"]) >= min_idle_ms
            and int(prune(keys=[keys.requests], args=[GROUP, consumer])) >= 0
        ):
            gone.append(consumer)
    return gone


def watch_parent(stop: threading.Event, interval_s: float = 1.0) -> None:
    """In a supervised worker: set ``stop`` (drain, then exit) when the supervisor dies.

    Linux signals it at once (``PR_SET_PDEATHSIG`` with SIGUSR1, whose handler
    only sets ``stop``: the kernel may send it more than once, as each thread of
    a dying parent exits, and a second SIGTERM would kill without draining);
    everywhere a daemon thread also compares the parent's pid every
    ``interval_s``, which covers a parent that died before the request.
    Call it from the main thread (it installs a signal handler).
    """
    parent = multiprocessing.parent_process()
    parent_pid = parent.pid if parent is not None else os.getppid()

    def orphaned(
        *_: object,
    ) -> None:  # on the relay thread or the check thread, never in a signal handler
        if not stop.is_set():
            log.warning("the supervisor (pid %s) is gone: draining and exiting", parent_pid)
        stop.set()

    if sys.platform.startswith("linux"):
        try:
            import ctypes

            on_signals((signal.SIGUSR1,), orphaned)
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1, 0, 0, 0)
        except (OSError, AttributeError) as exc:  # no libc prctl: the pid check alone
            log.warning(
                "cannot ask for a parent-death signal (%s): checking the supervisor's pid instead",
                exc,
            )

    def check() -> None:
        while not stop.wait(interval_s):
            if os.getppid() != parent_pid:
                orphaned()
                return

    threading.Thread(target=check, name="parent-watch", daemon=True).start()
