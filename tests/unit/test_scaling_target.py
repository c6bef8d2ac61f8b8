"""The target policy, KEDA's rule, the replayer and the traces: pure, on a fake clock."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from inferfleet.worker.fleet import traces
from inferfleet.worker.fleet.replay import ServiceModel, replay
from inferfleet.worker.fleet.scaling import (
    Observation,
    PolicySettings,
    PolicyState,
    desired_workers,
)
from inferfleet.worker.fleet.scaling_target import (
    SURGE_MEMORY_S,
    fewest_meeting,
    fewest_near_best,
    full_batch_capacity,
)
from inferfleet.worker.fleet.waits import Fleet

SERVICE = ServiceModel(batch_s=0.05, max_rows=4, warm_s=5.0)  # 80 rps a worker
TARGET = PolicySettings(kind="target", min_workers=1, max_workers=8, default_capacity_rps=80.0)
KEDA = PolicySettings(kind="keda", min_workers=1, max_workers=16, keda_lag_count=10.0)


def seen(now_s: float, workers: int, **changes: object) -> Observation:
    values: dict[str, object] = {
        "now_s": now_s,
        "workers": workers,
        "lag": 0,
        "pending": 0,
        "rate_rps": 0.0,
        "capacity_rps": 80.0,
        "ready": workers,
        "warm_s": 5.0,
        "service_s": 0.05,
    }
    values.update(changes)
    return Observation(**values)  # type: ignore[arg-type]


def run(observations: list[Observation], settings: PolicySettings) -> list[int]:
    """Each observation's decision, the observations taken as they are (workers included)."""
    state, decided = PolicyState(), []
    for obs in observations:
        decision = desired_workers(obs, settings, state)
        state = decision.state
        decided.append(decision.workers)
    return decided


def follow(settings: PolicySettings, workers: int, seconds: int, **load: object) -> list[int]:
    """Decisions when each one is applied: the next observation sees the fleet it asked for."""
    state, decided = PolicyState(), []
    for t in range(1, seconds + 1):
        obs = seen(t, workers, **{"ready": workers, **load})
        decision = desired_workers(obs, settings, state)
        state, workers = decision.state, decision.workers
        decided.append(workers)
    return decided


# --------------------------------------------------------------------------- target


def test_a_flash_crowd_gets_the_predicted_fleet_at_once_not_a_step_at_a_time() -> None:
    calm = [seen(t, 1, rate_rps=40.0) for t in range(1, 30)]
    crowd = seen(30, 1, rate_rps=80.0, lag=400)  # 400 queued: the one worker is flat out
    decided = run([*calm, crowd], TARGET)
    assert set(decided[:-1]) == {1}
    assert decided[-1] >= 4  # 400 queued + 80 rps more than one worker serves: several at once


def test_a_longer_warm_up_asks_for_more_workers_on_the_same_rising_load() -> None:
    def rising(warm_s: float) -> int:
        obs = [seen(t, 3, rate_rps=100.0 + 8.0 * t, warm_s=warm_s) for t in range(1, 12)]
        return run(obs, TARGET)[-1]

    assert rising(20.0) > rising(1.0)


def test_a_tighter_deadline_than_the_target_asks_for_more_workers() -> None:
    plain = follow(TARGET, 4, 10, rate_rps=300.0)[-1]
    tight = follow(TARGET, 4, 10, rate_rps=300.0, deadline_s=0.11)[-1]
    assert tight > plain


def test_it_shrinks_after_the_cooldown_and_never_while_the_lag_is_unknown() -> None:
    decided = follow(TARGET, 6, 90, rate_rps=40.0)
    assert decided[5] == 6  # the down cooldown and the watching window come first
    assert decided[-1] == 1 and decided == sorted(decided, reverse=True)
    unknown = [seen(t, 6, rate_rps=40.0, lag=None) for t in range(1, 60)]
    assert set(run(unknown, TARGET)) == {6}


