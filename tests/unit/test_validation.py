"""Result checks on numpy outputs: NaN/Inf, confidence, consistency; the alerts stream."""

from __future__ import annotations

import numpy as np

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.serving.alerts import ROUND_CAP, Alert, capped, publish, read_alerts
from inferfleet.worker.serving.validation import (
    ConsistencyLog,
    check_outputs,
    max_difference,
    non_finite,
    top_score,
)


def test_non_finite_finds_nan_and_inf_in_any_output():
    ok = {"a": np.ones((2, 2), dtype=np.float32), "ids": np.array([[1], [2]])}
    assert non_finite(ok) is None
    bad = [np.ones(3), np.array([1.0, np.nan, np.inf])]
    assert non_finite(bad) == "output 1 holds 1 NaN and 1 Inf values"
    assert non_finite(np.array([[1, 2]], dtype=np.int64)) is None  # integers cannot be NaN


def test_top_score_is_the_weakest_rows_best_score():
    scores = np.array([[0.9, 0.1], [0.4, 0.6], [0.2, 0.8]], dtype=np.float32)
    assert top_score(scores) == np.float32(0.6)
    assert top_score({"ids": np.array([[1]])}) is None


def test_check_outputs():
    scores = np.array([[0.3, 0.7]], dtype=np.float32)
    assert check_outputs(scores, min_confidence=0.5) == []
    (low,) = check_outputs(scores, min_confidence=0.8)
    assert low.kind == "low_confidence" and "0.7" in low.detail
    (nan,) = check_outputs(np.array([[np.nan, 1.0]]), min_confidence=0.8)
    assert nan.kind == "non_finite"  # an error: no confidence alert on top of it
    assert check_outputs(np.array([[np.nan]]), nan_guard=False) == []


def test_max_difference():
    a = {"y": np.array([[1.0, 2.0]], dtype=np.float32)}
    assert max_difference(a, {"y": np.array([[1.0, 2.5]], dtype=np.float32)}) == 0.5
    assert max_difference(a, {"z": a["y"]}) == float("inf")
    assert max_difference(a, {"y": a["y"].astype(np.float64)}) == float("inf")
    assert max_difference(np.array([np.nan]), np.array([np.nan])) == float("inf")


def test_consistency_log_compares_recomputations():
    log = ConsistencyLog(tolerance=1e-3, capacity=2)
    x = np.array([[1.0, 2.0]])
    assert log.check(b"a", x) is None
    x[0, 0] = 99.0  # the caller's buffer is reused: the log kept its own copy
    assert log.check(b"a", np.array([[1.0005, 2.0]])) is None
    finding = log.check(b"a", np.array([[1.1, 2.0]]))
    assert finding is not None and finding.kind == "inconsistent"
    log.check(b"b", x)
    log.check(b"c", x)  # capacity 2: "a" is forgotten
    assert log.check(b"a", np.array([[5.0, 5.0]])) is None


def test_alerts_are_capped_per_round():
    many = [Alert("non_finite", f"row {i}", "w1", "v1", f"r{i}") for i in range(50)]
    kept = capped(many)
    assert len(kept) == ROUND_CAP
    assert kept[-1].detail.startswith(f"{50 - ROUND_CAP + 1} more alerts in one round (non_finite)")
    mixed = capped(many[:ROUND_CAP] + [Alert("low_confidence", "x", "w1", "v1")])
    assert mixed[-1].kind == "many"


def test_alerts_round_trip_through_the_stream(redis_client):
    keys = QueueKeys("q")
    publish(
        redis_client,
        keys,
        [
            Alert("low_confidence", "top 0.2", "w1", "v1", "r1"),
            Alert("non_finite", "NaN", "w2", "v1", "r2"),
        ],
    )
    publish(redis_client, keys, [Alert("low_confidence", "top 0.1", "w1", "v1", "r3")])
    alerts = read_alerts(redis_client, keys, 10)
    assert [a.rid for a in alerts] == ["r1", "r2", "r3"]
    assert [a.rid for a in read_alerts(redis_client, keys, 10, kind="low_confidence")] == [
        "r1",
        "r3",
    ]
    assert [a.rid for a in read_alerts(redis_client, keys, 1)] == ["r3"]
    assert alerts[1].consumer == "w2" and alerts[1].time_ms > 0
