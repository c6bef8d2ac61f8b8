"""WorkerMetrics and FleetMetrics against private registries: values change as the consumer
reports."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from inferfleet.worker.metrics import (
    FleetMetrics,
    WorkerMetrics,
    metrics_mode,
    observe_many,
    reply_codes,
)
from inferfleet.worker.serving.intake import Answer


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"queue": "q", **labels})


def test_answered_counts_replies_by_code(registry):
    metrics = WorkerMetrics("q", registry)
    metrics.answered({"ok": 60, "bad_request": 2})
    metrics.answered({"ok": 4, "expired": 1, "model_error": 0})
    assert value(registry, "inferfleet_requests_total", code="ok") == 64
    assert value(registry, "inferfleet_requests_total", code="bad_request") == 2
    assert value(registry, "inferfleet_requests_total", code="expired") == 1
    # every agreed code is exported from the start, so error ratios are defined at 0
    assert value(registry, "inferfleet_requests_total", code="dead_letter") == 0


def test_reply_codes_count_what_is_written():
    ok = Answer(b"1-0", "k", b"reply", True, rid="a")
    assert reply_codes([ok, ok, ok]) == {"ok": 3}
    assert reply_codes([]) == {}
    answers = [
        ok,
        Answer(b"2-0", "k", b"e", rid="b", code="bad_request"),
        Answer(b"3-0", None, None),  # acknowledged without a reply: not a reply
        Answer(b"4-0", "k", b"e", rid="c", code="dead_letter"),
        ok,
    ]
    assert reply_codes(answers) == {"ok": 2, "bad_request": 1, "dead_letter": 1}
    # a reply the script could not push (its key held another type) is answered again elsewhere
    assert reply_codes(answers, [1, 4]) == {"ok": 1, "dead_letter": 1}


def test_batch_done_fills_the_three_histograms(registry):
    metrics = WorkerMetrics("q", registry)
    metrics.batch_done(3, 0.002, [0.0003, 0.004, 0.2])
    metrics.batch_done(64, 0.01, [0.001] * 64)
    assert value(registry, "inferfleet_batch_rows_count") == 2
    assert value(registry, "inferfleet_batch_rows_sum") == 67
    assert value(registry, "inferfleet_batch_rows_bucket", le="4.0") == 1
    assert value(registry, "inferfleet_inference_seconds_sum") == pytest.approx(0.012)
    assert value(registry, "inferfleet_queue_wait_seconds_count") == 67
    assert value(registry, "inferfleet_queue_wait_seconds_bucket", le="0.0005") == 1
    assert (
        value(registry, "inferfleet_queue_wait_seconds_bucket", le="0.001") == 65
    )  # cumulative; 0.001 <= 0.001
    assert value(registry, "inferfleet_queue_wait_seconds_bucket", le="0.25") == 67
    assert value(registry, "inferfleet_queue_wait_seconds_sum") == pytest.approx(0.2043 + 0.064)


def test_observe_many_matches_observe_one_by_one():
    buckets = (0.001, 0.01, 0.1, 1.0)
    one, many = CollectorRegistry(), CollectorRegistry()
    by_one = Histogram("h", "h", registry=one, buckets=buckets)
    by_many = Histogram("h", "h", registry=many, buckets=buckets)
    rng = random.Random(7)
    values = [
        rng.choice([0.0, -0.5, 0.001, 0.01, 1.0, 5.0, math.inf, rng.random(), rng.random() / 100])
        for _ in range(500)
    ]
    for v in values:
        by_one.observe(v)
    observe_many(by_many, values)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in many.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }
    expected = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in one.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    }
    assert samples == expected


def test_observe_many_skips_nan_like_observe():
    registry = CollectorRegistry()
    hist = Histogram("h", "h", registry=registry, buckets=(1.0,))
    observe_many(hist, [float("nan"), 0.5])
    assert registry.get_sample_value("h_count") == 1


def test_cache_lookups_by_tier_only_when_counted(registry):
    metrics = WorkerMetrics("q", registry)
    metrics.cache_lookup("local", 3, 5)
    metrics.cache_lookup("local", 1, 0)
    metrics.cache_lookup("fleet", 0, 2)
    assert value(registry, "inferfleet_cache_hits_total", tier="local") == 4
    assert value(registry, "inferfleet_cache_misses_total", tier="local") == 5
    assert value(registry, "inferfleet_cache_misses_total", tier="fleet") == 2
    assert (
        value(registry, "inferfleet_cache_hits_total", tier="fleet") is None
    )  # no lookup hit: no series


def test_alerts_and_swaps_count_by_kind_and_result(registry):
    metrics = WorkerMetrics("q", registry)
    metrics.alert("non_finite")
    metrics.alert("non_finite")
    metrics.alert("low_confidence")
    metrics.swap("ok")
    metrics.swap("stale")
    assert value(registry, "inferfleet_alerts_total", kind="non_finite") == 2
    assert value(registry, "inferfleet_alerts_total", kind="low_confidence") == 1
    assert value(registry, "inferfleet_alerts_total", kind="inconsistent") == 0
    assert value(registry, "inferfleet_swaps_total", result="ok") == 1
    assert value(registry, "inferfleet_swaps_total", result="stale") == 1
    assert value(registry, "inferfleet_swaps_total", result="failed") == 0


def test_model_version_keeps_one_info_series(registry):
    metrics = WorkerMetrics("q", registry)
    metrics.model_version("v1")
    assert value(registry, "inferfleet_model_info", version="v1") == 1
    metrics.model_version("v2")
    metrics.model_version("v2")
    assert value(registry, "inferfleet_model_info", version="v2") == 1
    assert value(registry, "inferfleet_model_info", version="v1") is None


def test_queue_depth_sets_lag_and_pending(registry):
    metrics = WorkerMetrics("q", registry)
    metrics.queue_depth(None, 3)  # Redis 6.2: lag unknown, not reported as 0
    assert value(registry, "inferfleet_queue_lag") is None
    assert value(registry, "inferfleet_queue_pending") == 3
    metrics.queue_depth(120, 0)
    assert value(registry, "inferfleet_queue_lag") == 120
    assert value(registry, "inferfleet_queue_pending") == 0


def test_queue_depth_is_left_to_the_supervisor_when_asked(registry):
    WorkerMetrics("q", registry, report_depth=False).queue_depth(5, 5)
    assert value(registry, "inferfleet_queue_lag") is None
    assert value(registry, "inferfleet_queue_pending") is None


def test_consumers_of_one_process_share_the_series(registry):
    WorkerMetrics("q", registry).answered({"ok": 1})
    WorkerMetrics("q", registry).answered({"ok": 2})
    WorkerMetrics("other", registry).answered({"ok": 5})
    assert value(registry, "inferfleet_requests_total", code="ok") == 3
    assert (
        registry.get_sample_value("inferfleet_requests_total", {"queue": "other", "code": "ok"})
        == 5
    )


def test_disabled_metrics_record_nothing():
    metrics = WorkerMetrics("q", None)
    assert not metrics.enabled
    metrics.answered({"ok": 1})
    metrics.batch_done(1, 0.1, [0.1])
    metrics.cache_lookup("local", 1, 1)
    metrics.alert("non_finite")
    metrics.swap("ok")
    metrics.model_version("v1")
    metrics.queue_depth(1, 1)


def test_metrics_mode(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert metrics_mode(0) == "off"
    assert metrics_mode(9100) == "serve"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/x")
    assert metrics_mode(0) == "multiprocess"
    assert metrics_mode(9100) == "multiprocess"  # a supervised child never opens a port


def test_fleet_metrics_collect_the_supervisors_view(registry):
    fleet = FleetMetrics("q", 0)
    registry.register(fleet)
    fleet.observed(2, lag=None, pending=None)
    assert value(registry, "inferfleet_workers") == 2
    assert value(registry, "inferfleet_worker_restarts_total") == 0
    assert value(registry, "inferfleet_queue_lag") is None  # never observed: not exported
    fleet.observed(3, lag=40, pending=7)
    fleet.restarted()
    fleet.observed(3)  # an observation that failed keeps the last lag
    assert value(registry, "inferfleet_workers") == 3
    assert value(registry, "inferfleet_worker_restarts_total") == 1
    assert value(registry, "inferfleet_queue_lag") == 40
    assert value(registry, "inferfleet_queue_pending") == 7


def test_docs_list_exactly_the_metrics_the_code_exports():
    """docs/metrics.md's table against the families in worker/metrics.py (what the deploy checks use
    too)."""
    import re
    from pathlib import Path

    from inferfleet.worker.metrics import metric_names

    root = Path(__file__).resolve().parents[2]
    table = re.findall(
        r"^\| `(inferfleet_\w+)` \|", (root / "docs" / "metrics.md").read_text(), re.MULTILINE
    )
    assert sorted(table) == metric_names()
    assert len(table) == len(set(table))


def test_every_metric_the_docs_and_deploy_files_name_is_exported():
    """Example queries, alert rules, probes and dashboards: a renamed metric leaves none of them
    behind."""
    import re
    from pathlib import Path

    from inferfleet.worker.metrics import metric_names

    root = Path(__file__).resolve().parents[2]
    files = [
        root / "README.md",
        *(root / "docs").glob("*.md"),
        *root.glob("docker-compose*.yml"),
        *(p for p in (root / "deploy").rglob("*") if p.is_file()),
    ]
    exported = set(metric_names())
    named = {
        (path.name, re.sub(r"_(bucket|sum|count|created)$", "", m))
        for path in files
        for m in re.findall(r"\binferfleet_[a-z_]+", path.read_text(errors="replace"))
    }
    from inferfleet.producer.sharing import LIBRARY

    functions = set(
        re.findall(r"register_function\('(inferfleet_[a-z_]+)'", LIBRARY)
    )  # Redis Functions, not metrics
    assert functions == {"inferfleet_enqueue", "inferfleet_check", "inferfleet_cancel"}
    unknown = {
        (name, m)
        for name, m in named
        if m not in exported and m != "inferfleet_example" and m not in functions
    }  # an ONNX key
    assert not unknown
    assert {m for _, m in named} >= {
        "inferfleet_queue_lag",
        "inferfleet_model_info",
        "inferfleet_requests_total",
    }


def test_lanes_and_tenant_refusals_are_counted_with_bounded_labels(registry):
    metrics = WorkerMetrics("q", registry)
    metrics.lanes([5, 100, 0], {"high": 7, "low": None})
    metrics.lanes([1, 0, 2], {"high": 0, "low": 3})
    assert value(registry, "inferfleet_lane_requests_total", lane="high") == 6
    assert value(registry, "inferfleet_lane_requests_total", lane="normal") == 100
    assert value(registry, "inferfleet_lane_requests_total", lane="low") == 2
    assert value(registry, "inferfleet_lane_lag", lane="high") == 0
    assert value(registry, "inferfleet_lane_lag", lane="low") == 3
    metrics.tenant_refused("nightly", "rate_limited", 3)
    metrics.tenant_refused("*", "overloaded", 1)
    assert (
        value(registry, "inferfleet_tenant_refused_total", tenant="nightly", code="rate_limited")
        == 3
    )
    assert value(registry, "inferfleet_tenant_refused_total", tenant="*", code="overloaded") == 1
    assert (
        value(registry, "inferfleet_requests_total", code="cancelled") == 0
    )  # the 1.1 codes exported at 0


def test_a_generative_iteration_counts_tokens_first_tokens_and_live_sequences(registry):
    metrics = WorkerMetrics("q", registry)
    metrics.generated([0.004, 0.2], 7, 0.003)  # two requests got their first token
    metrics.generated([], 8, 0.002)
    metrics.live_sequences(8)
    metrics.live_sequences(5)
    assert value(registry, "inferfleet_generated_tokens_total") == 15
    assert value(registry, "inferfleet_time_to_first_chunk_seconds_count") == 2
    assert value(registry, "inferfleet_time_to_first_chunk_seconds_sum") == pytest.approx(0.204)
    assert value(registry, "inferfleet_inference_seconds_count") == 2  # one per iteration
    assert value(registry, "inferfleet_live_sequences") == 5