def test_scaled_to_zero_it_wakes_for_one_waiting_request() -> None:
    zero = replace(TARGET, min_workers=0, down_cooldown_s=5.0)
    assert follow(zero, 1, 40, capacity_rps=None)[-1] == 0
    woken = run([*[seen(t, 0, ready=0) for t in range(1, 10)], seen(10, 0, lag=1, ready=0)], zero)
    assert woken[-2] == 0 and woken[-1] == 1


def test_capacity_at_full_batches_is_fitted_from_the_batch_sizes_seen() -> None:
    constant = tuple((float(t), rows, 0.05) for t, rows in enumerate([1.0, 2.0, 3.0, 1.5]))
    assert full_batch_capacity(constant, 4) == pytest.approx(80.0)
    linear = tuple((float(t), rows, 0.01 * rows) for t, rows in enumerate([1.0, 2.0, 3.0]))
    assert full_batch_capacity(linear, 8) == pytest.approx(100.0)
    one_size = tuple((float(t), 2.0, 0.05) for t in range(5))
    assert full_batch_capacity(one_size, 4) is None
    assert full_batch_capacity(constant, None) is None


def test_one_noisy_second_of_arrivals_buys_fewer_workers_than_the_same_rate_held() -> None:
    calm = [seen(t, 4, rate_rps=240.0) for t in range(1, 20)]
    spike = run([*calm, seen(20, 4, rate_rps=420.0)], TARGET)[-1]
    held = max(run([*calm, *[seen(t, 4, rate_rps=420.0) for t in range(20, 24)]], TARGET))
    assert spike < held  # the mean of the last seconds, not the last second alone


def test_a_backlog_the_warm_up_makes_late_anyway_buys_a_seconds_recovery_not_every_worker():
    # 1 of 2 workers ready, 115 rps arriving: 208 queued by the time new workers are warm
    fleet = Fleet(
        arrivals_rps=115.0, capacity_rps=80.0, backlog=33, ready=1, warm_s=5.0, service_s=0.05
    )
    assert fewest_meeting(fleet, 0.2, TARGET) is None
    assert fewest_near_best(fleet, TARGET) == 5  # (208 / RECOVER_S + 115) / 80 -> 5, not 8


def test_after_a_burst_it_keeps_the_workers_to_absorb_it_again_for_the_memory_then_shrinks():
    def shrinks_to(burst_rps: float) -> list[int]:
        state, workers, decided = PolicyState(), 6, []
        rates = [80.0] * 20 + [burst_rps] * 20 + [80.0] * int(SURGE_MEMORY_S + 60)
        for t, rate in enumerate(rates, 1):
            decision = desired_workers(seen(t, workers, rate_rps=rate), TARGET, state)
            state, workers = decision.state, decision.workers
            decided.append(workers)
        return decided[40:]  # from the burst's end on

    calm = shrinks_to(80.0)
    burst = shrinks_to(400.0)
    remembered = burst[: int(SURGE_MEMORY_S) - 30]
    assert min(calm) == calm[-1] == 2  # no burst: down to what 80 rps needs
    assert min(remembered) >= 5  # 400 rps again would be absorbed while others warm up
    assert burst[-1] == 2  # forgotten after SURGE_MEMORY_S


def test_it_holds_when_no_fleet_meets_the_target_at_the_most_workers() -> None:
    decision = desired_workers(seen(1, 8, rate_rps=2000.0, lag=5000), TARGET, PolicyState())
    assert decision.workers == 8 and "no fleet up to 8" in decision.reason


# --------------------------------------------------------------------------- keda


def test_keda_decides_every_sync_period_on_lag_over_lag_count() -> None:
    obs = [seen(t, 1, lag=100) for t in range(0, 31)]
    decided = run(obs, KEDA)
    assert decided[0] == 5  # up at most max(2x, x + 4) from 1
    assert set(decided[1:15]) == {1}  # obs.workers stays 1 here: no new sync before 15 s
    assert decided[15] == 5 and decided[30] == 5


def test_keda_scales_down_only_to_the_most_it_proposed_over_its_window() -> None:
    settings = replace(KEDA, keda_down_window_s=60.0)
    busy = [seen(t, 10, lag=100) for t in (0, 15)]
    quiet = [seen(t, 10, lag=0) for t in range(30, 121, 15)]
    decided = run([*busy, *quiet], settings)
    assert decided[2:5] == [10, 10, 10]  # within 60 s of lag 100
    assert decided[-1] == 1


