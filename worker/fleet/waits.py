"""How long requests will wait with a given fleet: the latency model of the ``target`` policy.

Pure functions of a :class:`Fleet` (what is measured now) and an option (how
many workers to run). Two effects set a request's wait, and the prediction
is the larger of the two plus one batch's service time:

* **The backlog, drained as a fluid.** ``backlog`` requests are queued now;
  ``ready`` workers serve ``capacity_rps`` each at once, the rest of the
  option's workers only after ``warm_s`` (a new worker loads and warms its
  model first). A request's wait is the time until everything ahead of it
  is served, so the longest wait is that of the request at the end of the
  backlog or of the one served just as the new workers become warm:
  :func:`backlog_wait_s` takes the larger.
* **Random arrivals at a steady rate.** Even a fleet that keeps up makes
  some requests wait, more the busier it is: the p99 wait of an M/M/c queue
  (Erlang's C formula, :func:`steady_p99_wait_s`) scaled by
  :data:`BATCH_FACTOR`, since a batch's time varies far less than M/M/c's
  exponential service assumes (the M/D/c wait is about half), and at least
  one batch's time whenever more than the tail would wait (a request that
  arrives as a batch starts waits for it to end).

A fleet that cannot keep up (arrivals at least its capacity) waits forever:
``math.inf``. The replayer (:mod:`inferfleet.worker.fleet.replay`) checks the
model against a simulated batching fleet; docs/benchmarks.md against a real one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Fleet",
    "predicted_p99_s",
    "backlog_wait_s",
    "steady_p99_wait_s",
    "erlang_c",
    "TAIL",
    "BATCH_FACTOR",
]

#: The tail the steady wait is predicted for.
TAIL = 0.01
#: The steady wait of batching workers as a fraction of M/M/c's: measured in the replayer
#: (tests/unit/test_waits.py holds the model within bounds of the simulated fleet).
BATCH_FACTOR = 0.6


@dataclass(frozen=True)
class Fleet:
    """What the prediction starts from. Rates per second, times in seconds."""

    arrivals_rps: float  # what comes in
    capacity_rps: float  # what one warm worker serves flat out (> 0)
    backlog: int  # queued or in flight now (lag + pending)
    ready: int  # workers serving now
    warm_s: float  # how long a new worker takes to serve
    service_s: float  # one batch's time: the least latency a request sees


def predicted_p99_s(fleet: Fleet, workers: int) -> float:
    """The p99 latency ``workers`` workers would give (math.inf if they cannot keep up)."""
    if workers <= 0:
        return 0.0 if fleet.arrivals_rps <= 0 and fleet.backlog <= 0 else math.inf
    wait_s = max(backlog_wait_s(fleet, workers), steady_p99_wait_s(fleet, workers))
    return fleet.service_s + wait_s


def backlog_wait_s(fleet: Fleet, workers: int) -> float:
    """The longest wait while the backlog drains, the new workers joining after ``warm_s``.

    Fewer workers than ``ready`` all serve at once (a drained worker finishes
    its batch first, which its capacity already counts).
    """
    now = min(fleet.ready, workers) * fleet.capacity_rps
    later = workers * fleet.capacity_rps
    arrivals = fleet.arrivals_rps
    if later <= arrivals:
        return math.inf if arrivals > 0 or fleet.backlog > 0 else 0.0
    warm_s = fleet.warm_s if workers > fleet.ready else 0.0
    served_by_warm = now * warm_s  # what the ready workers serve before the others join

    def wait(arrived_s: float) -> float:
        position = fleet.backlog + arrivals * arrived_s
        if position <= served_by_warm and now > 0:
            return position / now - arrived_s
        return warm_s + (position - served_by_warm) / later - arrived_s

    # wait() is piecewise linear: its largest value is at a = 0 or at the bend, where the
    # request arriving then is served just as the new workers become warm
    bend_s = (served_by_warm - fleet.backlog) / arrivals if arrivals > 0 else 0.0
    return max(0.0, wait(0.0), wait(min(max(bend_s, 0.0), warm_s)))


def steady_p99_wait_s(fleet: Fleet, workers: int) -> float:
    """The p99 queueing wait of ``workers`` servers at the arrival rate (M/M/c)."""
    spare = workers * fleet.capacity_rps - fleet.arrivals_rps
    if spare <= 0:
        return math.inf
    waits = erlang_c(workers, fleet.arrivals_rps / fleet.capacity_rps)
    if waits <= TAIL:
        return 0.0
    return max(fleet.service_s, BATCH_FACTOR * math.log(waits / TAIL) / spare)


def erlang_c(servers: int, offered: float) -> float:
    """The chance an arrival waits in an M/M/c queue: ``servers`` servers, ``offered`` erlangs.

    Computed from Erlang's B recursion, which stays finite for thousands of servers.
    """
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocked = 1.0
    for k in range(1, servers + 1):
        blocked = offered * blocked / (k + offered * blocked)
    busy = offered / servers
    return blocked / (1 - busy + busy * blocked)
