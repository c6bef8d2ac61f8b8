"""The candidate-versus-live comparison metrics and thresholds (pure functions)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferfleet.worker.serving.comparison import (
    PairStats,
    Thresholds,
    compare,
    rank_correlation,
    rollback_reason,
    verdict,
)


def test_equal_outputs_agree_fully() -> None:
    live = np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]], dtype=np.float32)
    c = compare(live, live.copy(), 2)
    assert (c.rows, c.agree_rows, c.abs_error, c.rel_error, c.nonfinite_rows) == (2, 2, 0.0, 0.0, 0)
    assert c.rank_corr == pytest.approx(1.0)


def test_scaled_outputs_keep_the_top_class_but_show_the_error() -> None:
    live = np.array([[1.0, 4.0, 2.0]], dtype=np.float32)
    c = compare(live, live * 1.5, 1)
    assert c.agree_rows == 1  # argmax unchanged
    assert c.abs_error == pytest.approx(2.0) and c.rel_error == pytest.approx(0.5)


def test_top1_disagreement_is_counted_per_row() -> None:
    live = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    cand = np.array([[0.9, 0.1], [0.8, 0.2], [0.4, 0.6]])
    assert compare(live, cand, 3).agree_rows == 1


def test_one_score_per_row_agrees_on_the_decision_and_ranks_the_rows() -> None:
    live = np.array([[0.1], [0.4], [0.6], [0.9]])
    cand = np.array([[0.2], [0.55], [0.7], [0.95]])  # same order, one decision flips at 0.5
    c = compare(live, cand, 4, decision_threshold=0.5)
    assert c.agree_rows == 3 and c.rank_corr == pytest.approx(1.0)
    reversed_scores = compare(live, live[::-1].copy(), 4)
    assert reversed_scores.rank_corr == pytest.approx(-1.0)


def test_non_finite_candidate_rows_are_counted_and_the_error_is_infinite() -> None:
    live = np.ones((3, 2), dtype=np.float32)
    cand = live.copy()
    cand[1, 0] = np.nan
    cand[2, 1] = np.inf
    c = compare(live, cand, 3)
    assert c.nonfinite_rows == 2 and math.isinf(c.abs_error)


def test_outputs_of_another_form_disagree_entirely() -> None:
    c = compare(np.ones((2, 3)), np.ones((2, 4)), 2)
    assert c.agree_rows == 0 and math.isinf(c.abs_error)
    assert compare({"a": np.ones(2)}, {"b": np.ones(2)}, 2).agree_rows == 0


def test_rank_correlation_averages_ties_and_needs_three_values() -> None:
    assert rank_correlation(np.array([1.0, 2.0]), np.array([1.0, 2.0])) is None
    assert (
        rank_correlation(np.array([1.0, 1.0, 1.0]), np.array([1.0, 2.0, 3.0])) is None
    )  # constant
    assert rank_correlation(
        np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 2.0, 2.0, 3.0])
    ) == pytest.approx(1.0)


def test_pair_stats_round_trip_through_hash_fields() -> None:
    stats = PairStats()
    stats.add(compare(np.ones((2, 2)), np.ones((2, 2)) * 2, 2))
    stats.candidate_ms = 3.5
    back = PairStats.from_fields({k: str(v) for k, v in stats.fields().items()})
    assert back == stats and back.compared == 1 and back.rel_error_max == pytest.approx(1.0)


def test_verdict_needs_enough_evidence_then_the_thresholds() -> None:
    t = Thresholds(min_compared=3)
    stats = PairStats()
    same = np.array([[0.2, 0.8]])
    for _ in range(2):
        stats.add(compare(same, same, 1))
    assert "fewer than 3" in verdict(stats, t)[0]
    stats.add(compare(same, same, 1))
    assert verdict(stats, t) == []
    stats.add(compare(same, same * 2, 1))
    assert any("relative error" in r for r in verdict(stats, t))


def test_a_canary_rolls_back_on_failures_or_divergence() -> None:
    t = Thresholds(min_compared=5, max_error_rate=0.1)
    failing = PairStats(canary_requests=10, canary_failed=5)
    assert "failed 5 of 10" in (rollback_reason(failing, t) or "")
    healthy = PairStats(canary_requests=10)
    assert rollback_reason(healthy, t) is None
    diverging = PairStats(canary_requests=10, compared=5, rows=5, agree_rows=5, rel_error_max=0.5)
    assert "relative error" in (rollback_reason(diverging, t) or "")


def test_thresholds_are_validated_and_read_back() -> None:
    with pytest.raises(ValueError, match="min_agreement"):
        Thresholds(min_agreement=1.5)
    t = Thresholds(min_agreement=0.9, min_compared=7)
    assert Thresholds.from_fields(t.fields()) == t
    assert Thresholds.from_fields({"min_compared": "x"}) == Thresholds()


def test_the_shadow_commands_defaults_are_the_thresholds_dataclass() -> None:
    from dataclasses import fields as dataclass_fields

    from inferfleet.worker.cli.rollout import shadow

    options = {param.name: param for param in shadow.params}
    for field in dataclass_fields(Thresholds):
        option = options[field.name]
        assert option.default == field.default, field.name
        assert type(option.type("7")) is type(field.default), field.name  # int stays int
