"""Result checks (the article's "result validation"), pure functions on numpy outputs.

* a **NaN/Inf guard**: a request whose outputs hold a non-finite float is
  answered ``model_error`` instead of returning garbage;
* a **confidence threshold**: a reply whose top score is below it raises a
  ``low_confidence`` alert (it is still answered);
* **consistency**: identical inputs (same digest, so same model version) whose
  outputs differ by more than a tolerance raise an ``inconsistent`` alert: a
  non-deterministic model, a bad kernel or faulty hardware.

Nothing here touches Redis; :mod:`inferfleet.worker.serving.alerts` publishes the findings.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferfleet.worker.serving.cache import copy_outputs

__all__ = [
    "ConsistencyLog",
    "Finding",
    "check_outputs",
    "max_difference",
    "non_finite",
    "top_score",
]

#: Alert kinds raised by result checks (``swap_failed`` comes from serving/lifecycle.py).
KINDS = ("low_confidence", "non_finite", "inconsistent", "swap_failed")


@dataclass(frozen=True)
class Finding:
    """One problem found in one request's outputs."""

    kind: str
    detail: str


def _arrays(outputs: Any, where: str = "output") -> Iterator[tuple[str, np.ndarray]]:
    if isinstance(outputs, np.ndarray):
        yield where, outputs
    elif isinstance(outputs, dict):
        for key, value in outputs.items():
            yield from _arrays(value, f"output {key!r}")
    elif isinstance(outputs, (list, tuple)):  # positional outputs, or per-request handlers' parts
        for i, value in enumerate(outputs):
            yield from _arrays(value, f"output {i}")
    # raw (text or bytes) outputs hold no numbers to check


def non_finite(outputs: Any) -> str | None:
    """Where the outputs hold NaN or Inf, or None if every float is finite."""
    for where, arr in _arrays(outputs):
        if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
            nans = int(np.isnan(arr).sum())
            infs = int(arr.size - nans - np.isfinite(arr).sum())
            return f"{where} holds {nans} NaN and {infs} Inf values"
    return None


def top_score(outputs: Any) -> float | None:
    """The lowest, over rows, of each row's highest score in the first float output.

    Scores are taken as the model gives them (probabilities, for a threshold in
    [0, 1] to mean anything). None when there is no float output.
    """
    for _, arr in _arrays(outputs):
        if arr.dtype.kind == "f" and arr.size:
            rows = arr.reshape(arr.shape[0], -1)
            return float(rows.max(axis=1).min())
    return None


def check_outputs(
    outputs: Any, min_confidence: float = 0.0, nan_guard: bool = True
) -> list[Finding]:
    """The findings for one request's outputs (non_finite first: it is an error)."""
    findings = []
    if nan_guard:
        problem = non_finite(outputs)
        if problem:
            return [Finding("non_finite", problem)]
    if min_confidence > 0:
        score = top_score(outputs)
        if score is not None and score < min_confidence:
            findings.append(
                Finding("low_confidence", f"top score {score:.4g} is below {min_confidence:g}")
            )
    return findings


def max_difference(a: Any, b: Any) -> float:
    """Largest absolute element difference; inf when forms, shapes or dtypes differ."""
    pairs_a, pairs_b = list(_arrays(a)), list(_arrays(b))
    if [w for w, _ in pairs_a] != [w for w, _ in pairs_b]:
        return float("inf")
    worst = 0.0
    for (_, x), (_, y) in zip(pairs_a, pairs_b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return float("inf")
        if x.size:
            diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
            worst = max(worst, float(np.nan_to_num(diff, nan=np.inf).max()))
    return worst


class ConsistencyLog:
    """The outputs of recently computed inputs, to compare a recomputation against.

    Bounded (least recently seen forgotten first). The digest includes the
    model version, so two versions are never compared.
    """

    def __init__(self, tolerance: float, capacity: int = 4096) -> None:
        self.tolerance = tolerance
        self.capacity = capacity
        self._seen: OrderedDict[bytes, Any] = OrderedDict()

    def check(self, digest: bytes, outputs: Any) -> Finding | None:
        """Record ``outputs`` for ``digest``; a Finding if an earlier result differs."""
        before = self._seen.get(digest)
        if before is None:
            self._seen[digest] = copy_outputs(outputs)  # outputs are views into the batch
            if len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            return None
        self._seen.move_to_end(digest)
        diff = max_difference(before, outputs)
        if diff > self.tolerance:
            return Finding(
                "inconsistent",
                f"identical inputs gave outputs {diff:.4g} apart (tolerance {self.tolerance:g})",
            )
        return None

    def clear(self) -> None:
        """Forget every result seen (a new model version)."""
        self._seen.clear()
