"""The ``target`` policy (a p99 latency to meet at the least cost) and KEDA's rule, both pure.

Policy ``"target"`` predicts, for each fleet size, the p99 latency requests
would see (:mod:`inferfleet.worker.fleet.waits`: the backlog drained while new
workers warm up, and the steady queueing of random arrivals) and runs the
fewest workers that keep it under ``target_p99_ms`` (or under the tightest
deadline requests carried lately, when that is shorter). What it predicts
from is measured, never configured, once measured:

* a worker's capacity at full batches: a line ``seconds = a + b * rows``
  fitted to the batches of the last few minutes, at ``max_rows`` rows
  (``rate / busy`` alone reads low at light load, when batches are small),
  or the peak ``rate / busy`` while the batch sizes seen cannot tell;
* the warm-up time, from the heartbeats (process start to first beat);
* one batch's time, the least latency any request sees;
* the arrivals: their mean over the last LEVEL_WINDOW_S (throughput plus the
  backlog's change, unclipped, so the mean is unbiased; one second's count is
  noisy), extrapolated over the warm-up by their trend (the later half of the
  trend window's mean less the earlier half's): a worker asked for now serves
  only ``warm_s`` from now.

When no fleet in the bounds meets the target (a backlog that the warm-up
makes late whatever is started, or more arrivals than ``max_workers``
serve), it runs the fewest workers within 10% of the best p99 any could
give: waking from zero for one request starts one worker, not all of them.

It keeps the lag policy's shape: up at once (to the predicted size, not a
step at a time) after ``up_cooldown_s``; down one ``max_step`` at a time,
``down_cooldown_s`` after any change, only if the smaller fleet would stay
under ``target_down_fraction`` of the target at the arrivals' mean over the
down cooldown (or their forecast, if higher): hysteresis against noise
without the bias of a noisy peak; never while the lag is unknown. Nor below
what would absorb, within the target, the largest sudden rise seen over the
last SURGE_MEMORY_S (a rise within one warm-up, less Poisson noise): traffic
that bursts keeps the workers its bursts need while they recur, and a fleet
that saw none shrinks as before.

Policy ``"keda"`` is the rule KEDA's ``lagCount`` trigger makes the
Kubernetes HPA apply, for comparison: every ``keda_interval_s`` (the HPA's
15 s sync) ``ceil(lag / keda_lag_count)`` workers, changes within 10% of
the fleet ignored, up at most to ``max(2 x, x + 4)``, down only to the
largest count proposed over ``keda_down_window_s`` (the HPA's 300 s
stabilization window).
"""

from __future__ import annotations

import math
from dataclasses import replace

