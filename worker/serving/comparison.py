"""Comparing a candidate model's outputs with the live model's, as pure functions.

Nothing here touches Redis, torch or a clock: :mod:`inferfleet.worker.serving.shadow`
feeds it numpy outputs and timings and writes the totals to Redis.

Per request (``compare``):

* **max absolute error**: the largest ``|candidate - live|`` over every output element;
* **max relative error**: that, over the largest ``|live|`` of the request (so an
  output near zero does not blow it up);
* **agreement** per row: the top-1 class (argmax of the last axis) for outputs
  with several scores per row, the decision ``score >= threshold`` for one
  score per row; a row whose forms, shapes or dtypes differ never agrees;
* **rank correlation** (Spearman) of the scores, over the request's rows for one
  score per row (3 rows or more), else per row over its classes;
* **non-finite**: candidate rows holding NaN or Inf.

:class:`PairStats` sums those over many requests (the Redis hash of one
(live, candidate) pair holds the same fields) and :func:`verdict` says
whether they meet :class:`Thresholds`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

__all__ = [
    "Comparison",
    "PairStats",
    "Thresholds",
    "compare",
    "rank_correlation",
    "rollback_reason",
    "verdict",
]


@dataclass(frozen=True)
class Thresholds:
    """What a candidate must meet to be promoted, and what rolls a canary back.

    ``min_compared`` requests must have been compared before either decision: at 100, one
    stray row or one failed request alone can neither refuse a candidate (0.99 agreement) nor
    roll a canary back (0.01 error rate); docs/operations.md says more.
    """

    min_agreement: float = 0.99
    max_rel_error: float = 1e-3
    min_rank_corr: float = 0.95
    decision_threshold: float = 0.5
    max_error_rate: float = 0.01
    min_compared: int = 100

    def __post_init__(self) -> None:
        for name, low, high in (
            ("min_agreement", 0.0, 1.0),
            ("max_rel_error", 0.0, 1e30),
            ("min_rank_corr", -1.0, 1.0),
            ("decision_threshold", -1e30, 1e30),
            ("max_error_rate", 0.0, 1.0),
            ("min_compared", 1, 10**9),
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not low <= value <= high
            ):
                raise ValueError(f"{name} must be a number from {low:g} to {high:g}, got {value!r}")

    def fields(self) -> dict[str, str]:
        """As strings, for the shadow hash."""
        return {k: repr(v) for k, v in asdict(self).items()}

    @classmethod
    def from_fields(cls, raw: Mapping[str, str]) -> Thresholds:
        """Read back :meth:`fields`; a missing or corrupt field keeps its default."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            try:
                values[f.name] = (
                    int(raw[f.name]) if f.name == "min_compared" else float(raw[f.name])
                )
            except (KeyError, ValueError):
                continue
        try:
            return cls(**values)
        except ValueError:
            return cls()


@dataclass(frozen=True)
class Comparison:
    """One request's live and candidate outputs compared."""

    rows: int
    agree_rows: int
    abs_error: float
    rel_error: float
    rank_corr: float | None
    nonfinite_rows: int


def _arrays(outputs: Any) -> Iterator[tuple[str, np.ndarray]]:
    if isinstance(outputs, np.ndarray):
        yield "", outputs
    elif isinstance(outputs, dict):
        yield from ((str(k), v) for k, v in outputs.items())
    else:
        yield from ((str(i), v) for i, v in enumerate(outputs))


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their positions)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    if len(counts) < len(x):  # ties: each value's mean rank
        sums = np.bincount(inverse, weights=ranks)
        ranks = sums[inverse] / counts[inverse]
    return ranks


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rho of two equal-length vectors; None under 3 values or for a constant one."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if len(a) < 3 or len(a) != len(b) or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum()) * float((rb * rb).sum()))
    return None if denominator == 0 else float((ra * rb).sum()) / denominator


def _scores(outputs: Any) -> np.ndarray | None:
    """The first float output as (rows, scores per row)."""
    for _, arr in _arrays(outputs):
        if arr.dtype.kind == "f" and arr.ndim >= 1 and arr.size:
            return arr.reshape(arr.shape[0], -1)
    return None


