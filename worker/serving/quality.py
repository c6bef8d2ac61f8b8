"""What happens to results between the forward pass and the reply, per round.

:class:`ResultPolicy` ties the result cache (:mod:`inferfleet.worker.serving.cache`) and the
result checks (:mod:`inferfleet.worker.serving.validation`) to one worker: it keys requests,
answers hits, reviews computed outputs and queues alerts and cache entries,
which the consumer writes once per round. Checks on the happy path cost one
vectorised test per batch (:meth:`ResultPolicy.batch_suspicious`); only a
suspicious batch is reviewed request by request.

:class:`CacheRound` is one round's use of the cache: the hits answered
without computing, and requests that repeat another of the same round
computed once and answered from its result.
"""

from __future__ import annotations

from typing import Any

import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.serving.alerts import Alert
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.cache import (
    ResultCache,
    copy_outputs,
    input_digest,
    split_duplicates,
)
from inferfleet.worker.serving.validation import (
    ConsistencyLog,
    check_outputs,
    non_finite,
    top_score,
)

__all__ = ["CacheRound", "NonFiniteOutput", "ResultPolicy"]


class NonFiniteOutput(ValueError):
    """The model returned NaN or Inf for this request: answered ``model_error``."""


class ResultPolicy:
    """One worker's result cache and result checks."""

    def __init__(
        self, settings: WorkerSettings, keys: QueueKeys, client: redis.Redis | None
    ) -> None:
        self.cache = (
            ResultCache(settings.cache_size, keys, client, settings.fleet_cache_ttl_s)
            if settings.cache_size
            else None
        )
        self.consistency = (
            ConsistencyLog(settings.consistency_tol) if settings.consistency_tol > 0 else None
        )
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
                self.alerts.append(
                    Alert(finding.kind, finding.detail, self.consumer, version, req.rid)
                )
                if finding.kind == "non_finite":
                    return NonFiniteOutput(finding.detail)
        digest = req.extra.get("digest")
        if digest is not None:
            if self.consistency is not None:
                differs = self.consistency.check(digest, result)
                if differs is not None:
                    self.alerts.append(
                        Alert(differs.kind, differs.detail, self.consumer, version, req.rid)
                    )
            if self.cache is not None:
                self._to_store.append((digest, copy_outputs(result)))
        return result

    def flush(self) -> None:
        """Write this round's new cache entries (one pipeline for the fleet tier)."""
        if self._to_store and self.cache is not None:
            entries, self._to_store = self._to_store, []
            self.cache.store(entries)

    def cache_fields(self) -> dict[str, Any]:
        """The result cache's use since start, for the heartbeat (nothing without a cache)."""
        if self.cache is None:
            return {}
        s = self.cache.stats
        return {
            "cache_hits": s.local_hits + s.fleet_hits + s.batch_hits,
            "cache_misses": s.misses,
            "cache_hit_rate": round(s.hit_rate, 4),
            "cache_entries": len(self.cache.local),
        }

    def take_alerts(self) -> list[Alert]:
        """This round's alerts, forgotten here (the consumer publishes them)."""
        alerts, self.alerts = self.alerts, []
        return alerts

    def model_changed(self) -> None:
        """A new model version: forget what the old one computed."""
        self._to_store = []
        if self.cache is not None:
            self.cache.clear()
        if self.consistency is not None:
            self.consistency.clear()


class CacheRound:
    """One round's cache hits and in-round duplicates, for one worker's :class:`ResultPolicy`.

    Each round: :meth:`start` with the round's requests, :meth:`remember`
    each computed batch, then :meth:`finish` for the duplicates to answer.
    """

    def __init__(self, results: ResultPolicy, counters: Counters) -> None:
        self.results = results
        self.counters = counters
        self._computed: dict[
            bytes, tuple[Any, float, int]
        ] = {}  # digest -> (result, infer_ms, rows) this round
        self._duplicates: list[tuple[Request, Request]] = []  # (duplicate, the request it repeats)

    def start(
        self, requests: list[Request], version: str
    ) -> tuple[list[Request], list[tuple[Request, Any]]]:
        """The requests to compute, and the cache hits as (request, outputs).

        Duplicates of another request of the round are kept back, answered
        by :meth:`finish` from that request's result.
        """
        self._computed.clear()
        self._duplicates = []
        if not requests or not self.results.keyed:
            return requests, []
        digests = self.results.key(requests, version)
        cache = self.results.cache
        if cache is None:
            return requests, []
        misses, hits = [], []
        tiers = {"local": 0, "fleet": 0}
        for req, hit in zip(requests, cache.lookup(digests)):
            if hit is None:
                misses.append(req)
            else:
                tiers[hit[1]] += 1
                hits.append((req, hit[0]))
        unique, dupes = split_duplicates([r.extra["digest"] for r in misses])
        cache.stats.batch_hits += len(dupes)
        cache.stats.misses -= len(dupes)
        fleet = tiers["fleet"] if cache.client is not None else None
        self.counters.cache_looked_up(len(requests), tiers["local"], fleet, len(dupes), len(unique))
        self._duplicates = [(misses[i], misses[j]) for i, j in dupes]
        return [misses[i] for i in unique], hits

    def remember(
        self, batch: list[Request], results: list[Any], infer_ms: float, rows: int
    ) -> None:
        """Keep a computed batch's results for the duplicates of its requests."""
        if self.results.keyed:
            for req, res in zip(batch, results):
                self._computed[req.extra["digest"]] = (res, infer_ms, rows)

    def finish(self) -> list[tuple[Request, Any, float, int]]:
        """Each duplicate with the result, infer_ms and batch rows of the request it repeats.

        The round is over.
        """
        done = [(dup, *self._computed[first.extra["digest"]]) for dup, first in self._duplicates]
        self._computed.clear()
        self._duplicates = []
        return done
