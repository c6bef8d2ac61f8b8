"""The scaling policy: how many workers the fleet should have, as pure functions.

The supervisor calls :func:`desired_workers` every ``interval_s`` with an
:class:`Observation` of the stream and the fleet, the :class:`PolicySettings`
and the :class:`PolicyState` the previous call returned (``PolicyState()`` at
first), and applies the :class:`Decision`'s ``workers``. Nothing here reads
Redis, a clock or a process table: the same inputs always give the same
decision, so whole traces replay in microseconds in the unit tests.

Policy ``"lag"`` (ours) sizes the fleet from two needs, with the per-worker
capacity ``c`` measured from heartbeats (the last one measured while it is
unknown, ``default_capacity_rps`` until one ever was):

* arrivals: ``ceil(arrivals / (c * target_utilization))``, where arrivals is
  the fleet's throughput plus how fast the backlog grew since the previous
  observation: what is coming in, not only what got done;
* backlog: ``ceil((lag + pending) / (c * target_drain_s))``: enough workers
  to clear what is queued within ``target_drain_s``.

Why it is shaped this way:

* **Up fast.** A growing queue costs latency every second it grows, so a
  scale-up acts on the current observation, adds up to ``max_step`` workers
  at once and waits only ``up_cooldown_s`` (long enough for the new workers
  to show in the measurements) before adding more.
* **Down slow.** Stopping a worker that is needed again a moment later costs
  a model load and a latency spike. A scale-down waits ``down_cooldown_s``
  after any change, removes one worker at a time, and judges arrivals by
  their peak over the last ``down_cooldown_s`` (at least
  :data:`MIN_PEAK_WINDOW_S`), so one quiet or noisy sample cannot trigger it.
* **Hysteresis.** The fleet grows when arrivals would use more than
  ``target_utilization`` of it, but shrinks only when the smaller fleet would
  be at most ``down_utilization`` busy at that peak and could drain the
  backlog well within ``target_drain_s``. The gap between the two thresholds
  keeps a steady load from toggling between two sizes.
* **Unknown lag is not zero.** Redis reports a group's lag as NULL after
  entries were deleted. Then only ``pending`` counts as backlog when scaling
  up, the backlog's growth is not estimated, and the fleet is never shrunk.
* **Bounds always hold.** The result is clamped to ``[min_workers,
  max_workers]``, also when the fleet is outside them now: then at once,
  regardless of cooldowns and ``max_step``.

Policy ``"article"`` is the simple rule we compare against: at most every
``article_interval_s``, ``+1`` when the average queue per worker
(``lag / workers``, pending excluded, unknown lag read as 0) exceeds
``article_up_queue`` and ``-1`` when it is under ``article_down_queue``.
Policy ``"fixed"`` always answers ``min_workers`` (the single-worker
baseline sets ``min_workers == max_workers == 1``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from inferfleet.worker.fleet.scaling_data import (
    POLICY_KINDS,
    Decision,
    Observation,
    PolicySettings,
    PolicyState,
)

__all__ = [
    "POLICY_KINDS",
    "MIN_PEAK_WINDOW_S",
    "MAX_ARRIVAL_SAMPLES",
    "Observation",
    "PolicySettings",
    "PolicyState",
    "Decision",
    "desired_workers",
]

#: The shortest window over which arrivals are peaked before a scale-down.
MIN_PEAK_WINDOW_S = 5.0
#: The most arrival samples a PolicyState keeps (bounds it at tiny intervals).
MAX_ARRIVAL_SAMPLES = 256
#: Worker counts computed past this are "more than any fleet" (guards overflow).
_HUGE_WORKERS = 1 << 30
#: Slack for float rounding in ``ceil(amount / per_worker)``.
_CEIL_SLACK = 1e-9


def desired_workers(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    """The worker count to run now, why, and the state to pass next time."""
    return _POLICIES[settings.kind](obs, settings, state)


# --------------------------------------------------------------------------- the lag policy's load


@dataclass(frozen=True)
class _Load:
    """What the lag policy derives from one observation and the history."""

    capacity_rps: float  # per worker, measured or assumed
    backlog: int  # lag + pending (pending only while the lag is unknown)
    lag_known: bool
    arrivals_rps: float  # now: throughput + backlog growth
    peak_arrivals_rps: float  # the most over the peak window, now included
    observed_s: float  # how long this state has been observing


# --------------------------------------------------------------------------- policy "lag"


def _lag_policy(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    load, state = _observe(obs, settings, state)
    up_target = _desired(load.arrivals_rps, load, settings)
    high = high_lane_waits(obs, settings)
    if high:  # the high lane's requests wait too long: one more worker at least
        up_target = max(up_target, _clamp(obs.workers + 1, settings))
    if up_target > obs.workers:
        workers, reason = _scale_up(obs, settings, state, load, up_target)
        if high:
            waited = f"{obs.high_wait_s:.1f} s > {settings.target_high_wait_s:g} s"
            reason = f"high lane waited {waited}; {reason}"
    elif _desired(load.peak_arrivals_rps, load, settings) < obs.workers:
        workers, reason = _scale_down(obs, settings, state, load)
    else:
        workers, reason = obs.workers, _steady_text(obs.workers, load, settings)
    return _finish(obs, settings, state, workers, reason)


def high_lane_waits(obs: Observation, settings: PolicySettings) -> bool:
    """True when a high-lane wait target is set and the high lane's oldest request waited longer."""
    return (
        bool(settings.target_high_wait_s) and (obs.high_wait_s or 0.0) > settings.target_high_wait_s
    )