from inferfleet.worker.fleet.scaling_data import Decision, Observation, PolicySettings, PolicyState
from inferfleet.worker.fleet.scaling_load import (
    MAX_ARRIVAL_SAMPLES,
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

__all__ = [
    "target_policy",
    "keda_policy",
    "fewest_meeting",
    "fewest_near_best",
    "full_batch_capacity",
    "CAPACITY_WINDOW_S",
    "TREND_WINDOW_S",
]

#: How far back a worker's peak capacity is remembered.
CAPACITY_WINDOW_S = 300.0
#: The arrivals' trend is their slope over this window.
TREND_WINDOW_S = 10.0
#: Scale-ups judge the arrivals by their mean over this window (one second's count is noisy).
LEVEL_WINDOW_S = 3.0
#: How long a sudden rise of the arrivals is remembered: the fleet keeps enough workers to
#: absorb it, should it come again, for this long after it was seen.
SURGE_MEMORY_S = 120.0
#: Missing the target anyway, a fleet this close to the best p99 is enough.
NEAR_BEST = 1.1
#: Missing it anyway, what is queued once new workers are warm is cleared within this long:
#: within the target itself bought every worker there is for a moment's backlog (a flash
#: crowd cost 8 workers for its first 20 s), while a second costs a second of late requests.
RECOVER_S = 1.0
#: The HPA ignores a change within this fraction of the current count.
_HPA_TOLERANCE = 0.1


def target_policy(obs: Observation, settings: PolicySettings, state: PolicyState) -> Decision:
    """The fewest workers whose predicted p99 meets the target (see the module's text)."""
    signed = _signed_arrivals(obs, state)  # before observe_load moves the last backlog on
    load, state = observe_load(obs, settings, state)
    state = replace(state, levels=recent(state.levels, obs.now_s, signed, TREND_WINDOW_S))
    fleet, state = _fleet(obs, settings, state, load)
    target_s = _target_s(obs, settings)
    trend = _trend(state.levels, obs.now_s)
    last = [v for t, v in state.levels if obs.now_s - t < LEVEL_WINDOW_S]
    # the window's mean lags the arrivals by half the window: the trend carries it to now
    level = max(0.0, sum(last) / len(last) + trend * LEVEL_WINDOW_S / 2)
    ahead = replace(fleet, arrivals_rps=level + trend * fleet.warm_s)
    state, surge = _surge(state, obs.now_s, level, fleet.warm_s)
    up = fewest_meeting(ahead, target_s, settings)
    if up is None or up > obs.workers:
        return _up(obs, settings, state, up, ahead, target_s)
    window = [rps for _, rps in state.arrivals]
    steady = replace(fleet, arrivals_rps=max(sum(window) / len(window), ahead.arrivals_rps))
    down = fewest_meeting(steady, target_s * settings.target_down_fraction, settings)
    if down is not None and down < obs.workers:
        down = max(down, fewest_absorbing(steady, surge, target_s, settings, obs.workers))
    if down is not None and down < obs.workers:
        return _down(obs, settings, state, load, down, steady.arrivals_rps)
    p99_ms = predicted_p99_s(fleet, obs.workers) * 1000
    reason = f"steady: {obs.workers} workers predict p99 {p99_ms:.0f} ms <= {target_s * 1000:g} ms"
    return finish(obs, settings, state, obs.workers, reason + _about(fleet))


def fewest_absorbing(
    fleet: Fleet, surge_rps: float, target_s: float, settings: PolicySettings, upto: int
) -> int:
    """The fewest workers (at most ``upto``) that, should the arrivals jump by ``surge_rps``
    now, keep the target while every worker the bounds allow warms up to help."""
    if surge_rps <= 0:
        return settings.min_workers
    jumped = replace(fleet, arrivals_rps=fleet.arrivals_rps + surge_rps)
    for workers in range(settings.min_workers, upto):
        if predicted_p99_s(replace(jumped, ready=workers), settings.max_workers) <= target_s:
            return workers
    return upto


def _surge(
    state: PolicyState, now_s: float, level: float, warm_s: float
) -> tuple[PolicyState, float]:
    """The largest rise of the arrivals within one warm-up over the last SURGE_MEMORY_S: a
    fleet shrunk below what absorbs it would miss the target when it comes again."""
    means = recent(state.means, now_s, level, max(warm_s, LEVEL_WINDOW_S))
    # less two standard deviations of a Poisson rate's mean over the level window: noise
    noise = 2.0 * math.sqrt(level / LEVEL_WINDOW_S)
    rise = max(0.0, level - min(v for _, v in means) - noise)
    rises = recent(state.rises, now_s, rise, SURGE_MEMORY_S)
    return replace(state, means=means, rises=rises), max(v for _, v in rises)


def fewest_meeting(fleet: Fleet, target_s: float, settings: PolicySettings) -> int | None:
    """The fewest workers in the bounds predicted to meet ``target_s`` (None: not even the most)."""
    lowest = max(settings.min_workers, ceil_div(fleet.arrivals_rps, fleet.capacity_rps))
    for workers in range(clamp(lowest, settings), settings.max_workers + 1):
        if predicted_p99_s(fleet, workers) <= target_s:
            return workers
    return None


def fewest_near_best(fleet: Fleet, settings: PolicySettings) -> int:
    """When no fleet meets the target: enough workers for the arrivals alone to meet it and to
    clear, within RECOVER_S, what will be queued once new workers are warm; at least the fewest
    within NEAR_BEST of the best p99 any fleet in the bounds would give. What the warm-up makes
    late anyway buys no more workers than that."""
    options = range(settings.min_workers, settings.max_workers + 1)
    p99 = {workers: predicted_p99_s(fleet, workers) for workers in options}
    best = min(p99.values())
    if math.isinf(best):
        return settings.max_workers
    near = min(w for w, value in p99.items() if value <= best * NEAR_BEST)
    target_s = settings.target_p99_ms / 1000
    alone = replace(fleet, backlog=0, ready=settings.max_workers)
    steady = fewest_meeting(alone, target_s, settings)
    # what is queued once new workers are warm is cleared within RECOVER_S from then on
    queued = fleet.backlog + (fleet.arrivals_rps - fleet.ready * fleet.capacity_rps) * fleet.warm_s
    drain = ceil_div(max(queued, 0.0) / RECOVER_S + fleet.arrivals_rps, fleet.capacity_rps)
    return clamp(max(near, drain, settings.max_workers if steady is None else steady), settings)


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
    batches = _batches(state.batches, obs)
    max_rows = obs.max_rows or state.max_rows
    state = replace(
        state,
        capacities=capacities,
        warm_s=warm_s,
        service_s=service_s,
        batches=batches,
        max_rows=max_rows,
    )
    ready = obs.workers if obs.ready is None else min(obs.ready, obs.workers)
    peak = max((c for _, c in capacities), default=load.capacity_rps)
    fleet = Fleet(
        arrivals_rps=load.arrivals_rps,
        capacity_rps=max(peak, full_batch_capacity(batches, max_rows) or 0.0),
        backlog=load.backlog,
        ready=ready,
        warm_s=settings.default_warm_s if warm_s is None else warm_s,
        service_s=service_s or 0.0,
    )
    return fleet, state


def full_batch_capacity(
    batches: tuple[tuple[float, float, float], ...], max_rows: int | None
) -> float | None:
    """Rows a second at ``max_rows``-row batches, from ``seconds = a + b * rows`` (a, b >= 0)
    fitted to ``(now_s, rows, seconds)`` samples; None while their sizes differ by under a row."""
    if max_rows is None or len(batches) < 3:
        return None
    rows = [r for _, r, _ in batches]
    if max(rows) - min(rows) < 1.0:
        return None
    mean_r = sum(rows) / len(rows)
    mean_t = sum(t for _, _, t in batches) / len(batches)
    spread = sum((r - mean_r) ** 2 for r in rows)
    slope = max(0.0, sum((r - mean_r) * (t - mean_t) for _, r, t in batches) / spread)
    base = max(0.0, mean_t - slope * mean_r)
    full_s = base + slope * max_rows
    return max_rows / full_s if full_s > 0 else None


def _batches(
    kept: tuple[tuple[float, float, float], ...], obs: Observation
) -> tuple[tuple[float, float, float], ...]:
    """The batch samples of the capacity window, this observation's appended if it has one."""
    kept = tuple(b for b in kept if obs.now_s - CAPACITY_WINDOW_S < b[0] < obs.now_s)
    if obs.batch_rows and obs.service_s:
        kept += ((obs.now_s, obs.batch_rows, obs.service_s),)
    return kept[-MAX_ARRIVAL_SAMPLES:]


def _target_s(obs: Observation, settings: PolicySettings) -> float:
    """The p99 to meet: the setting, or the tightest recent deadline when shorter."""
    target_s = settings.target_p99_ms / 1000
    return min(target_s, obs.deadline_s) if obs.deadline_s else target_s


def _signed_arrivals(obs: Observation, state: PolicyState) -> float:
    """Throughput plus the backlog's change, a shrinking backlog included: unbiased, so that
    their mean over a window is the window's arrival rate (the lag policy's peak clips at 0)."""
    elapsed_s = obs.now_s - state.last_observed_s
    if obs.lag is None or state.last_backlog is None or not 0 < elapsed_s < math.inf:
        return obs.rate_rps
    return obs.rate_rps + (obs.lag + obs.pending - state.last_backlog) / elapsed_s


def _trend(samples: tuple[tuple[float, float], ...], now_s: float) -> float:
    """The arrivals' slope over the trend window, if rising (rps per second): the mean of its
    later half less that of its earlier half, over half the window. A least-squares line would
    tilt on one noisy last second (its leverage is the largest) and buy workers for it."""
    half_s = TREND_WINDOW_S / 2
    later = [rps for t, rps in samples if now_s - t < half_s]
    earlier = [rps for t, rps in samples if half_s <= now_s - t < TREND_WINDOW_S]
    if len(later) < 2 or len(earlier) < 2:
        return 0.0
    return max(0.0, (sum(later) / len(later) - sum(earlier) / len(earlier)) / half_s)


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
    workers = fewest_near_best(fleet, settings) if up is None else up
    why = (
        f"no fleet up to {settings.max_workers} meets p99 {target_s * 1000:g} ms; {workers} "
        f"predict {predicted_p99_s(fleet, workers) * 1000:.0f} ms, within "
        f"{NEAR_BEST - 1:.0%} of the best"
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
    obs: Observation,
    settings: PolicySettings,
    state: PolicyState,
    load: Load,
    down: int,
    arrivals_rps: float,
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
        why = f"{down} workers stay under {fraction} at ~{arrivals_rps:.0f} rps"
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
    ratio = lag / (settings.keda_lag_count * obs.workers) if obs.workers else 0.0
    if obs.workers > 0 and lag > 0 and abs(ratio - 1) <= _HPA_TOLERANCE:
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
