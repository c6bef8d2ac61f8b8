"""inferfleet.worker.fleet.waits: the target policy's latency model, held against the replayer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferfleet.worker.fleet import traces
from inferfleet.worker.fleet.replay import ServiceModel, replay
from inferfleet.worker.fleet.scaling import PolicySettings
from inferfleet.worker.fleet.waits import (
    Fleet,
    backlog_wait_s,
    erlang_c,
    predicted_p99_s,
    steady_p99_wait_s,
)

SERVICE = ServiceModel(batch_s=0.05, max_rows=4, warm_s=5.0)  # 80 rps a worker


def fleet(**changes: float) -> Fleet:
    values = {
        "arrivals_rps": 0.0,
        "capacity_rps": 80.0,
        "backlog": 0,
        "ready": 1,
        "warm_s": 5.0,
        "service_s": 0.05,
    }
    values.update(changes)
    return Fleet(**values)  # type: ignore[arg-type]


def test_erlang_c_matches_the_textbook_values() -> None:
    # M/M/1: the chance to wait is the utilization; M/M/2 at 1 erlang: 1/3
    assert erlang_c(1, 0.5) == pytest.approx(0.5)
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 0.0) == 0.0 and erlang_c(3, 3.0) == 1.0
    assert 0 < erlang_c(4000, 3900.0) < 1  # the recursion stays finite for big fleets


def test_a_fleet_that_cannot_keep_up_waits_forever() -> None:
    assert predicted_p99_s(fleet(arrivals_rps=160.0), 2) == math.inf
    assert predicted_p99_s(fleet(arrivals_rps=0.0, backlog=5), 0) == math.inf
    assert predicted_p99_s(fleet(), 0) == 0.0  # nothing to do: no worker is fine


def test_an_idle_fleet_answers_in_one_batch() -> None:
    assert predicted_p99_s(fleet(arrivals_rps=1.0), 3) == pytest.approx(0.05)


def test_the_backlog_drains_at_the_warm_workers_pace_until_the_new_ones_are_warm() -> None:
    # 800 queued, one warm worker (80 rps) and no arrivals: alone it takes 10 s
    assert backlog_wait_s(fleet(backlog=800), 1) == pytest.approx(10.0)
    # three more after 5 s: 400 served by then, the other 400 at 320 rps take 1.25 s more
    assert backlog_wait_s(fleet(backlog=800), 4) == pytest.approx(6.25)
    # from zero workers: nothing is served before the first one is warm
    assert backlog_wait_s(fleet(backlog=80, ready=0), 1) == pytest.approx(6.0)


def test_while_the_new_workers_warm_up_the_queue_grows_and_its_last_request_waits_longest() -> None:
    # one warm worker at 80 rps, 120 rps arriving, two more workers warm at 5 s: by then 400
    # were served, so the 400th request (arriving at 3.33 s) is served at 5 s, the longest wait
    wait = backlog_wait_s(fleet(arrivals_rps=120.0), 3)
    assert wait == pytest.approx(5.0 - 400 / 120, rel=1e-6)
    # had they been warm at once, nobody would wait for the backlog
    assert backlog_wait_s(fleet(arrivals_rps=120.0, ready=3), 3) == 0.0


def test_the_steady_wait_grows_with_the_utilization() -> None:
    waits = [steady_p99_wait_s(fleet(arrivals_rps=80.0 * 4 * u), 4) for u in (0.2, 0.7, 0.9, 0.97)]
    assert waits == sorted(waits) and waits[0] == 0.0 and waits[-1] > 0.2


@pytest.mark.parametrize("workers", [1, 2, 4, 6])
@pytest.mark.parametrize("utilization", [0.5, 0.8, 0.9])  # 0.95: too noisy a tail in 150 s
def test_the_prediction_is_near_the_simulated_fleets_p99_and_rarely_below(
    workers: int, utilization: float
) -> None:
    rate = utilization * SERVICE.capacity_rps * workers
    times = traces.arrivals(lambda t: rate, 150.0, seed=3)
    settings = PolicySettings(kind="fixed", min_workers=workers, max_workers=workers)
    result = replay(times, settings, SERVICE, workers=workers, seconds=150.0)
    simulated = float(np.percentile(result.latencies_s[len(times) // 10 :], 99))
    predicted = predicted_p99_s(fleet(arrivals_rps=rate, ready=workers), workers)
    # within 15% below (the tail of a batching fleet is not quite M/D/c) and at most 1.8x above
    assert 0.85 * simulated <= predicted <= 1.8 * simulated, (simulated, predicted)
