"""inferfleet.worker.fleet.scaling: the pure scaling policy, replayed on synthetic traces with a
fake clock.

The simulator queues each step's arrivals, lets the live workers drain
``workers * capacity`` per step, observes the stream like the supervisor
would, and applies each decision's worker count to the next step.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from inferfleet.worker.errors import ConfigError
from inferfleet.worker.fleet.restarts import restart_backoff
from inferfleet.worker.fleet.scaling import (
    MIN_PEAK_WINDOW_S,
    Decision,
    Observation,
    PolicySettings,
    PolicyState,
    desired_workers,
)
from inferfleet.worker.fleet.scaling_load import ceil_div, observe_load, positive, recent

CAPACITY_RPS = 100.0  # what one simulated worker drains per second
STEP_S = 1.0
LAG = PolicySettings(default_capacity_rps=CAPACITY_RPS)  # min 1, max 4, up 2 s, down 20 s
ARTICLE = PolicySettings(kind="article", default_capacity_rps=CAPACITY_RPS)


@dataclass(frozen=True)
class Tick:
    """One simulated step: the fleet during it, what was decided after it."""

    now_s: float
    workers: int
    decided: int
    lag: int
    arrived: int
    reason: str


def simulate(
    arrivals: Sequence[int],
    settings: PolicySettings = LAG,
    *,
    workers: int | None = None,
    capacity_rps: float = CAPACITY_RPS,
) -> list[Tick]:
    """Run a trace (entries arriving per step) through desired_workers with a fake clock."""
    state, live, queue, ticks = (
        PolicyState(),
        settings.min_workers if workers is None else workers,
        0,
        [],
    )
    for step, arrived in enumerate(arrivals):
        queue += arrived
        done = min(queue, int(live * capacity_rps * STEP_S))
        queue -= done
        obs = Observation(
            now_s=step * STEP_S,
            workers=live,
            lag=queue,
            pending=0,
            rate_rps=done / STEP_S,
            capacity_rps=capacity_rps if live else None,
        )
        decision = desired_workers(obs, settings, state)
        ticks.append(Tick(obs.now_s, live, decision.workers, queue, arrived, decision.reason))
        live, state = decision.workers, decision.state
    return ticks


def changes(ticks: Sequence[Tick]) -> list[tuple[float, int]]:
    """(time, delta) of every decision that changed the count."""
    return [(t.now_s, t.decided - t.workers) for t in ticks if t.decided != t.workers]


def reversals(ticks: Sequence[Tick]) -> list[float]:
    """The times at which the count changed direction (up after down or down after up)."""
    moves = changes(ticks)
    return [now for (_, before), (now, after) in pairwise(moves) if (before > 0) != (after > 0)]


def assert_rules_held(ticks: Sequence[Tick], settings: PolicySettings = LAG) -> None:
    """Bounds, max_step, one-at-a-time downs and both cooldowns, over a whole trace."""
    assert all(settings.min_workers <= t.decided <= settings.max_workers for t in ticks)
    last_up, last_change = -math.inf, -math.inf
    for now_s, delta in changes(ticks):
        if delta > 0:
            assert delta <= settings.max_step and now_s - last_up >= settings.up_cooldown_s
            last_up = now_s
        else:
            assert delta == -1 and now_s - last_change >= settings.down_cooldown_s
        last_change = now_s


def obs(
    now_s: float = 0.0,
    workers: int = 1,
    lag: int | None = 0,
    pending: int = 0,
    rate_rps: float = 0.0,
    capacity_rps: float | None = CAPACITY_RPS,
) -> Observation:
    return Observation(now_s, workers, lag, pending, rate_rps, capacity_rps)


def run(
    observations: Sequence[Observation],
    settings: PolicySettings = LAG,
    state: PolicyState | None = None,
) -> list[Decision]:
    """Thread the state through a fixed sequence of observations."""
    decisions, state = [], state or PolicyState()
    for observation in observations:
        decisions.append(desired_workers(observation, settings, state))
        state = decisions[-1].state
    return decisions


def need(arrivals_rps: float, settings: PolicySettings = LAG) -> int:
    """The fleet the arrivals need at target utilization, inside the bounds."""
    wanted = math.ceil(arrivals_rps / (CAPACITY_RPS * settings.target_utilization))
    return min(max(wanted, settings.min_workers), settings.max_workers)


def noisy(mean: int, steps: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [round(mean * (1 + rng.uniform(-0.4, 0.4))) for _ in range(steps)]


# --------------------------------------------------------------------------- traces


def test_burst_scales_to_max_within_seconds_and_back_to_min_after_the_down_cooldown() -> None:
    ticks = simulate([5000] + [0] * 199)
    reached_max_s = next(t.now_s for t in ticks if t.decided == LAG.max_workers)
    drained_s = next(t.now_s for t in ticks if t.lag == 0)
    first_down_s = next(now for now, delta in changes(ticks) if delta < 0)
    assert reached_max_s <= 3
    assert drained_s <= 15  # one worker alone would need 50 s
    assert first_down_s >= drained_s + LAG.down_cooldown_s
    assert ticks[-1].decided == LAG.min_workers
    assert (
        next(t.now_s for t in ticks if t.now_s > drained_s and t.decided == 1) <= drained_s + 4 * 20
    )
    assert_rules_held(ticks)


def test_burst_drains_faster_than_the_article_rule_and_a_single_worker() -> None:
    def drained_s(settings: PolicySettings) -> float:
        return next(t.now_s for t in simulate([5000] + [0] * 199, settings) if t.lag == 0)

    fixed = PolicySettings(kind="fixed", min_workers=1, max_workers=1)
    assert drained_s(LAG) < drained_s(ARTICLE) < drained_s(fixed)


def test_a_large_burst_adds_max_step_workers_per_up_cooldown() -> None:
    settings = replace(LAG, max_workers=8)
    ups = [
        (now, delta) for now, delta in changes(simulate([20_000] + [0] * 30, settings)) if delta > 0
    ]
    assert ups == [(0.0, 2), (2.0, 2), (4.0, 2), (6.0, 1)]


def test_ramp_adds_workers_as_arrivals_rise_and_never_lets_a_queue_build() -> None:
    ticks = simulate([2 * step for step in range(176)])  # 0 -> 350 rps: past 3.5 workers' capacity
    assert all(t.decided == need(t.arrived) for t in ticks)
    assert [delta for _, delta in changes(ticks)] == [1, 1, 1]
    assert max(t.lag for t in ticks) == 0
    assert ticks[-1].decided == LAG.max_workers
    assert_rules_held(ticks)


def test_the_article_rule_lets_a_queue_build_on_the_same_ramp() -> None:
    ticks = simulate([2 * step for step in range(176)], ARTICLE)
    assert (
        max(t.lag for t in ticks) > 50
    )  # the article reacts only to a queue: the contrast above matters


def test_steady_load_settles_on_the_needed_count_and_stays() -> None:
    ticks = simulate([120] * 600)  # 120 rps: 2 workers at 60%, 1 cannot keep up
    assert [t.decided for t in ticks[:2]] == [2, 2]
    assert changes(ticks) == [(0.0, 1)]
    assert max(t.lag for t in ticks[2:]) == 0


@pytest.mark.parametrize("mean,allowed", [(120, {2, 3}), (60, {1, 2})])
@pytest.mark.parametrize("seed", [1, 7, 42])
def test_noisy_steady_load_does_not_flap(mean: int, allowed: set[int], seed: int) -> None:
    ticks = simulate(noisy(mean, 900, seed))
    turns = reversals(ticks)
    assert all(b - a >= LAG.down_cooldown_s for a, b in pairwise(turns))
    assert len(turns) <= 1  # +-40% noise around a steady mean: no oscillation at all
    assert {t.decided for t in ticks[5:]} <= allowed
    assert len(changes(ticks)) <= 3
    assert_rules_held(ticks)


@pytest.mark.parametrize("min_workers", [0, 1, 2])
def test_idle_stays_at_min(min_workers: int) -> None:
    settings = replace(LAG, min_workers=min_workers)
    assert {t.decided for t in simulate([0] * 300, settings)} == {min_workers}


def test_idle_from_max_steps_down_one_per_cooldown_to_min() -> None:
    ticks = simulate([0] * 120, workers=4)
    assert changes(ticks) == [(20.0, -1), (40.0, -1), (60.0, -1)]


# --------------------------------------------------------------------------- the lag rules


def test_scale_to_zero_and_back_up_on_the_first_queued_entry() -> None:
    settings = replace(LAG, min_workers=0)
    ticks = simulate([0] * 30 + [1] + [0] * 5, settings, workers=1)
    assert [t.decided for t in ticks[19:21]] == [1, 0]
    assert ticks[30].workers == 0 and ticks[30].decided == 1


def test_backlog_need_uses_the_drain_target() -> None:
    # 1200 queued, 100 rps per worker, drain in 5 s -> 3 workers.
    decision = desired_workers(
        obs(workers=1, lag=1000, pending=200), replace(LAG, max_step=4), PolicyState()
    )
    assert decision.workers == 3
    assert "backlog 1200 needs 3 workers to drain in 5 s" in decision.reason


def test_backlog_growth_counts_as_arrivals_when_the_fleet_is_saturated() -> None:
    # 2 workers flat out (200 rps) while the backlog grows 100/s: 300 rps arrive -> 4 workers.
    decisions = run(
        [obs(0.0, 2, 0, 0, 200.0), obs(1.0, 2, 100, 0, 200.0)], replace(LAG, up_cooldown_s=0)
    )
    assert [d.workers for d in decisions] == [3, 4]
    assert "arrivals ~300 rps" in decisions[1].reason


def test_capacity_falls_back_to_the_last_measured_then_to_the_default() -> None:
    backlog = obs(
        workers=1, lag=1000, capacity_rps=None
    )  # default 100 rps -> 2 workers to drain in 5 s
    assert desired_workers(backlog, LAG, PolicyState()).workers == 2
    measured = desired_workers(obs(workers=1, capacity_rps=25.0), LAG, PolicyState()).state
    assert (
        desired_workers(backlog, replace(LAG, max_step=4), measured).workers == 4
    )  # 25 rps -> 8, capped


@pytest.mark.parametrize("bad", [0.0, -5.0, math.nan, math.inf])
def test_a_nonsense_capacity_counts_as_unknown(bad: float) -> None:
    decision = desired_workers(obs(workers=1, lag=1000, capacity_rps=bad), LAG, PolicyState())
    assert decision.workers == 2  # the default, as with None


def test_up_cooldown_spaces_scale_ups() -> None:
    heavy = [obs(now, 1, 10_000) for now in (0.0, 1.0, 1.9, 2.0)]
    assert [d.workers for d in run(heavy)] == [3, 1, 1, 3]
    assert "up cooldown" in run(heavy)[1].reason


def test_down_cooldown_counts_from_any_change() -> None:
    state = PolicyState(last_up_s=100.0, last_change_s=100.0, first_observed_s=0.0)
    idle = [obs(now, 3) for now in (119.0, 119.9, 120.0)]
    decisions = run(idle, state=state)
    assert [d.workers for d in decisions] == [3, 3, 2]
    assert "down cooldown" in decisions[0].reason
    assert decisions[2].state.last_down_s == decisions[2].state.last_change_s == 120.0


def test_a_fresh_state_watches_arrivals_before_its_first_scale_down() -> None:
    decisions = run([obs(float(now), 3) for now in range(21)])
    assert [d.workers for d in decisions] == [3] * 20 + [2]
    assert "watching arrivals" in decisions[0].reason


def test_one_quiet_sample_after_heavy_load_cannot_trigger_a_scale_down() -> None:
    busy = [obs(float(now), 4, 0, 0, 300.0) for now in range(30)]
    quiet = [obs(float(now), 4) for now in range(30, 30 + int(LAG.down_cooldown_s))]
    workers = [d.workers for d in run(busy + quiet)]
    assert workers[:-1] == [4] * (len(workers) - 1)  # while the 20 s window holds a 300 rps sample
    assert workers[-1] == 3  # the first time it holds only quiet ones


@pytest.mark.parametrize("rate_rps,expected", [(80.0, 2), (81.0, 3)])
def test_hysteresis_shrinks_only_if_the_smaller_fleet_is_at_most_down_utilization_busy(
    rate_rps: float, expected: int
) -> None:
    history = [obs(float(now), 3, 0, 0, rate_rps) for now in range(21)]
    assert run(history)[-1].workers == expected  # 2 workers at 80 rps are exactly 40% busy


@pytest.mark.parametrize("lag,expected", [(400, 2), (401, 3)])
def test_a_scale_down_needs_a_backlog_the_smaller_fleet_drains_easily(
    lag: int, expected: int
) -> None:
    history = [obs(float(now), 3, lag) for now in range(21)]
    assert run(history)[-1].workers == expected  # 2 * 100 rps * 5 s * 40% = 400


def test_unknown_lag_never_scales_down() -> None:
    unknown = [obs(float(now), 3, lag=None) for now in range(300)]
    decisions = run(unknown)
    assert {d.workers for d in decisions} == {3}
    assert "lag unknown" in decisions[-1].reason


def test_unknown_lag_scales_up_on_pending_only() -> None:
    assert desired_workers(obs(workers=1, lag=None, pending=1000), LAG, PolicyState()).workers == 2
    assert desired_workers(obs(workers=1, lag=None, pending=0), LAG, PolicyState()).workers == 1


def test_unknown_lag_is_not_read_as_a_drop_to_zero_backlog() -> None:
    # Backlog 5000, then unknown, then 5000 again: no phantom growth of 5000/s in between.
    trace = [obs(0.0, 4, 5000), obs(1.0, 4, None), obs(2.0, 4, 5000)]
    decisions = run(trace, replace(LAG, max_workers=64, max_step=64))
    assert decisions[2].workers == 10  # backlog 5000 at 500 per worker; growth would ask for 67


def test_a_fleet_outside_the_bounds_is_brought_inside_at_once() -> None:
    settings = replace(LAG, min_workers=4, max_workers=6, max_step=1)
    in_cooldown = PolicyState(last_up_s=0.0, last_change_s=0.0)
    assert desired_workers(obs(0.5, workers=0), settings, in_cooldown).workers == 4
    assert desired_workers(obs(0.5, workers=9, lag=None), settings, in_cooldown).workers == 6


def test_a_decision_records_its_change_in_the_state() -> None:
    decision = desired_workers(obs(7.0, workers=1, lag=5000), LAG, PolicyState())
    assert (
        decision.state.last_up_s,
        decision.state.last_change_s,
        decision.state.last_decision_s,
    ) == (7.0, 7.0, 7.0)
    assert decision.state.last_down_s == -math.inf
    assert decision.state.arrivals == ((7.0, 0.0),) and decision.state.last_backlog == 5000


def test_the_arrival_history_keeps_only_the_peak_window() -> None:
    window_s = max(LAG.down_cooldown_s, MIN_PEAK_WINDOW_S)
    state = run([obs(float(now), 2, 0, 0, 10.0) for now in range(100)])[-1].state
    assert [t for t, _ in state.arrivals] == [float(now) for now in range(100 - int(window_s), 100)]


# --------------------------------------------------------------------------- article and fixed


@pytest.mark.parametrize("lag,expected", [(101, 3), (100, 2), (20, 2), (19, 1)])
def test_article_moves_one_on_the_average_queue_per_worker(lag: int, expected: int) -> None:
    assert desired_workers(obs(workers=2, lag=lag), ARTICLE, PolicyState()).workers == expected


def test_article_ignores_pending_and_reads_unknown_lag_as_zero() -> None:
    assert (
        desired_workers(obs(workers=2, lag=0, pending=10_000), ARTICLE, PolicyState()).workers == 1
    )
    assert desired_workers(obs(workers=2, lag=None), ARTICLE, PolicyState()).workers == 1


def test_article_decides_at_most_every_interval() -> None:
    decisions = run([obs(float(now), 1, 100_000) for now in range(11)], ARTICLE)
    assert [d.workers for d in decisions] == [2] + [1] * 4 + [2] + [1] * 4 + [2]
    assert decisions[4].state.last_decision_s == 0.0


def test_article_stays_inside_the_bounds() -> None:
    assert desired_workers(obs(workers=4, lag=100_000), ARTICLE, PolicyState()).workers == 4
    assert desired_workers(obs(workers=1, lag=0), ARTICLE, PolicyState()).workers == 1


def test_article_burst_steps_one_worker_per_interval() -> None:
    ups = [
        (now, delta) for now, delta in changes(simulate([5000] + [0] * 60, ARTICLE)) if delta > 0
    ]
    assert ups == [(0.0, 1), (5.0, 1), (10.0, 1)]


@pytest.mark.parametrize("min_workers,max_workers", [(1, 1), (2, 4)])
def test_fixed_always_answers_min_workers(min_workers: int, max_workers: int) -> None:
    settings = PolicySettings(kind="fixed", min_workers=min_workers, max_workers=max_workers)
    for observation in (obs(workers=3, lag=100_000), obs(workers=0), obs(workers=9, lag=None)):
        assert desired_workers(observation, settings, PolicyState()).workers == min_workers


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "changes_,field,allowed",
    [
        ({"kind": "fast"}, "kind", "target, lag, article, keda, fixed"),
        ({"min_workers": -1}, "min_workers", "from 0"),
        ({"max_workers": 0}, "max_workers", "from 1"),
        ({"max_workers": 2.5}, "max_workers", "an int"),
        ({"max_workers": True}, "max_workers", "an int"),
        ({"min_workers": 5, "max_workers": 4}, "min_workers", "at most max_workers"),
        ({"max_step": 0}, "max_step", "from 1"),
        ({"target_drain_s": 0}, "target_drain_s", "(0,"),
        ({"target_utilization": 1.5}, "target_utilization", "(0, 1]"),
        ({"target_utilization": math.nan}, "target_utilization", "(0, 1]"),
        ({"down_utilization": 0.75}, "down_utilization", "target_utilization=0.75)"),
        ({"down_utilization": 0}, "down_utilization", "(0,"),
        ({"up_cooldown_s": -1}, "up_cooldown_s", "[0,"),
        ({"down_cooldown_s": math.inf}, "down_cooldown_s", "[0,"),
        ({"default_capacity_rps": 0}, "default_capacity_rps", "(0,"),
        ({"article_up_queue": 10}, "article_up_queue", "(article_down_queue=10,"),
        ({"article_down_queue": -1}, "article_down_queue", "[0,"),
        ({"article_interval_s": "5"}, "article_interval_s", "[0,"),
    ],
)
def test_settings_errors_name_the_field_and_what_is_allowed(
    changes_: dict[str, Any], field: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        PolicySettings(**changes_)
    assert str(info.value).startswith(field) and allowed in str(info.value)


def test_default_settings_are_valid_and_match_the_documented_values() -> None:
    settings = PolicySettings()
    assert (settings.kind, settings.min_workers, settings.max_workers, settings.max_step) == (
        "lag",
        1,
        4,
        2,
    )
    assert (settings.up_cooldown_s, settings.down_cooldown_s, settings.default_capacity_rps) == (
        2.0,
        20.0,
        500.0,
    )


@pytest.mark.parametrize(
    "changes_,field",
    [
        ({"workers": -1}, "workers"),
        ({"lag": -1}, "lag"),
        ({"pending": 1.5}, "pending"),
        ({"rate_rps": math.nan}, "rate_rps"),
        ({"rate_rps": -1.0}, "rate_rps"),
        ({"now_s": math.inf}, "now_s"),
    ],
)
def test_observation_errors_name_the_field(changes_: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        replace(obs(), **changes_)


# --------------------------------------------------------------------------- properties


@st.composite
def policy_settings(draw: st.DrawFn) -> PolicySettings:
    max_workers = draw(st.integers(1, 12))
    target = draw(st.floats(0.05, 1.0))
    return PolicySettings(
        kind=draw(st.sampled_from(["lag", "lag", "article", "fixed"])),
        min_workers=draw(st.integers(0, max_workers)),
        max_workers=max_workers,
        target_drain_s=draw(st.floats(0.1, 60)),
        target_utilization=target,
        down_utilization=target * draw(st.floats(0.01, 0.99)),
        up_cooldown_s=draw(st.floats(0, 30)),
        down_cooldown_s=draw(st.floats(0, 60)),
        max_step=draw(st.integers(1, 4)),
        default_capacity_rps=draw(st.floats(0.001, 1e4)),
    )


capacities = st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.floats(0.001, 1e4)
counts = st.integers(0, 10**7)
times = st.just(-math.inf) | st.floats(0, 1000)


@st.composite
def observations(draw: st.DrawFn, now_s: float | None = None) -> Observation:
    return Observation(
        now_s=draw(st.floats(0, 1000)) if now_s is None else now_s,
        workers=draw(st.integers(0, 16)),
        lag=draw(st.none() | counts),
        pending=draw(counts),
        rate_rps=draw(st.floats(0, 1e6)),
        capacity_rps=draw(capacities),
    )


@st.composite
def states(draw: st.DrawFn) -> PolicyState:
    samples = draw(st.lists(st.tuples(st.floats(0, 1000), st.floats(0, 1e6)), max_size=30))
    return PolicyState(
        last_up_s=draw(times),
        last_down_s=draw(times),
        last_change_s=draw(times),
        last_decision_s=draw(times),
        first_observed_s=draw(st.none() | st.floats(0, 1000)),
        last_observed_s=draw(times),
        last_backlog=draw(st.none() | counts),
        capacity_rps=draw(capacities),
        arrivals=tuple(sorted(samples)),
    )


def assert_decision_allowed(
    observation: Observation, settings: PolicySettings, state: PolicyState, decision: Decision
) -> None:
    """Bounds always; inside them, max_step and the cooldowns of the lag policy."""
    before, after = observation.workers, decision.workers
    assert settings.min_workers <= after <= settings.max_workers and decision.reason
    if settings.kind == "fixed":
        assert after == settings.min_workers
    if settings.kind == "fixed" or not settings.min_workers <= before <= settings.max_workers:
        return
    assert abs(after - before) <= settings.max_step
    if settings.kind == "lag" and after > before:
        assert observation.now_s - state.last_up_s >= settings.up_cooldown_s
    if settings.kind == "lag" and after < before:
        assert observation.lag is not None and after == before - 1
        assert observation.now_s - state.last_change_s >= settings.down_cooldown_s


@hypothesis_settings(max_examples=300, deadline=None)
@given(observation=observations(), settings=policy_settings(), state=states())
def test_any_observation_gives_an_allowed_decision(
    observation: Observation, settings: PolicySettings, state: PolicyState
) -> None:
    assert_decision_allowed(
        observation, settings, state, desired_workers(observation, settings, state)
    )


@hypothesis_settings(max_examples=100, deadline=None)
@given(settings=policy_settings(), data=st.data())
def test_a_trace_threading_its_own_state_keeps_every_rule(
    settings: PolicySettings, data: st.DataObject
) -> None:
    state, now_s = PolicyState(), 0.0
    for _ in range(data.draw(st.integers(1, 40))):
        now_s += data.draw(st.sampled_from([0.1, 0.5, 1.0, 1.0, 3.0]))
        observation = data.draw(observations(now_s=now_s))
        decision = desired_workers(observation, settings, state)
        assert_decision_allowed(observation, settings, state, decision)
        assert len(decision.state.arrivals) <= 256
        state = decision.state


def test_restart_backoff_doubles_forgets_old_deaths_and_stops_a_crash_loop() -> None:
    deaths: deque[float] = deque()
    kw = {"window_s": 60.0, "max_deaths": 3, "first_s": 1.0, "most_s": 30.0}
    assert restart_backoff(deaths, 0.0, **kw) == 1.0
    assert restart_backoff(deaths, 1.0, **kw) == 2.0
    assert restart_backoff(deaths, 100.0, **kw) == 1.0  # the two old deaths left the window
    assert restart_backoff(deaths, 101.0, **kw) == 2.0
    assert restart_backoff(deaths, 102.0, **kw) is None  # three within 60 s: a crash loop
    capped = {**kw, "max_deaths": 100, "most_s": 5.0}
    many: deque[float] = deque()
    waits = [restart_backoff(many, float(t), **capped) for t in range(6)]
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


# --------------------------------------------------------------------------- pinned by the mutation
# run (issue 35, docs/benchmarks.md): each rule below had a mutant that no test told apart


def test_the_backlogs_growth_is_per_second_since_the_previous_observation() -> None:
    settings = replace(LAG, max_workers=64)
    _, state = observe_load(obs(100.0, 2, 0, 0, 200.0), settings, PolicyState())
    load, state = observe_load(obs(102.0, 2, 600, 0, 200.0), settings, state)
    assert load.arrivals_rps == 200.0 + 300.0  # 600 more queued over 2 s
    assert load.observed_s == 2.0  # since the first observation, not the epoch


def test_a_sample_at_the_same_instant_replaces_the_one_before() -> None:
    assert recent(((4.0, 7.0), (5.0, 100.0)), 5.0, 1.0, 10.0) == ((4.0, 7.0), (5.0, 1.0))
    assert recent(((4.0, 7.0),), 14.0, 1.0, 10.0) == ((14.0, 1.0),)  # 10 s old: out


@pytest.mark.parametrize(
    ("amount", "per_worker", "workers"),
    [
        (0.0, 0.0, 0),  # nothing to do needs nobody, whatever the capacity
        (1.0, 0.0, 1 << 30),  # something with no capacity: more than any fleet
        (1e40, 1.0, 1 << 30),
        (1.0, 0.5, 2),  # a worker slower than one a second still counts
        (300.0, 100.0, 3),
        (300.0000000001, 100.0, 3),  # float noise does not buy a worker
        (1e-12, 1.0, 0),
    ],
)
def test_ceil_div_is_a_worker_count(amount: float, per_worker: float, workers: int) -> None:
    assert ceil_div(amount, per_worker) == workers


@pytest.mark.parametrize(
    ("value", "kept"),
    [(0.5, 0.5), (1.0, 1.0), (0.0, None), (-1.0, None), (math.inf, None), (None, None)],
)
def test_a_capacity_is_known_when_finite_and_positive_even_below_one(
    value: float | None, kept: float | None
) -> None:
    assert positive(value) == kept


def test_a_slow_model_under_one_request_a_second_is_measured_not_defaulted() -> None:
    decision = desired_workers(obs(workers=1, lag=10, capacity_rps=0.5), LAG, PolicyState())
    assert decision.state.capacity_rps == 0.5
    assert decision.workers == 3  # 10 queued need 4 at 0.5 rps in 5 s: 1 + max_step 2 now


def test_a_clamped_decision_says_so_after_its_reason() -> None:
    settings = replace(LAG, min_workers=4, max_workers=6, max_step=1)
    decision = desired_workers(obs(0.5, workers=0), settings, PolicyState())
    assert decision.reason.endswith("; clamped 1 to 4 in [4, 6]")
    assert decision.reason.startswith("up 1: ")
    assert "clamped" not in desired_workers(obs(0.5, workers=4), settings, PolicyState()).reason


def test_a_hold_records_no_change() -> None:
    state = PolicyState(last_up_s=1.0, last_down_s=2.0, last_change_s=2.0, first_observed_s=0.0)
    decision = desired_workers(obs(3.0, workers=2, lag=150, rate_rps=100.0), LAG, state)
    assert decision.workers == 2
    assert (decision.state.last_up_s, decision.state.last_down_s) == (1.0, 2.0)
    assert decision.state.last_change_s == 2.0


def test_a_light_load_still_shrinks_the_fleet_to_one_worker() -> None:
    state = PolicyState(first_observed_s=0.0)
    decision = desired_workers(obs(100.0, workers=2, rate_rps=10.0), LAG, state)
    assert decision.workers == 1, decision.reason


def test_article_reads_the_queue_of_one_worker_or_none_as_the_whole_lag() -> None:
    for workers in (0, 1):  # 80 queued: over the 50 a worker that sends one more
        up = desired_workers(obs(workers=workers, lag=80), ARTICLE, PolicyState())
        assert up.workers == workers + 1


def test_article_reads_unknown_lag_as_zero_not_one() -> None:
    settings = replace(ARTICLE, article_down_queue=0.4)
    assert desired_workers(obs(workers=2, lag=None), settings, PolicyState()).workers == 1


def test_article_steps_down_one_worker_at_a_time() -> None:
    assert desired_workers(obs(workers=4, lag=0), ARTICLE, PolicyState()).workers == 3


WATCHED = PolicyState(first_observed_s=0.0)  # observing long enough to scale down


@pytest.mark.parametrize(
    ("observation", "state", "reason"),
    [
        (
            obs(100.0, 2, rate_rps=150.0),
            WATCHED,
            "steady: arrivals ~150 rps need 2 workers at 75% of 100 rps each",
        ),
        (obs(100.0, 1), WATCHED, "steady: arrivals ~0 rps need 0 workers at 75% of 100 rps each"),
        (
            obs(100.0, 4, rate_rps=400.0),
            WATCHED,
            "at max_workers 4: arrivals ~400 rps need 6 workers at 75% of 100 rps each",
        ),
        (
            obs(100.0, 4, rate_rps=250.0),  # at max_workers, but they are enough
            WATCHED,
            "steady: arrivals ~250 rps need 4 workers at 75% of 100 rps each",
        ),
        (
            obs(100.0, 1, lag=None, pending=500),
            WATCHED,
            "steady: pending (lag unknown) 500 needs 1 workers to drain in 5 s",
        ),
        (obs(100.0, 1, lag=1), WATCHED, "steady: backlog 1 needs 1 workers to drain in 5 s"),
        (
            obs(100.0, 1, lag=10, rate_rps=75.0),  # both needs 1: the backlog is named
            WATCHED,
            "steady: backlog 10 needs 1 workers to drain in 5 s",
        ),
        (obs(100.0, 3, lag=None), WATCHED, "hold: lag unknown, never scaling down on it"),
        (
            obs(100.0, 4, rate_rps=81.0),
            WATCHED,
            "down 1: 3 workers would be 27% busy at peak ~81 rps (<= 40%), backlog 0",
        ),
        (
            obs(100.0, 2, rate_rps=50.0),  # the peak 5 s ago still needs both: no down at all
            replace(WATCHED, arrivals=((95.0, 150.0),)),
            "steady: arrivals ~50 rps need 1 workers at 75% of 100 rps each",
        ),
    ],
    ids=[
        "steady",
        "idle",
        "at-max",
        "at-max-enough",
        "lag-unknown",
        "backlog-1",
        "tie",
        "lag-unknown-down",
        "down",
        "peak-holds",
    ],
)
def test_a_decision_says_why_in_the_words_status_shows(
    observation: Observation, state: PolicyState, reason: str
) -> None:
    assert desired_workers(observation, LAG, state).reason == reason
