"""What happens to results between the forward pass and the reply, per round.

:class:`ResultPolicy` ties the result cache (:mod:`inferfleet.worker.serving.cache`) and the
result checks (:mod:`inferfleet.worker.serving.validation`) to one worker: it keys requests,
answers hits, reviews computed outputs and queues alerts and cache entries,
which the consumer writes once per round. Checks on the happy path cost one
vectorised test per batch (:meth:`ResultPolicy.batch_suspicious`); only a
suspicious batch is reviewed request by request.
"""

from __future__ import annotations

from typing import Any

import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.serving.alerts import Alert
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.cache import ResultCache, copy_outputs, input_digest
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.serving.validation import ConsistencyLog, check_outputs, non_finite, top_score

__all__ = ["NonFiniteOutput", "ResultPolicy"]


class NonFiniteOutput(ValueError):
    """The model returned NaN or Inf for this request: answered ``model_error``."""


class ResultPolicy:
    """One worker's result cache and result checks."""

    def __init__(self, settings: WorkerSettings, keys: QueueKeys, client: redis.Redis | None) -> None:
        self.cache = (ResultCache(settings.cache_size, keys, client, settings.fleet_cache_ttl_s)
                      if settings.cache_size else None)
        self.consistency = ConsistencyLog(settings.consistency_tol) if settings.consistency_tol > 0 else None
        self.min_confidence = settings.min_confidence
        self.nan_guard = settings.nan_guard
        self.consumer = settings.consumer
        self.alerts: list[Alert] = []
        self._to_store: list[tuple[bytes, Any]] = []

    @property
    def keyed(self) -> bool:
        """True when requests need a digest (the cache or the consistency check is on)."""
        return self.cache is not None or self.consistency is not None

    def key(self, requests: list[Request], version: str) -> list[bytes]:
        """Digest every request (kept in ``request.extra['digest']``)."""
        digests = []
        for req in requests:
            digest = input_digest(req.inputs, req.params, version)
            req.extra["digest"] = digest
            digests.append(digest)
        return digests

    def batch_suspicious(self, outputs: Any) -> bool:
        """One cheap test on a whole batch's outputs: could any request fail a check?"""
        if self.nan_guard and non_finite(outputs) is not None:
            return True
        if self.min_confidence > 0:
            score = top_score(outputs)
            return score is not None and score < self.min_confidence
        return False

    def review(self, req: Request, result: Any, version: str, suspicious: bool) -> Any:
        """The result to answer ``req`` with: its outputs, or a NonFiniteOutput error."""
        if isinstance(result, Exception):
            return result
        if suspicious:
            for finding in check_outputs(result, self.min_confidence, self.nan_guard):
                self.alerts.append(Alert(finding.kind, finding.detail, self.consumer, version, req.rid))
                if finding.kind == "non_finite":
                    return NonFiniteOutput(finding.detail)
        digest = req.extra.get("digest")
        if digest is not None:
            if self.consistency is not None:
                differs = self.consistency.check(digest, result)
                if differs is not None:
                    self.alerts.append(Alert(differs.kind, differs.detail, self.consumer, version, req.rid))
            if self.cache is not None:
                self._to_store.append((digest, copy_outputs(result)))
        return result

    def flush(self) -> None:
        """Write this round's new cache entries (one pipeline for the fleet tier)."""
        if self._to_store and self.cache is not None:
            entries, self._to_store = self._to_store, []
            self.cache.store(entries)

    def take_alerts(self) -> list[Alert]:
        alerts, self.alerts = self.alerts, []
        return alerts

    def model_changed(self) -> None:
        """A new model version: forget what the old one computed."""
        self._to_store = []
        if self.cache is not None:
            self.cache.clear()
        if self.consistency is not None:
            self.consistency.clear()
