"""One consumer's counters: totals, windows as differences of snapshots, the Prometheus feed,
heartbeat rates."""

from __future__ import annotations

from dataclasses import dataclass

import fakeredis
import pytest
from prometheus_client import CollectorRegistry

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.counters import Counters, Tally
from inferfleet.worker.heartbeat import Heartbeat, read_heartbeats
from inferfleet.worker.metrics import WorkerMetrics
from inferfleet.worker.serving.intake import Answer


@dataclass
class Picked:
    enqueued_ms: int
    picked_ms: float


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"queue": "q", **labels})


def test_totals_only_grow_and_a_window_is_a_difference_of_snapshots():
    counters = Counters()
    counters.answered(10, 2)
    counters.batch_computed([Picked(0, 1.0)] * 4, 7, 0.01)
    start = counters.snapshot()
    counters.answered(5, 1)
    counters.batch_computed([Picked(0, 1.0)] * 5, 5, 0.01)
    counters.batch_computed([Picked(0, 1.0)], 3, 0.01)
    counters.replies_skipped(2)
    counters.busy(0.25)
    assert counters.snapshot() == Tally(
        requests=15, batches=3, rows=15, errors=3, skipped=2, busy_s=0.25
    )
    assert counters.snapshot() - start == Tally(
        requests=5, batches=2, rows=8, errors=1, skipped=2, busy_s=0.25
    )
    assert counters.snapshot() - counters.snapshot() == Tally()


def test_counts_reach_prometheus_as_they_happen():
    registry = CollectorRegistry()
    counters = Counters(WorkerMetrics("q", registry))
    counters.batch_computed([Picked(1000, 1000.5), Picked(1000, 1002.0)], 3, 0.004)
    ok = Answer(b"1-0", "k", b"reply", True, rid="a")
    bad = Answer(b"2-0", "k", b"e", rid="b", code="bad_request")
    counters.replied([ok, bad, ok], failed=[2])
    counters.cache_looked_up(10, local=3, fleet=2, duplicates=1, unique=4)
    counters.cache_looked_up(4, local=1, fleet=None, duplicates=0, unique=3)
    counters.alert("non_finite")
    counters.swap("failed")
    assert value(registry, "inferfleet_batch_rows_sum") == 3
    assert value(registry, "inferfleet_inference_seconds_sum") == pytest.approx(0.004)
    assert value(registry, "inferfleet_queue_wait_seconds_sum") == pytest.approx(0.0025)
    assert (
        value(registry, "inferfleet_requests_total", code="ok") == 1
    )  # the one that failed was not written
    assert value(registry, "inferfleet_requests_total", code="bad_request") == 1
    assert value(registry, "inferfleet_cache_hits_total", tier="local") == 4
    assert value(registry, "inferfleet_cache_misses_total", tier="local") == 10
    assert value(registry, "inferfleet_cache_hits_total", tier="fleet") == 2
    assert (
        value(registry, "inferfleet_cache_misses_total", tier="fleet") == 5
    )  # no fleet tier the second time
    assert value(registry, "inferfleet_cache_hits_total", tier="batch") == 1
    assert value(registry, "inferfleet_cache_misses_total", tier="batch") == 7
    assert value(registry, "inferfleet_alerts_total", kind="non_finite") == 1
    assert value(registry, "inferfleet_swaps_total", result="failed") == 1


def test_metrics_can_be_switched_without_losing_the_totals():
    registry = CollectorRegistry()
    counters = Counters(WorkerMetrics("q", None))
    counters.batch_computed([Picked(0, 0.0)], 2, 0.001)
    counters.metrics = WorkerMetrics("q", registry)
    counters.batch_computed([Picked(0, 0.0)], 5, 0.001)
    assert value(registry, "inferfleet_batch_rows_sum") == 5
    assert counters.snapshot().rows == 7


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_heartbeat_publishes_totals_and_the_rates_of_its_last_interval():
    client = fakeredis.FakeRedis()
    keys = QueueKeys("q")
    counters, clock = Counters(), Clock()
    counters.answered(50, 0)  # before the heartbeat started: in the totals, not in its first rate
    beat = Heartbeat(
        client,
        keys,
        "c1",
        counters,
        {"device": "cpu"},
        extra=lambda: {"version": "v7"},
        clock=clock,
    )
    counters.answered(30, 1)
    counters.batch_computed([Picked(0, 0.0)] * 30, 40, 0.1)
    counters.busy(0.5)
    clock.now += 2.0
    beat.beat()
    (info,) = read_heartbeats(client, keys)
    assert (info.requests, info.batches, info.rows, info.version) == (80, 1, 40, "v7")
    assert info.rate_rps == 15.0 and info.busy == 0.25
    clock.now += 1.0
    counters.busy(3.0)  # more than the interval: a fraction is at most 1
    beat.beat()
    (info,) = read_heartbeats(client, keys)
    assert info.rate_rps == 0.0 and info.busy == 1.0
