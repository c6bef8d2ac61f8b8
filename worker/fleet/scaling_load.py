"""What every scaling policy derives from an observation, and how each one ends a decision.

Pure, like the policies in :mod:`inferfleet.worker.fleet.scaling` and
:mod:`inferfleet.worker.fleet.scaling_target` that share these: the load one
observation shows with the history advanced (:func:`observe_load`), and the
clamped, recorded :class:`Decision` (:func:`finish`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from inferfleet.worker.fleet.scaling_data import Decision, Observation, PolicySettings, PolicyState

__all__ = [
    "MIN_PEAK_WINDOW_S",
    "MAX_ARRIVAL_SAMPLES",
    "Load",
    "observe_load",
    "peak_window_s",
    "recent",
    "finish",
    "clamp",
    "ceil_div",
    "positive",
]

#: The shortest window over which arrivals are peaked before a scale-down.
MIN_PEAK_WINDOW_S = 5.0
#: The most arrival samples a PolicyState keeps (bounds it at tiny intervals).
MAX_ARRIVAL_SAMPLES = 256
#: Worker counts computed past this are "more than any fleet" (guards overflow).
_HUGE_WORKERS = 1 << 30
#: Slack for float rounding in ``ceil(amount / per_worker)``.
_CEIL_SLACK = 1e-9


@dataclass(frozen=True)
class Load:
    """What a policy derives from one observation and the history."""

    capacity_rps: float  # per worker, measured or assumed
    backlog: int  # lag + pending (pending only while the lag is unknown)
    lag_known: bool
    arrivals_rps: float  # now: throughput + backlog growth
    peak_arrivals_rps: float  # the most over the peak window, now included
    observed_s: float  # how long this state has been observing


def observe_load(
    obs: Observation, settings: PolicySettings, state: PolicyState
) -> tuple[Load, PolicyState]:
    """The load this observation shows, and the state with the history advanced."""
    capacity = positive(obs.capacity_rps) or positive(state.capacity_rps)
    known_backlog = None if obs.lag is None else obs.lag + obs.pending
    arrivals = obs.rate_rps + _growth_rps(known_backlog, obs.now_s, state)
    samples = recent(state.arrivals, obs.now_s, arrivals, peak_window_s(settings))
    first_s = obs.now_s if state.first_observed_s is None else state.first_observed_s
    load = Load(
        capacity_rps=capacity or settings.default_capacity_rps,
        backlog=obs.pending if known_backlog is None else known_backlog,
        lag_known=known_backlog is not None,
        arrivals_rps=arrivals,
        peak_arrivals_rps=max(rps for _, rps in samples),
        observed_s=obs.now_s - first_s,
    )
    state = replace(
        state,
        first_observed_s=first_s,
        last_observed_s=obs.now_s,
        last_backlog=known_backlog,
        capacity_rps=capacity,
        arrivals=samples,
    )
    return load, state


def _growth_rps(backlog: int | None, now_s: float, state: PolicyState) -> float:
    """How fast the backlog grew since the previous observation (0 if unknown or shrinking)."""
    elapsed_s = now_s - state.last_observed_s
    if backlog is None or state.last_backlog is None or not 0 < elapsed_s < math.inf:
        return 0.0
    return max(0.0, (backlog - state.last_backlog) / elapsed_s)


def recent(
    samples: tuple[tuple[float, float], ...], now_s: float, value: float, window_s: float
) -> tuple[tuple[float, float], ...]:
    """The samples inside the window ending now, this one appended, at most MAX_ARRIVAL_SAMPLES."""
    kept = tuple((t, v) for t, v in samples if now_s - window_s < t < now_s)
    return (kept + ((now_s, value),))[-MAX_ARRIVAL_SAMPLES:]


def peak_window_s(settings: PolicySettings) -> float:
    """How far back a scale-down looks for the arrivals' peak."""
    return max(settings.down_cooldown_s, MIN_PEAK_WINDOW_S)


def finish(
    obs: Observation,
    settings: PolicySettings,
    state: PolicyState,
    proposed: int,
    reason: str,
    *,
    decided: bool = True,
) -> Decision:
    """Clamp the proposal to the bounds and record what changed in the state."""
    workers = clamp(proposed, settings)
    if workers != proposed:
        reason += (
            f"; clamped {proposed} to {workers} in [{settings.min_workers}, {settings.max_workers}]"
        )
    now_s = obs.now_s
    state = replace(
        state,
        last_decision_s=now_s if decided else state.last_decision_s,
        last_up_s=now_s if workers > obs.workers else state.last_up_s,
        last_down_s=now_s if workers < obs.workers else state.last_down_s,
        last_change_s=now_s if workers != obs.workers else state.last_change_s,
    )
    return Decision(workers=workers, reason=reason, state=state)


def clamp(workers: int, settings: PolicySettings) -> int:
    """``workers`` inside ``[min_workers, max_workers]``."""
    return min(max(workers, settings.min_workers), settings.max_workers)


def ceil_div(amount: float, per_worker: float) -> int:
    """``ceil(amount / per_worker)`` as a worker count, tolerant of float noise and overflow."""
    if amount <= 0:
        return 0
    ratio = amount / per_worker if per_worker > 0 else math.inf
    if not ratio < _HUGE_WORKERS:
        return _HUGE_WORKERS
    return max(0, math.ceil(ratio - _CEIL_SLACK))


def positive(value: float | None) -> float | None:
    """``value`` if it is a finite positive number, else None (unknown)."""
    if value is None or not math.isfinite(value) or value <= 0:
        return None
    return float(value)