def _agreement(live: np.ndarray, cand: np.ndarray, threshold: float) -> tuple[int, float | None]:
    """(rows that agree, rank correlation) of two (rows, scores) arrays."""
    if live.shape[1] == 1:
        agree = int(((live[:, 0] >= threshold) == (cand[:, 0] >= threshold)).sum())
        return agree, rank_correlation(live[:, 0], cand[:, 0])
    agree = int((live.argmax(axis=1) == cand.argmax(axis=1)).sum())
    per_row = [rank_correlation(x, y) for x, y in zip(live, cand)]
    measured = [r for r in per_row if r is not None]
    return agree, (sum(measured) / len(measured)) if measured else None


def _errors(live: Any, cand: Any) -> tuple[float, float, int]:
    """(max abs error, max rel error, candidate rows with NaN/Inf) over every output."""
    worst, scale, bad = 0.0, 0.0, 0
    for (_, x), (_, y) in zip(_arrays(live), _arrays(cand)):
        if x.dtype.kind not in "biuf" or y.dtype.kind not in "biuf" or not x.size:
            continue
        xf, yf = x.astype(np.float64), y.astype(np.float64)
        finite = (
            np.isfinite(yf).reshape(yf.shape[0], -1).all(axis=1) if yf.ndim else np.array([True])
        )
        bad = max(bad, int((~finite).sum()))
        diff = np.abs(yf - xf)
        worst = max(worst, float(np.where(np.isnan(diff), np.inf, diff).max()))
        scale = max(scale, float(np.abs(xf[np.isfinite(xf)]).max(initial=0.0)))
    return worst, (worst / scale if scale > 0 else (0.0 if worst == 0 else math.inf)), bad


def _same_form(live: Any, cand: Any) -> bool:
    a, b = list(_arrays(live)), list(_arrays(cand))
    return [k for k, _ in a] == [k for k, _ in b] and all(
        x.shape == y.shape and x.dtype.kind == y.dtype.kind for (_, x), (_, y) in zip(a, b)
    )


def compare(live: Any, cand: Any, rows: int, decision_threshold: float = 0.5) -> Comparison:
    """Compare one request's outputs (``rows`` rows); outputs of another form disagree entirely."""
    if not _same_form(live, cand):
        return Comparison(rows, 0, math.inf, math.inf, None, 0)
    abs_error, rel_error, nonfinite = _errors(live, cand)
    live_scores, cand_scores = _scores(live), _scores(cand)
    if live_scores is None or cand_scores is None:
        agree, corr = (rows if abs_error == 0 else 0), None
    else:
        agree, corr = _agreement(live_scores, cand_scores, decision_threshold)
    return Comparison(rows, agree, abs_error, rel_error, corr, nonfinite)