def test_keda_ignores_a_change_within_its_tolerance() -> None:
    assert run([seen(0, 10, lag=105)], KEDA) == [10]  # 11 is within 10% of 10


# --------------------------------------------------------------------------- the replayer


def test_a_lone_worker_answers_spaced_requests_in_one_batch_time() -> None:
    times = np.arange(0.0, 10.0, 0.2)
    fixed = PolicySettings(kind="fixed", min_workers=1, max_workers=1)
    result = replay(times, fixed, SERVICE, seconds=10.0)
    assert np.allclose(result.latencies_s, 0.05)
    assert result.worker_s == pytest.approx(10.0)


def test_a_worker_asked_for_serves_after_its_warm_up_and_is_paid_for_from_the_ask() -> None:
    times = np.linspace(0.0, 20.0, 2001)  # 100 rps: more than one worker's 80
    fixed = PolicySettings(kind="fixed", min_workers=2, max_workers=2)
    result = replay(times, fixed, SERVICE, workers=1, seconds=20.0)
    assert result.ticks[0].decided == 2 and result.scale_events == 1
    end_s = result.ticks[-1].now_s  # past 20 s while the queue drains
    assert result.worker_s == pytest.approx(end_s + end_s - 1.0)  # the second one from 1 s
    late = result.latencies_s[times < 6.0].max()
    assert late > 0.5  # the queue grew while the second worker warmed up
    assert result.latencies_s[times > 15.0].max() < 0.2


@pytest.mark.parametrize("trace", ["diurnal", "flash", "ramp"])
def test_the_target_policy_meets_its_target_on_each_trace_for_less_than_the_lag_policy(
    trace: str,
) -> None:
    times = traces.arrivals(traces.rate_of(trace, 600.0, 400.0), 600.0, seed=5)
    target = replay(times, TARGET, SERVICE, seconds=600.0).summary(0.2)
    lag = replay(times, replace(TARGET, kind="lag"), SERVICE, seconds=600.0).summary(0.2)
    assert target["over_target"] <= 0.01
    assert target["worker_s"] < lag["worker_s"]


# --------------------------------------------------------------------------- traces


def test_a_trace_is_the_same_for_a_seed_and_follows_its_rate() -> None:
    rate = traces.rate_of("flash", 100.0, 200.0)
    first, again = traces.arrivals(rate, 100.0, seed=7), traces.arrivals(rate, 100.0, seed=7)
    assert np.array_equal(first, again) and np.all(np.diff(first) >= 0)
    per_second = traces.rates_per_second(first, 100.0)
    assert per_second[:20].mean() == pytest.approx(20.0, rel=0.25)  # the base: a tenth
    assert per_second[60:80].mean() == pytest.approx(200.0, rel=0.1)  # the crowd


def test_the_diurnal_day_has_a_night_trough_and_two_peaks() -> None:
    rate = traces.rate_of("diurnal", 240.0, 100.0)
    hourly = [rate(10.0 * h) for h in range(24)]
    assert min(hourly) == hourly[min(range(24), key=lambda h: hourly[h])] < 15
    assert hourly.index(max(hourly)) in (20, 21) and 55 < hourly[11] < 75


def test_a_trace_file_is_read_with_comments_and_its_errors_name_the_line(tmp_path: Path) -> None:
    good = tmp_path / "trace.txt"
    good.write_text("# arrivals\n1700000002.5\n1700000001.0\n\n1700000001.5  # late\n")
    assert traces.read_trace_file(good).tolist() == [0.0, 0.5, 1.5]
    bad = tmp_path / "bad.txt"
    bad.write_text("1.0\nsoon\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: 'soon'"):
        traces.read_trace_file(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no arrival times"):
        traces.read_trace_file(empty)
    with pytest.raises(ValueError, match="unknown trace 'weekly'"):
        traces.rate_of("weekly", 10.0, 10.0)
