"""One worker's side of a shadow or canary: the candidate loaded beside the live copy, compared.

The consumer calls four things, each a no-op costing one attribute test per
batch while no candidate is loaded (``ready`` is False):

* :meth:`ShadowRunner.poll` on every housekeeping tick: adds this worker's
  comparison totals to the fleet's (:func:`~inferfleet.worker.serving.rollout.flush_stats`),
  raises the divergence alert or rolls a canary back on the fleet's totals, and
  follows the shadow hash: a new candidate is loaded and warmed in a background
  thread (refused when the device has no room for a second copy), an ended one
  is unloaded. A shadow command Redis refuses (an ACL without it) stops the
  shadow on this worker with a ``shadow_failed`` alert; serving goes on;
* :meth:`ShadowRunner.canary_due` / :meth:`ShadowRunner.canary` before a batch:
  the candidate answers ``canary`` percent of batches (their replies name its
  version); a batch it fails on (an exception, NaN or Inf) is counted and
  computed on the live model instead, so a failing canary never reaches a client;
* :meth:`ShadowRunner.offer` after a live batch: keeps ``sample`` of the batches;
* :meth:`ShadowRunner.run_pending` after the round's replies are written: runs
  the candidate on the kept batches (the live model on kept canary batches)
  and compares each request (:func:`~inferfleet.worker.serving.comparison.compare`).

So replies never wait for the candidate; its cost is about ``sample`` times its
forward pass per batch, taken between rounds of the same thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.keys import shadow_alerted_key
from inferfleet.worker.runtime.loading import ModelRuntime
from inferfleet.worker.runtime.memory import room_for_another_copy
from inferfleet.worker.serving.alerts import Alert
from inferfleet.worker.serving.batching import Request, concat_inputs, split_outputs
from inferfleet.worker.serving.comparison import PairStats, compare, rollback_reason, verdict
from inferfleet.worker.serving.intake import Answer
from inferfleet.worker.serving.replies import BatchEncoder, Encode
from inferfleet.worker.serving.rollout import Candidate, end_candidate, flush_stats, read_candidate
from inferfleet.worker.serving.validation import non_finite

__all__ = ["EvenShare", "ShadowRunner"]

log = logging.getLogger(__name__)

Loader = Callable[[WorkerSettings], ModelRuntime]


class EvenShare:
    """Picks ``share`` of calls, evenly (1 in 10 for 0.1), without randomness."""

    def __init__(self) -> None:
        self.credit = 0.0

    def due(self, share: float) -> bool:
        self.credit += share
        if self.credit >= 1.0 - 1e-9:
            self.credit -= 1.0
            return True
        return False


class ShadowRunner:
    """The candidate beside one consumer's live model; see the module docstring."""

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        settings: WorkerSettings,
        load: Loader,
        counters: Counters,
        alert: Callable[[list[Alert]], None],
        encode: Encode,
        canary_allowed: bool = True,
    ) -> None:
        self.client, self.keys, self.settings, self.load = client, keys, settings, load
        self.counters, self.alert, self.encode = counters, alert, encode
        self.canary_allowed = (
            canary_allowed  # False with a result cache: its entries name the live version
        )
        self.ready = False  # a candidate is loaded and active: the consumer's one test per batch
        self.spec: Candidate | None = None  # the candidate loaded (or loading)
        self.runtime: ModelRuntime | None = None
        self.encoder: BatchEncoder | None = None
        self.error = ""  # why the last load failed, for the heartbeat
        self._done: tuple[Candidate, object] | None = None
        self._lock = threading.Lock()
        self._sample, self._canary = EvenShare(), EvenShare()
        self._pending: list[tuple[list[Request], list[Any], bool]] = []
        self._stats: dict[
            str, PairStats
        ] = {}  # live version -> this worker's totals since the last flush
        self._alerted = 0  # the seq whose divergence this worker has seen alerted
        self._refused_seq: int | None = (
            None  # the seq whose shadow Redis refused a command of (-1: no candidate)
        )

    # -- the hot path: one test per batch while nothing is loaded ----------------

    def canary_due(self) -> bool:
        """Should the candidate answer the next batch?"""
        spec = self.spec
        return (
            self.ready
            and spec is not None
            and spec.canary > 0
            and self.canary_allowed
            and self._canary.due(spec.canary / 100.0)
        )

    def canary(self, batch: list[Request], live_version: str) -> list[Answer] | None:
        """The candidate's answers to ``batch``; None if it failed (the live model answers)."""
        assert self.runtime is not None and self.encoder is not None and self.spec is not None
        stats = self._stats_for(live_version)
        rows = [r.rows for r in batch]
        stats.canary_requests += len(batch)
        started = time.perf_counter()
        try:
            outputs = self.runtime.predict(concat_inputs(batch), batch[0].params)
            results = split_outputs(outputs, rows)
            problem = non_finite(outputs)
        except Exception as exc:  # noqa: BLE001 - a failing candidate must never fail the request
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            stats.canary_failed += len(batch)
            log.warning(
                "canary %s failed on a batch of %d requests (%s): answered by the live model",
                self.spec.version,
                len(batch),
                problem,
            )
            return None
        infer_ms = (time.perf_counter() - started) * 1000.0
        self.counters.batch_computed(batch, sum(rows), infer_ms / 1000.0)
        if self._sample.due(self.spec.sample):
            self._pending.append((batch, results, True))
        return self.encoder.encode(batch, results, infer_ms, sum(rows))

    def offer(self, batch: list[Request], results: Sequence[Any]) -> None:
        """A live batch was computed: keep it for the candidate if it is in the sample."""
        spec = self.spec
        if self.ready and spec is not None and spec.canary == 0 and self._sample.due(spec.sample):
            kept = [
                (req, res) for req, res in zip(batch, results) if not isinstance(res, Exception)
            ]
            if kept:
                self._pending.append(([r for r, _ in kept], [res for _, res in kept], False))

    def run_pending(self, live: ModelRuntime) -> None:
        """After the replies: compare the kept batches (never raises into the loop)."""
        pending, self._pending = self._pending, []
        for batch, results, canary in pending:
            try:
                self._compare(batch, results, canary, live)
            except Exception as exc:  # noqa: BLE001 - the shadow must never stop the live loop
                log.warning("shadow comparison failed: %s: %s", type(exc).__name__, exc)

    def _compare(
        self, batch: list[Request], results: list[Any], canary: bool, live: ModelRuntime
    ) -> None:
        assert self.runtime is not None and self.spec is not None
        other = live if canary else self.runtime
        stats = self._stats_for(live.version)
        started = time.perf_counter()
        try:
            outputs = other.predict(concat_inputs(batch), batch[0].params)
            recomputed = split_outputs(outputs, [r.rows for r in batch])
        except Exception as exc:  # noqa: BLE001 - counted: the candidate raised on these requests
            if not canary:
                stats.candidate_errors += len(batch)
            log.info(
                "shadow: %s raised on a batch of %d requests: %s", other.version, len(batch), exc
            )
            return
        other_ms = (time.perf_counter() - started) * 1000.0
        stats.batches += 1
        stats.candidate_ms += 0.0 if canary else other_ms
        stats.live_ms += other_ms if canary else 0.0
        threshold = self.spec.thresholds.decision_threshold
        for req, first, second in zip(batch, results, recomputed):
            live_out, cand_out = (second, first) if canary else (first, second)
            stats.add(compare(live_out, cand_out, req.rows, threshold))

    def _stats_for(self, live_version: str) -> PairStats:
        stats = self._stats.get(live_version)
        if stats is None:
            stats = self._stats[live_version] = PairStats()
        return stats

    # -- housekeeping: flush, decide, follow the shadow hash --------------------

    def poll(self, live: ModelRuntime) -> None:
        """Every housekeeping tick. An outage propagates (the loop waits it out); a refused
        command (an ACL without it, a script's command refused) stops the shadow, never the loop."""
        try:
            self._follow(live)
        except redis.exceptions.ResponseError as exc:
            self._refused(exc)

    def _refused(self, exc: redis.exceptions.ResponseError) -> None:
        """Stop this worker's shadow (or canary) and alert ``shadow_failed``, once per candidate."""
        spec = self.spec
        seq = -1 if spec is None else spec.seq
        if (
            spec is None or self._refused_seq == seq
        ):  # no candidate to stop, or stopped already: log it once
            if self._refused_seq != seq:
                log.warning("model %s: Redis refused a shadow command (%s)", self.keys.name, exc)
            self._refused_seq = seq
            return
        self._refused_seq = seq
        self.ready, self.runtime, self.encoder, self._pending, self._stats = (
            False,
            None,
            None,
            [],
            {},
        )
        self.error = (
            f"version {spec.version}: Redis refused a shadow command ({exc}); "
            "shadow stopped on this worker"
        )
        log.error("model %s: %s; serving the live model only", self.keys.name, self.error)
        try:
            self.alert([Alert("shadow_failed", self.error, self.settings.consumer, spec.version)])
        except redis.exceptions.RedisError as alert_exc:
            log.warning(
                "model %s: the shadow_failed alert was not published: %s", self.keys.name, alert_exc
            )

    def _follow(self, live: ModelRuntime) -> None:
        """Flush and judge this worker's comparisons, then follow the shadow hash."""
        self._take_loaded()
        self._flush()
        current = read_candidate(self.client, self.keys)
        if current is None or not current.active or current.version == live.version:
            if (
                self.spec is not None
            ):  # loaded, or loading (then the copy is dropped when it arrives)
                self._unload(current)
            return
        if (
            self.spec is None
            or self.spec.seq != current.seq
            or self.spec.version != current.version
        ):
            if (
                self.spec is not None
                and self.spec.version == current.version
                and self.runtime is not None
            ):
                self.spec = (
                    current  # same model, new settings (canary share, thresholds): keep it loaded
                )
                return
            self._start_load(current, live)
        elif self.spec != current:
            self.spec = current

    def _start_load(self, candidate: Candidate, live: ModelRuntime) -> None:
        if self.runtime is not None:
            self._unload(candidate)
        self.spec, self.error = candidate, ""
        log.info(
            "model %s: candidate version %s published: loading it beside %s "
            "(sample %g, canary %g%%)",
            self.keys.name,
            candidate.version,
            live.version,
            candidate.sample,
            candidate.canary,
        )
        threading.Thread(
            target=self._load,
            args=(candidate, live.device),
            name=f"shadow-{candidate.version}",
            daemon=True,
        ).start()

    def _load(self, candidate: Candidate, device: Any) -> None:
        settings = replace(self.settings, model=candidate.model, model_version=candidate.version)
        try:
            problem = room_for_another_copy(device)
            if problem:
                raise ModelLoadError(f"no room for the candidate: {problem}")
            outcome: object = self.load(settings)
        except Exception as exc:  # noqa: BLE001 - any load failure keeps only the live model
            outcome = (
                exc
                if isinstance(exc, ModelLoadError)
                else ModelLoadError(f"{type(exc).__name__}: {exc}")
            )
        with self._lock:
            self._done = (candidate, outcome)

    def _take_loaded(self) -> None:
        with self._lock:
            done, self._done = self._done, None
        if done is None:
            return
        candidate, outcome = done
        if candidate != self.spec and (self.spec is None or candidate.seq != self.spec.seq):
            return  # superseded while it loaded
        if isinstance(outcome, ModelRuntime):
            self.runtime, self.ready = outcome, True
            self.encoder = BatchEncoder(outcome.model_meta, self.encode)
            log.info(
                "model %s: candidate %s loaded; shadowing %g of batches, canary %g%%",
                self.keys.name,
                candidate.version,
                candidate.sample,
                candidate.canary,
            )
            return
        self.error = f"version {candidate.version}: {outcome}"
        log.error(
            "model %s: the candidate %s failed to load, serving the live model only: %s",
            self.keys.name,
            candidate.version,
            outcome,
        )
        self.alert([Alert("shadow_failed", self.error, self.settings.consumer, candidate.version)])

    def _unload(self, now: Candidate | None) -> None:
        assert self.spec is not None
        log.info(
            "model %s: candidate %s unloaded (%s)",
            self.keys.name,
            self.spec.version,
            now.state if now else "no candidate",
        )
        self.ready, self.runtime, self.encoder, self.spec = False, None, None, None
        self._pending = []

    def _flush(self) -> None:
        """Add this worker's totals to the fleet's; alert or roll back on what they show."""
        spec, stats, self._stats = self.spec, self._stats, {}
        if spec is None:
            return
        for live_version, mine in stats.items():
            if mine.empty():
                continue
            totals = flush_stats(self.client, self.keys, live_version, spec.version, mine)
            self._judge(spec, live_version, totals)

    def _judge(self, spec: Candidate, live_version: str, totals: PairStats) -> None:
        if spec.state == "canary":
            reason = rollback_reason(totals, spec.thresholds)
            if reason and end_candidate(self.client, self.keys, "rolled_back", reason, spec.seq):
                log.error(
                    "model %s: canary %s rolled back: %s", self.keys.name, spec.version, reason
                )
                self.ready = False  # at once here; the other workers unload it at their next poll
                self.alert([Alert("canary_rollback", reason, self.settings.consumer, spec.version)])
            return
        reasons = verdict(totals, spec.thresholds)
        if (
            totals.compared >= spec.thresholds.min_compared
            and reasons
            and self._alerted != spec.seq
        ):
            self._alerted = spec.seq
            if self.client.hsetnx(self._alert_flag(), str(spec.seq), "1"):
                detail = f"candidate {spec.version} diverges from {live_version}: " + "; ".join(
                    reasons
                )
                self.alert(
                    [Alert("shadow_divergence", detail, self.settings.consumer, spec.version)]
                )

    def _alert_flag(self) -> str:
        return shadow_alerted_key(self.keys)

    def heartbeat_fields(self) -> dict[str, Any]:
        """The candidate as this worker has it: ``shadow`` (version and state), ``shadow_error``."""
        spec = self.spec
        if spec is None:
            return {"shadow": "", "shadow_error": self.error}
        state = (
            "loaded"
            if self.ready
            else ("off" if self.runtime is not None else ("failed" if self.error else "loading"))
        )
        return {"shadow": f"{spec.version} {state}", "shadow_error": self.error}