@dataclass
class PairStats:
    """Totals for one (live, candidate) pair: a worker's since its last flush, or the fleet's."""

    compared: int = 0  # requests compared
    rows: int = 0
    agree_rows: int = 0
    abs_error_max: float = 0.0
    rel_error_max: float = 0.0
    abs_error_sum: float = 0.0  # of each request's max abs error, for the mean
    rank_corr_sum: float = 0.0
    rank_corr_n: int = 0
    nonfinite_rows: int = 0
    candidate_errors: int = 0  # requests the candidate raised on
    candidate_ms: float = 0.0  # the candidate's forward passes
    live_ms: float = 0.0  # the live forward passes of the same batches
    batches: int = 0
    canary_requests: int = 0  # requests the candidate answered
    canary_failed: int = (
        0  # canary requests it failed (raised, NaN/Inf): recomputed on the live model
    )

    #: Fields merged by maximum, not by sum.
    MAXIMA = ("abs_error_max", "rel_error_max")

    def add(self, c: Comparison) -> None:
        """Count one compared request."""
        self.compared += 1
        self.rows += c.rows
        self.agree_rows += c.agree_rows
        self.abs_error_max = max(self.abs_error_max, c.abs_error)
        self.rel_error_max = max(self.rel_error_max, c.rel_error)
        self.abs_error_sum += c.abs_error if math.isfinite(c.abs_error) else 0.0
        self.nonfinite_rows += c.nonfinite_rows
        if c.rank_corr is not None:
            self.rank_corr_sum += c.rank_corr
            self.rank_corr_n += 1

    def fields(self) -> dict[str, float]:
        """Every counter, by name (the Redis hash's fields)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> PairStats:
        """Parse a Redis hash (unknown and corrupt fields ignored)."""
        stats = cls()
        for f in fields(cls):
            try:
                value = float(raw[f.name])
            except (KeyError, ValueError, TypeError):
                continue
            setattr(stats, f.name, value if f.type == "float" else int(value))
        return stats

    def empty(self) -> bool:
        return not (self.compared or self.batches or self.candidate_errors or self.canary_requests)

    @property
    def agreement(self) -> float | None:
        return self.agree_rows / self.rows if self.rows else None

    @property
    def rank_corr(self) -> float | None:
        return self.rank_corr_sum / self.rank_corr_n if self.rank_corr_n else None

    @property
    def error_rate(self) -> float | None:
        tried = self.compared + self.candidate_errors
        if self.canary_requests:
            return self.canary_failed / self.canary_requests
        return self.candidate_errors / tried if tried else None

    def summary(self) -> dict[str, Any]:
        """The figures a report shows (means and rates, not sums)."""
        return {
            "compared": self.compared,
            "rows": self.rows,
            "agreement": self.agreement,
            "abs_error_max": self.abs_error_max,
            "rel_error_max": self.rel_error_max,
            "abs_error_mean": self.abs_error_sum / self.compared if self.compared else None,
            "rank_corr": self.rank_corr,
            "nonfinite_rows": self.nonfinite_rows,
            "candidate_errors": self.candidate_errors,
            "error_rate": self.error_rate,
            "candidate_ms_per_batch": self.candidate_ms / self.batches if self.batches else None,
            "live_ms_per_batch": self.live_ms / self.batches if self.batches else None,
            "canary_requests": self.canary_requests,
            "canary_failed": self.canary_failed,
        }


def verdict(stats: PairStats, t: Thresholds) -> list[str]:
    """Why the candidate may not be promoted on this evidence (empty: it may)."""
    if stats.compared < t.min_compared:
        return [f"only {stats.compared} requests compared, fewer than {t.min_compared}"]
    return _divergence(stats, t)


def _divergence(stats: PairStats, t: Thresholds) -> list[str]:
    reasons = []
    if stats.agreement is not None and stats.agreement < t.min_agreement:
        reasons.append(f"agreement {stats.agreement:.4f} is below {t.min_agreement:g}")
    if stats.rel_error_max > t.max_rel_error:
        reasons.append(f"max relative error {stats.rel_error_max:.4g} is over {t.max_rel_error:g}")
    if stats.rank_corr is not None and stats.rank_corr < t.min_rank_corr:
        reasons.append(f"rank correlation {stats.rank_corr:.4f} is below {t.min_rank_corr:g}")
    if stats.nonfinite_rows:
        reasons.append(f"{stats.nonfinite_rows} candidate rows hold NaN or Inf")
    rate = stats.error_rate
    if rate is not None and rate > t.max_error_rate:
        reasons.append(f"candidate error rate {rate:.4f} is over {t.max_error_rate:g}")
    return reasons


def rollback_reason(stats: PairStats, t: Thresholds) -> str | None:
    """Why a canary must be rolled back now, or None: once ``min_compared`` requests are
    in, any threshold crossed (failures count from the first: the NaN guard is absolute)."""
    rate = stats.error_rate
    if (
        stats.canary_requests >= min(t.min_compared, 10)
        and rate is not None
        and rate > t.max_error_rate
    ):
        return (
            f"canary failed {stats.canary_failed} of {stats.canary_requests} requests "
            f"(error rate {rate:.4f} over {t.max_error_rate:g})"
        )
    if stats.compared < t.min_compared:
        return None
    reasons = _divergence(stats, t)
    return "; ".join(reasons) if reasons else None
