"""The ``target`` policy (a p99 latency to meet at the least cost) and KEDA's rule, both pure.

Policy ``"target"`` predicts, for each fleet size, the p99 latency requests
would see (:mod:`inferfleet.worker.fleet.waits`: the backlog drained while new
workers warm up, and the steady queueing of random arrivals) and runs the
fewest workers that keep it under ``target_p99_ms`` (or under the tightest
deadline requests carried lately, when that is shorter). What it predicts
from is measured, never configured, once measured:

* a worker's capacity: the peak ``rate / busy`` of the last few minutes
  (a worker that served small batches at night could serve more);
* the warm-up time, from the heartbeats (process start to first beat);
* one batch's time, the least latency any request sees;
* the arrivals, extrapolated over the warm-up by their recent trend: a
  worker asked for now serves only ``warm_s`` from now.

It keeps the lag policy's shape: up at once (to the predicted size, not a
step at a time) after ``up_cooldown_s``; down one ``max_step`` at a time,
``down_cooldown_s`` after any change, only if the smaller fleet would stay
under ``target_down_fraction`` of the target at the recent peak of arrivals
(hysteresis), and never while the lag is unknown.

Policy ``"keda"`` is the rule KEDA's ``lagCount`` trigger makes the
Kubernetes HPA apply, for comparison: every ``keda_interval_s`` (the HPA's
15 s sync) ``ceil(lag / keda_lag_count)`` workers, changes within 10% of
the fleet ignored, up at most to ``max(2 x, x + 4)``, down only to the
largest count proposed over ``keda_down_window_s`` (the HPA's 300 s
stabilization window).
"""

from __future__ import annotations

from dataclasses import replace

from inferfleet.worker.fleet.scaling_data import Decision, Observation, PolicySettings, PolicyState
from inferfleet.worker.fleet.scaling_load import (
    Load,
    ceil_div,
    clamp,
    finish,
    observe_load,
    peak_window_s,
    positive,
    recent,
)
from inferfleet.worker.fleet.waits import Fleet, predicted_p99_s

__all__ = ["target_policy", "keda_policy", "fewest_meeting", "CAPACITY_WINDOW_S", "TREND_WINDOW_S"]

#: How far back a worker's peak capacity is remembered.
CAPACITY_WINDOW_S = 300.0
#: The arrivals' trend is their slope over this window.
TREND_WINDOW_S = 10.0
#: The HPA ignores a change within this fraction of the current count.
_HPA_TOLERANCE = 0.1


