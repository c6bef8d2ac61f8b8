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

from inferfleet.worker.fleet.scaling_data import (
    POLICY_KINDS,
    Decision,
    Observation,
    PolicySettings,
    PolicyState,
)
from inferfleet.worker.fleet.scaling_load import (
    MAX_ARRIVAL_SAMPLES,
    MIN_PEAK_WINDOW_S,
    Load,
    ceil_div,
    clamp,
    finish,
    observe_load,
    peak_window_s,
)
from inferfleet.worker.fleet.scaling_target import keda_policy, target_policy

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


def desired_workers(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    """The worker count to run now, why, and the state to pass next time."""
    return _POLICIES[settings.kind](obs, settings, state)


# --------------------------------------------------------------------------- policy "lag"


def _lag_policy(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    load, state = observe_load(obs, settings, state)
    up_target = _desired(load.arrivals_rps, load, settings)
    high = high_lane_waits(obs, settings)
    if high:  # the high lane's requests wait too long: one more worker at least
        up_target = max(up_target, clamp(obs.workers + 1, settings))
    if up_target > obs.workers:
        workers, reason = _scale_up(obs, settings, state, load, up_target)
        if high:
            waited = f"{obs.high_wait_s:.1f} s > {settings.target_high_wait_s:g} s"
            reason = f"high lane waited {waited}; {reason}"
    elif _desired(load.peak_arrivals_rps, load, settings) < obs.workers:
        workers, reason = _scale_down(obs, settings, state, load)
    else:
        workers, reason = obs.workers, _steady_text(obs.workers, load, settings)
    return finish(obs, settings, state, workers, reason)


def high_lane_waits(obs: Observation, settings: PolicySettings) -> bool:
    """True when a high-lane wait target is set and the high lane's oldest request waited longer."""
    return (
        bool(settings.target_high_wait_s) and (obs.high_wait_s or 0.0) > settings.target_high_wait_s
    )


def _desired(arrivals_rps: float, load: Load, settings: PolicySettings) -> int:
    """The fleet size both needs ask for, inside the bounds."""
    for_arrivals, for_backlog = _needs(arrivals_rps, load, settings)
    return clamp(max(settings.min_workers, for_arrivals, for_backlog), settings)


def _needs(arrivals_rps: float, load: Load, settings: PolicySettings) -> tuple[int, int]:
    """Workers needed for the arrivals at target utilization, and to drain the backlog in time."""
    for_arrivals = ceil_div(arrivals_rps, load.capacity_rps * settings.target_utilization)
    for_backlog = ceil_div(load.backlog, load.capacity_rps * settings.target_drain_s)
    return for_arrivals, for_backlog


def _need_text(arrivals_rps: float, load: Load, settings: PolicySettings) -> str:
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


def _steady_text(workers: int, load: Load, settings: PolicySettings) -> str:
    need = max(_needs(load.arrivals_rps, load, settings))
    at = (
        f"at max_workers {workers}"
        if workers == settings.max_workers and need > workers
        else "steady"
    )
    return f"{at}: {_need_text(load.arrivals_rps, load, settings)}"


def _scale_up(
    obs: Observation, settings: PolicySettings, state: PolicyState, load: Load, target: int
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
    obs: Observation, settings: PolicySettings, state: PolicyState, load: Load
) -> tuple[int, str]:
    """One worker fewer, if the lag is known, the cooldown and window passed, and the hysteresis
    holds."""
    smaller = obs.workers - 1
    quiet_s = obs.now_s - state.last_change_s
    if not load.lag_known:
        return obs.workers, "hold: lag unknown, never scaling down on it"
    if quiet_s < settings.down_cooldown_s:
        return obs.workers, f"hold: down cooldown {quiet_s:.1f} of {settings.down_cooldown_s:g} s"
    if load.observed_s < peak_window_s(settings):
        return (
            obs.workers,
            f"hold: watching arrivals {peak_window_s(settings):g} s before scaling down",
        )
    return _hysteresis(obs.workers, smaller, settings, load)


def _hysteresis(
    workers: int, smaller: int, settings: PolicySettings, load: Load
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
        return finish(obs, settings, state, obs.workers, reason, decided=False)
    queue = (obs.lag or 0) / max(obs.workers, 1)
    if queue > settings.article_up_queue:
        return finish(
            obs,
            settings,
            state,
            obs.workers + 1,
            f"up 1: average queue {queue:.1f} > {settings.article_up_queue:g} per worker",
        )
    if queue < settings.article_down_queue:
        return finish(
            obs,
            settings,
            state,
            obs.workers - 1,
            f"down 1: average queue {queue:.1f} < {settings.article_down_queue:g} per worker",
        )
    return finish(obs, settings, state, obs.workers, f"hold: average queue {queue:.1f} per worker")


def _fixed_policy(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    return finish(
        obs, settings, state, settings.min_workers, f"fixed at {settings.min_workers} workers"
    )


_POLICIES: dict[str, Callable[[Observation, PolicySettings, PolicyState], Decision]] = {
    "target": target_policy,
    "lag": _lag_policy,
    "article": _article_policy,
    "keda": keda_policy,
    "fixed": _fixed_policy,
}
