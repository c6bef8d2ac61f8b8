"""The scaling replayer: any policy against an arrival trace and a batching fleet, simulated.

:func:`replay` runs :func:`~inferfleet.worker.fleet.scaling.desired_workers`
every ``interval_s`` as the supervisor does, on what a simulated fleet shows
(lag, pending, throughput, per-worker capacity, warm-up, batch time), and
applies each decision to that fleet: a new worker serves ``warm_s`` after it
was asked for; a worker asked to stop finishes its batch first. Workers
serve FIFO in dynamic batches: a free worker takes up to ``max_rows`` of
what has arrived, and the batch takes ``batch_s + rows * row_s``.

It reports what users pay for and promise: worker-seconds (from start,
warm-up included, to stop), each request's latency (arrival to its batch's
end), and the scale events. Pure: no clock, no Redis, the same inputs the
same result.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from inferfleet.worker.fleet.scaling import desired_workers
from inferfleet.worker.fleet.scaling_data import Observation, PolicySettings, PolicyState

__all__ = ["ServiceModel", "Tick", "ReplayResult", "replay"]

#: How long after the trace's end the replayer keeps deciding, for the backlog to drain.
DRAIN_LIMIT_S = 600.0


@dataclass(frozen=True)
class ServiceModel:
    """How the simulated workers serve: per batch, per row, batch rows, warm-up."""

    batch_s: float = 0.05
    row_s: float = 0.0
    max_rows: int = 4
    warm_s: float = 5.0

    def __post_init__(self) -> None:
        if not (self.batch_s >= 0 and self.row_s >= 0 and self.batch_s + self.row_s > 0):
            raise ValueError("batch_s and row_s must be >= 0, one of them > 0")
        if self.max_rows < 1 or self.warm_s < 0:
            raise ValueError("max_rows must be >= 1 and warm_s >= 0")

    def batch_time(self, rows: int) -> float:
        """Seconds one batch of ``rows`` takes."""
        return self.batch_s + rows * self.row_s

    @property
    def capacity_rps(self) -> float:
        """What one worker serves flat out (full batches)."""
        return self.max_rows / self.batch_time(self.max_rows)


@dataclass(frozen=True)
class Tick:
    """One decision: when, the fleet asked for before it and by it, the backlog, why."""

    now_s: float
    workers: int
    ready: int
    decided: int
    backlog: int
    reason: str


@dataclass
class ReplayResult:
    """What one replay measured. ``latencies_s[i]`` is request i's, in arrival order."""

    arrivals_s: np.ndarray
    latencies_s: np.ndarray
    worker_s: float
    ticks: list[Tick]

    @property
    def scale_events(self) -> int:
        """Decisions that changed the fleet's size."""
        return sum(1 for t in self.ticks if t.decided != t.workers)

    def summary(self, target_s: float) -> dict[str, float]:
        """Worker-seconds, p50/p99 latency (ms), share of requests over ``target_s``, events."""
        lat = self.latencies_s
        return {
            "requests": float(len(lat)),
            "worker_s": round(self.worker_s, 1),
            "p50_ms": round(float(np.percentile(lat, 50)) * 1000, 1) if len(lat) else 0.0,
            "p99_ms": round(float(np.percentile(lat, 99)) * 1000, 1) if len(lat) else 0.0,
            "over_target": float(np.mean(lat > target_s)) if len(lat) else 0.0,
            "scale_events": float(self.scale_events),
            "max_workers": float(max((t.decided for t in self.ticks), default=0)),
        }


@dataclass
class _Worker:
    started_s: float
    ready_s: float
    busy_until: float = 0.0
    batch_rows: int = 0
    stopped_s: float | None = None
    leaving: bool = False
    # this interval's work, for the heartbeat-like measurements
    busy_s: float = 0.0
    rows: int = 0
    batches: int = 0