def target_policy(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    """The fewest workers whose predicted p99 meets the target (see the module's text)."""
    load, state = observe_load(obs, settings, state)
    fleet, state = _fleet(obs, settings, state, load)
    target_s = _target_s(obs, settings)
    ahead = replace(fleet, arrivals_rps=load.arrivals_rps + _trend(state, obs.now_s) * fleet.warm_s)
    up = fewest_meeting(ahead, target_s, settings)
    if up is None or up > obs.workers:
        return _up(obs, settings, state, up, ahead, target_s)
    at_peak = replace(fleet, arrivals_rps=max(load.peak_arrivals_rps, ahead.arrivals_rps))
    down = fewest_meeting(at_peak, target_s * settings.target_down_fraction, settings)
    if down is not None and down < obs.workers:
        return _down(obs, settings, state, load, down)
    p99_ms = predicted_p99_s(fleet, obs.workers) * 1000
    reason = f"steady: {obs.workers} workers predict p99 {p99_ms:.0f} ms <= {target_s * 1000:g} ms"
    return finish(obs, settings, state, obs.workers, reason + _about(fleet))


def fewest_meeting(fleet: Fleet, target_s: float, settings: PolicySettings) -> int | None:
    """The fewest workers in the bounds predicted to meet ``target_s`` (None: not even the most)."""
    lowest = max(settings.min_workers, ceil_div(fleet.arrivals_rps, fleet.capacity_rps))
    for workers in range(clamp(lowest, settings), settings.max_workers + 1):
        if predicted_p99_s(fleet, workers) <= target_s:
            return workers
    return None


def _fleet(
    obs: Observation, settings: PolicySettings, state: PolicyState, load: Load
) -> tuple[Fleet, PolicyState]:
    """The prediction's inputs (measured where they were, else remembered, else defaults)."""
    measured = positive(obs.capacity_rps)
    capacities = state.capacities
    if measured is not None:
        capacities = recent(capacities, obs.now_s, measured, CAPACITY_WINDOW_S)
    warm_s = obs.warm_s if obs.warm_s is not None else state.warm_s
    service_s = positive(obs.service_s) or state.service_s
    state = replace(state, capacities=capacities, warm_s=warm_s, service_s=service_s)
    ready = obs.workers if obs.ready is None else min(obs.ready, obs.workers)
    fleet = Fleet(
        arrivals_rps=load.arrivals_rps,
        capacity_rps=max((c for _, c in capacities), default=load.capacity_rps),
        backlog=load.backlog,
        ready=ready,
        warm_s=settings.default_warm_s if warm_s is None else warm_s,
        service_s=service_s or 0.0,
    )
    return fleet, state


def _target_s(obs: Observation, settings: PolicySettings) -> float:
    """The p99 to meet: the setting, or the tightest recent deadline when shorter."""
    target_s = settings.target_p99_ms / 1000
    return min(target_s, obs.deadline_s) if obs.deadline_s else target_s


def _trend(state: PolicyState, now_s: float) -> float:
    """The arrivals' least-squares slope over the trend window, if rising (rps per second)."""
    points = [(t, rps) for t, rps in state.arrivals if now_s - t <= TREND_WINDOW_S]
    if len(points) < 3:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_r = sum(r for _, r in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread <= 0:
        return 0.0
    return max(0.0, sum((t - mean_t) * (r - mean_r) for t, r in points) / spread)


def _about(fleet: Fleet) -> str:
    return (
        f" (arrivals ~{fleet.arrivals_rps:.0f} rps, {fleet.capacity_rps:.0f} rps a worker, "
        f"backlog {fleet.backlog}, warm-up {fleet.warm_s:.1f} s)"
    )


def _up(
    obs: Observation,
    settings: PolicySettings,
    state: PolicyState,
    up: int | None,
    fleet: Fleet,
    target_s: float,
) -> Decision:
    workers = settings.max_workers if up is None else up
    why = (
        f"no fleet up to {settings.max_workers} meets p99 {target_s * 1000:g} ms"
        if up is None
        else f"{workers} workers predict p99 "
        f"{predicted_p99_s(fleet, workers) * 1000:.0f} ms <= {target_s * 1000:g} ms"
    )
    waited_s = obs.now_s - state.last_up_s
    if workers <= obs.workers:
        return finish(obs, settings, state, obs.workers, f"at most: {why}{_about(fleet)}")
    if waited_s < settings.up_cooldown_s:
        hold = f"hold: {why}; up cooldown {waited_s:.1f} of {settings.up_cooldown_s:g} s"
        return finish(obs, settings, state, obs.workers, hold + _about(fleet))
    return finish(
        obs, settings, state, workers, f"up {workers - obs.workers}: {why}{_about(fleet)}"
    )


def _down(
    obs: Observation, settings: PolicySettings, state: PolicyState, load: Load, down: int
) -> Decision:
    quiet_s = obs.now_s - state.last_change_s
    if not load.lag_known:
        reason = "hold: lag unknown, never scaling down on it"
    elif quiet_s < settings.down_cooldown_s:
        reason = f"hold: down cooldown {quiet_s:.1f} of {settings.down_cooldown_s:g} s"
    elif load.observed_s < peak_window_s(settings):
        reason = f"hold: watching arrivals {peak_window_s(settings):g} s before scaling down"
    else:
        workers = max(down, obs.workers - settings.max_step)
        fraction = f"{settings.target_down_fraction:.0%} of the target"
        why = f"{down} workers stay under {fraction} at peak ~{load.peak_arrivals_rps:.0f} rps"
        return finish(obs, settings, state, workers, f"down {obs.workers - workers}: {why}")
    return finish(obs, settings, state, obs.workers, reason)


def keda_policy(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    """KEDA's lagCount rule as the HPA applies it (see the module's text)."""
    waited_s = obs.now_s - state.last_decision_s
    if waited_s < settings.keda_interval_s:
        reason = f"hold: next HPA sync after {settings.keda_interval_s:g} s ({waited_s:.1f} s)"
        return finish(obs, settings, state, obs.workers, reason, decided=False)
    lag = obs.lag or 0
    proposed = ceil_div(lag, settings.keda_lag_count)
    if lag > 0 or settings.min_workers > 0:  # active: the HPA's own minimum is one
        proposed = max(proposed, 1)
    if obs.workers > 0 and abs(proposed / obs.workers - 1) <= _HPA_TOLERANCE:
        proposed = obs.workers
    window = recent(state.proposals, obs.now_s, proposed, settings.keda_down_window_s)
    state = replace(state, proposals=window)
    why = f"lag {lag} / {settings.keda_lag_count:g} -> {proposed}"
    if proposed > obs.workers:
        workers = min(proposed, max(2 * obs.workers, obs.workers + 4))
        return finish(obs, settings, state, workers, f"up {workers - obs.workers}: {why}")
    floor = int(max(count for _, count in window))
    if floor < obs.workers:
        return finish(obs, settings, state, floor, f"down {obs.workers - floor}: {why}")
    window_s = f"{settings.keda_down_window_s:g} s"
    return finish(obs, settings, state, obs.workers, f"hold: {why}; max over {window_s} {floor}")