def _observe(
    obs: Observation, settings: PolicySettings, state: PolicyState
) -> tuple[_Load, PolicyState]:
    """The load this observation shows, and the state with the history advanced."""
    capacity = _positive(obs.capacity_rps) or _positive(state.capacity_rps)
    known_backlog = None if obs.lag is None else obs.lag + obs.pending
    arrivals = obs.rate_rps + _growth_rps(known_backlog, obs.now_s, state)
    samples = _recent(state.arrivals, obs.now_s, arrivals, _peak_window_s(settings))
    first_s = obs.now_s if state.first_observed_s is None else state.first_observed_s
    load = _Load(
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


def _recent(
    samples: tuple[tuple[float, float], ...], now_s: float, arrivals_rps: float, window_s: float
) -> tuple[tuple[float, float], ...]:
    """The samples inside the window ending now, this one appended, at most MAX_ARRIVAL_SAMPLES."""
    kept = tuple((t, rps) for t, rps in samples if now_s - window_s < t < now_s)
    return (kept + ((now_s, arrivals_rps),))[-MAX_ARRIVAL_SAMPLES:]


def _peak_window_s(settings: PolicySettings) -> float:
    return max(settings.down_cooldown_s, MIN_PEAK_WINDOW_S)


def _desired(arrivals_rps: float, load: _Load, settings: PolicySettings) -> int:
    """The fleet size both needs ask for, inside the bounds."""
    for_arrivals, for_backlog = _needs(arrivals_rps, load, settings)
    return _clamp(max(settings.min_workers, for_arrivals, for_backlog), settings)


def _needs(arrivals_rps: float, load: _Load, settings: PolicySettings) -> tuple[int, int]:
    """Workers needed for the arrivals at target utilization, and to drain the backlog in time."""
    for_arrivals = _ceil_div(arrivals_rps, load.capacity_rps * settings.target_utilization)
    for_backlog = _ceil_div(load.backlog, load.capacity_rps * settings.target_drain_s)
    return for_arrivals, for_backlog


def _need_text(arrivals_rps: float, load: _Load, settings: PolicySettings) -> str:
    """The dominant need in words, for a Decision's reason."""
    for_arrivals, for_backlog = _needs(arrivals_rps, load, settings)
    what = "backlog" if load.lag_known else "pending (lag unknown)"
    if load.backlog > 0 and for_backlog >= for_arrivals:
        drain = f"to drain in {settings.target_drain_s:g} s"
        return f"{what} {load.backlog} needs {for_backlog} workers {drain}"
    return (
        f"arrivals ~{arrivals_rps:.0f} rps need {for_arrivals} workers at "
        f"{settings.target_utilization:.0%} of {load.capacity_rps:.0f} rps each"
    )


def _steady_text(workers: int, load: _Load, settings: PolicySettings) -> str:
    need = max(_needs(load.arrivals_rps, load, settings))
    at = (
        f"at max_workers {workers}"
        if workers == settings.max_workers and need > workers
        else "steady"
    )
    return f"{at}: {_need_text(load.arrivals_rps, load, settings)}"


def _scale_up(
    obs: Observation, settings: PolicySettings, state: PolicyState, load: _Load, target: int
) -> tuple[int, str]:
    """Up to ``target`` by at most max_step, once up_cooldown_s has passed since the last up."""
    why = _need_text(load.arrivals_rps, load, settings)
    waited_s = obs.now_s - state.last_up_s
    if waited_s < settings.up_cooldown_s:
        return (
            obs.workers,
            f"hold: {why}; up cooldown {waited_s:.1f} of {settings.up_cooldown_s:g} s",
        )
    step = min(settings.max_step, target - obs.workers)
    return obs.workers + step, f"up {step}: {why}"


def _scale_down(
    obs: Observation, settings: PolicySettings, state: PolicyState, load: _Load
) -> tuple[int, str]:
    """One worker fewer, if the lag is known, the cooldown and window passed, and the hysteresis
    holds."""
    smaller = obs.workers - 1
    quiet_s = obs.now_s - state.last_change_s
    if not load.lag_known:
        return obs.workers, "hold: lag unknown, never scaling down on it"
    if quiet_s < settings.down_cooldown_s:
        return obs.workers, f"hold: down cooldown {quiet_s:.1f} of {settings.down_cooldown_s:g} s"
    if load.observed_s < _peak_window_s(settings):
        return (
            obs.workers,
            f"hold: watching arrivals {_peak_window_s(settings):g} s before scaling down",
        )
    return _hysteresis(obs.workers, smaller, settings, load)


def _hysteresis(
    workers: int, smaller: int, settings: PolicySettings, load: _Load
) -> tuple[int, str]:
    """``smaller`` if it would be at most down_utilization busy at the peak and the backlog is
    small."""
    busy = _busy_fraction(load.peak_arrivals_rps, smaller, load.capacity_rps)
    at = f"{smaller} workers would be {busy:.0%} busy at peak ~{load.peak_arrivals_rps:.0f} rps"
    if busy > settings.down_utilization:
        return workers, f"hold: {at} (> {settings.down_utilization:.0%})"
    small_backlog = (
        smaller * load.capacity_rps * settings.target_drain_s * settings.down_utilization
    )
    if load.backlog > small_backlog:
        return workers, f"hold: backlog {load.backlog} too large to shrink (> {small_backlog:.0f})"
    return smaller, f"down 1: {at} (<= {settings.down_utilization:.0%}), backlog {load.backlog}"


def _busy_fraction(arrivals_rps: float, workers: int, capacity_rps: float) -> float:
    if workers <= 0:
        return 0.0 if arrivals_rps <= 0 else math.inf
    return arrivals_rps / (workers * capacity_rps)


# --------------------------------------------------------------------------- "article", "fixed"


def _article_policy(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    """The article's rule: +1 / -1 on the average queue per worker, at most every interval."""
    waited_s = obs.now_s - state.last_decision_s
    if waited_s < settings.article_interval_s:
        reason = (
            f"hold: next decision after {settings.article_interval_s:g} s ({waited_s:.1f} s so far)"
        )
        return _finish(obs, settings, state, obs.workers, reason, decided=False)
    queue = (obs.lag or 0) / max(obs.workers, 1)
    if queue > settings.article_up_queue:
        return _finish(
            obs,
            settings,
            state,
            obs.workers + 1,
            f"up 1: average queue {queue:.1f} > {settings.article_up_queue:g} per worker",
        )
    if queue < settings.article_down_queue:
        return _finish(
            obs,
            settings,
            state,
            obs.workers - 1,
            f"down 1: average queue {queue:.1f} < {settings.article_down_queue:g} per worker",
        )
    return _finish(obs, settings, state, obs.workers, f"hold: average queue {queue:.1f} per worker")


def _fixed_policy(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    return _finish(
        obs, settings, state, settings.min_workers, f"fixed at {settings.min_workers} workers"
    )


# --------------------------------------------------------------------------- shared


def _finish(
    obs: Observation,
    settings: PolicySettings,
    state: PolicyState,
    proposed: int,
    reason: str,
    *,
    decided: bool = True,
) -> Decision:
    """Clamp the proposal to the bounds and record what changed in the state."""
    workers = _clamp(proposed, settings)
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


def _clamp(workers: int, settings: PolicySettings) -> int:
    return min(max(workers, settings.min_workers), settings.max_workers)


def _ceil_div(amount: float, per_worker: float) -> int:
    """``ceil(amount / per_worker)`` as a worker count, tolerant of float noise and overflow."""
    if amount <= 0:
        return 0
    ratio = amount / per_worker if per_worker > 0 else math.inf
    if not ratio < _HUGE_WORKERS:
        return _HUGE_WORKERS
    return max(0, math.ceil(ratio - _CEIL_SLACK))


def _positive(value: float | None) -> float | None:
    """``value`` if it is a finite positive number, else None (unknown)."""
    if value is None or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


_POLICIES: dict[str, Callable[[Observation, PolicySettings, PolicyState], Decision]] = {
    "lag": _lag_policy,
    "article": _article_policy,
    "fixed": _fixed_policy,
}