@dataclass
class _Fleet:
    times: np.ndarray
    service: ServiceModel
    interval_s: float
    latencies: np.ndarray = field(init=False)
    head: int = 0
    workers: list[_Worker] = field(default_factory=list)
    heap: list[tuple[float, int]] = field(default_factory=list)
    done: dict[int, int] = field(default_factory=dict)  # completions per interval index

    def __post_init__(self) -> None:
        self.latencies = np.full(len(self.times), math.nan)

    def start(self, now_s: float, warm_s: float) -> None:
        self.workers.append(_Worker(now_s, now_s + warm_s))
        heapq.heappush(self.heap, (now_s + warm_s, len(self.workers) - 1))

    def wanted(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w.stopped_s is None and not w.leaving]

    def run_until(self, until_s: float) -> None:
        """Serve every batch that starts by ``until_s``."""
        while self.heap and self.heap[0][0] <= until_s:
            now_s, index = heapq.heappop(self.heap)
            worker = self.workers[index]
            if worker.stopped_s is not None:
                continue
            if worker.leaving:
                worker.stopped_s = now_s
                continue
            self._serve(worker, index, now_s)

    def _serve(self, worker: _Worker, index: int, now_s: float) -> None:
        arrived = int(np.searchsorted(self.times, now_s, side="right"))
        rows = min(self.service.max_rows, arrived - self.head)
        if rows <= 0:  # idle: take the next arrival when it comes
            if self.head < len(self.times):
                heapq.heappush(self.heap, (float(self.times[self.head]), index))
            return
        end_s = now_s + self.service.batch_time(rows)
        first = self.head
        self.latencies[first : first + rows] = end_s - self.times[first : first + rows]
        self.head += rows
        worker.busy_until, worker.batch_rows = end_s, rows
        worker.busy_s += end_s - now_s
        worker.rows += rows
        worker.batches += 1
        slot = int(end_s // self.interval_s)
        self.done[slot] = self.done.get(slot, 0) + rows
        heapq.heappush(self.heap, (end_s, index))

    def observe(self, now_s: float) -> Observation:
        """What the supervisor would read now; the interval's work counters start again."""
        wanted = [self.workers[i] for i in self.wanted()]
        serving = [w for w in wanted if w.ready_s <= now_s]
        capacities = [w.rows / w.busy_s for w in serving if w.busy_s >= 0.05 * self.interval_s]
        batch_times = [w.busy_s / w.batches for w in serving if w.batches]
        batch_rows = [w.rows / w.batches for w in serving if w.batches]
        pending = sum(w.batch_rows for w in self.workers if w.busy_until > now_s)
        completed = self.done.pop(int(now_s // self.interval_s) - 1, 0)
        for worker in self.workers:
            worker.busy_s, worker.rows, worker.batches = 0.0, 0, 0
        return Observation(
            now_s=now_s,
            workers=len(wanted),
            lag=int(np.searchsorted(self.times, now_s, side="right")) - self.head,
            pending=pending,
            rate_rps=completed / self.interval_s,
            capacity_rps=_median(capacities),
            ready=len(serving),
            warm_s=self.service.warm_s if serving else None,
            service_s=_median(batch_times),
            batch_rows=_median(batch_rows),
            max_rows=self.service.max_rows,
        )

    def resize(self, workers: int, now_s: float) -> None:
        """Start or stop workers (the newest first, as the supervisor does) to ``workers``."""
        wanted = self.wanted()
        for _ in range(workers - len(wanted)):
            self.start(now_s, self.service.warm_s)
        for index in reversed(wanted[workers:] if workers < len(wanted) else []):
            worker = self.workers[index]
            if worker.ready_s > now_s or worker.busy_until <= now_s:
                worker.stopped_s = now_s  # warming or idle: gone now
            else:
                worker.leaving = True  # finishes its batch first

    def worker_seconds(self, end_s: float) -> float:
        return sum(
            (end_s if w.stopped_s is None else min(w.stopped_s, end_s)) - w.started_s
            for w in self.workers
        )


def replay(
    times: np.ndarray,
    settings: PolicySettings,
    service: ServiceModel,
    *,
    interval_s: float = 1.0,
    workers: int = 1,
    seconds: float | None = None,
) -> ReplayResult:
    """Run ``settings``' policy against arrivals at ``times`` (sorted seconds) on ``service``.

    The fleet starts with ``workers`` warm workers. Decisions run for the
    trace's ``seconds`` (its last arrival if not given), then on until every
    request was served (at most DRAIN_LIMIT_S more); a request still
    unserved then counts as infinitely late.
    """
    times = np.asarray(times, dtype=float)
    end_s = float(seconds if seconds is not None else (times[-1] if len(times) else 0.0))
    fleet = _Fleet(times, service, interval_s)
    for _ in range(workers):
        fleet.start(0.0, 0.0)
    state, ticks, now_s = PolicyState(), [], 0.0
    while now_s < end_s or (fleet.head < len(times) and now_s < end_s + DRAIN_LIMIT_S):
        now_s += interval_s
        fleet.run_until(now_s)
        obs = fleet.observe(now_s)
        decision = desired_workers(obs, settings, state)
        state = decision.state
        backlog = (obs.lag or 0) + obs.pending
        ticks.append(
            Tick(now_s, obs.workers, obs.ready or 0, decision.workers, backlog, decision.reason)
        )
        fleet.resize(decision.workers, now_s)
    fleet.run_until(math.inf)
    latencies = np.where(np.isnan(fleet.latencies), math.inf, fleet.latencies)
    return ReplayResult(times, latencies, fleet.worker_seconds(now_s), ticks)


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None
