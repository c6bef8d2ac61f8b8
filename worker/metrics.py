"""Prometheus metrics: what a worker counts, and the endpoints that serve them.

Every metric is named ``inferfleet_*`` and labelled with ``queue`` (the
queue name); docs/metrics.md lists them with their meaning and example
queries. Three modes, chosen by :func:`metrics_mode`:

* ``serve``: a standalone ``inferfleet worker --metrics-port P`` records into
  the default registry and serves it on port P (:func:`serve_worker_metrics`).
* ``multiprocess``: a worker started by ``inferfleet supervise --metrics-port P``
  opens no port. The supervisor (:class:`FleetMetrics`) points
  ``PROMETHEUS_MULTIPROC_DIR`` at a private directory before spawning, each
  child's values are written to files there, and the supervisor serves them
  summed across its children, with its own gauges, on one port for the host.
* ``off``: no port, no multiprocess directory. :class:`WorkerMetrics` is then
  a no-op, so the hot path pays one attribute test.

The hot path is one Python loop serving tens of thousands of requests a
second, so the consumer reports per round and per batch: a counter is
incremented by n, and a batch's queue waits go into their histogram with one
increment per bucket touched (:func:`observe_many`) rather than one locked
``observe()`` per request.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from inferfleet.worker.errors import ConfigError

__all__ = [
    "DESIRED_WORKERS",
    "DESIRED_WORKERS_HELP",
    "WorkerMetrics",
    "FleetMetrics",
    "worker_metrics",
    "metrics_mode",
    "serve_worker_metrics",
    "observe_many",
    "reply_codes",
    "metric_names",
    "MULTIPROC_ENV",
    "REPLY_CODES",
    "ALERT_KINDS",
    "SWAP_RESULTS",
    "CACHE_TIERS",
]

log = logging.getLogger(__name__)

#: prometheus-client's switch into multiprocess mode; read when it is first imported.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

REPLY_CODES = (
    "ok",
    "bad_request",
    "too_large",
    "expired",
    "model_error",
    "dead_letter",
    "cancelled",
    "rate_limited",
    "overloaded",
)
LANES = ("high", "normal", "low")
ALERT_KINDS = ("low_confidence", "non_finite", "inconsistent")
SWAP_RESULTS = ("ok", "failed", "stale")
CACHE_TIERS = ("local", "fleet", "batch")

_ok_of = attrgetter("ok")

#: Rows per forward pass: powers of two up to 4096 (max_batch_rows defaults to 64).
ROW_BUCKETS = tuple(float(2**i) for i in range(13))
#: Enqueue to pick-up: half a millisecond (an idle fleet) to a minute (a backlog).
WAIT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
#: One forward pass: 0.1 ms (a tiny model on a CPU) to 10 s.
INFER_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


def metrics_mode(metrics_port: int) -> str:
    """``multiprocess`` (a supervised child), ``serve`` (a port of its own) or ``off``."""
    if os.environ.get(MULTIPROC_ENV):
        return "multiprocess"
    return "serve" if metrics_port > 0 else "off"


def worker_metrics(queue: str, metrics_port: int) -> WorkerMetrics:
    """The consumer's metrics for its mode: recorded when served (or supervised), else a no-op."""
    mode = metrics_mode(metrics_port)
    registry = None if mode == "off" else REGISTRY
    return WorkerMetrics(queue, registry, report_depth=mode == "serve")


def reply_codes(answers: Sequence[Any], skip: Collection[int] = ()) -> dict[str, int]:
    """Replies by code among ``answers`` (objects with ``payload``, ``ok``, ``code``);
    acknowledgements without a reply and the indexes in ``skip`` are not counted."""
    if not skip:
        ok = sum(map(_ok_of, answers))  # C-level: the usual round is all ok
        if ok == len(answers):
            return {"ok": ok} if ok else {}
    codes: dict[str, int] = {}
    for index, answer in enumerate(answers):
        if answer.payload and not (skip and index in skip):
            code = "ok" if answer.ok else (answer.code or "model_error")
            codes[code] = codes.get(code, 0) + 1
    return codes


def _http_server(port: int, registry: CollectorRegistry, address: str) -> Callable[[], None]:
    """Serve ``registry`` on /metrics of ``address``:``port``; returns a stop function."""
    try:
        server, thread = start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {address} port {port}: {exc.strerror or exc}"
        ) from exc

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop


def serve_worker_metrics(port: int, address: str = "0.0.0.0") -> Callable[[], None]:
    """Serve the default registry's /metrics on ``address``:``port``; returns a stop function."""
    stop = _http_server(port, REGISTRY, address)
    log.info("metrics on http://%s/metrics", _host_port(address, port))
    return stop


def _host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def observe_many(histogram: Any, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for every value, with one increment per bucket touched.

    prometheus-client's ``observe()`` takes a lock twice per value; a batch of
    64 queue waits would cost 128 locked increments. This reaches into the
    histogram child's buckets (``_upper_bounds``, ``_buckets``, ``_sum``,
    stable across prometheus-client releases and checked against ``observe()``
    by the unit tests), falling back to ``observe()`` if they are absent.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    if bounds is None or not hasattr(histogram, "_buckets"):
        for value in values:
            histogram.observe(value)
        return
    total = sum(values)
    if total != total:  # a NaN fits no bucket (as in observe()), and would break the sort
        values = [v for v in values if v == v]
    ordered = sorted(values)
    below = 0  # values counted in the buckets so far
    for index, bound in enumerate(bounds):
        upto = bisect_right(ordered, bound)  # observe() puts v in the first bucket with v <= bound
        if upto > below:
            histogram._buckets[index].inc(upto - below)
            below = upto
        if below == len(ordered):
            break
    histogram._sum.inc(total)


class _Families:
    """The metric families of one registry (created once: a registry refuses duplicates)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def make(
            kind: type, name: str, doc: str, labels: tuple[str, ...] = (), **extra: Any
        ) -> Any:
            return kind(name, doc, ("queue", *labels), registry=registry, **extra)

        self._traffic(make)
        self._fleet(make)

    def _traffic(self, make: Callable[..., Any]) -> None:
        """What the requests meet: replies by code, batches, waits, the cache, refusals."""
        self.requests = make(
            Counter, "inferfleet_requests_total", "Replies written, by reply code.", ("code",)
        )
        self.batch_rows = make(
            Histogram, "inferfleet_batch_rows", "Rows per forward pass.", buckets=ROW_BUCKETS
        )
        self.queue_wait = make(
            Histogram,
            "inferfleet_queue_wait_seconds",
            "Time from enqueue (the stream entry id) to pick-up by a worker.",
            buckets=WAIT_BUCKETS,
        )
        self.inference = make(
            Histogram,
            "inferfleet_inference_seconds",
            "One batch's forward pass.",
            buckets=INFER_BUCKETS,
        )
        self.cache_hits = make(
            Counter, "inferfleet_cache_hits_total", "Result cache hits.", ("tier",)
        )
        self.cache_misses = make(
            Counter, "inferfleet_cache_misses_total", "Result cache misses.", ("tier",)
        )
        self.first_chunk = make(
            Histogram,
            "inferfleet_time_to_first_chunk_seconds",
            "Time from a generative request's pick-up to its first token.",
            buckets=WAIT_BUCKETS,
        )
        self.chunks = make(
            Counter, "inferfleet_generated_tokens_total", "Tokens a generative model made."
        )
        self.live_sequences = make(
            Gauge,
            "inferfleet_live_sequences",
            "Sequences a generative worker is generating now.",
            multiprocess_mode="livesum",
        )
        self.tenant_refused = make(
            Counter,
            "inferfleet_tenant_refused_total",
            "Entries past the admission check refused by a worker, by tenant and code.",
            ("tenant", "code"),
        )

    def _fleet(self, make: Callable[..., Any]) -> None:
        """What the fleet is in: the queue's lag and pending, versions, alerts, swaps, lanes."""
        # the same reading in every worker of a host: the largest (the latest) is the one to show
        self.lag = make(
            Gauge,
            "inferfleet_queue_lag",
            "Entries not yet delivered to group workers.",
            multiprocess_mode="livemax",
        )
        self.pending = make(
            Gauge,
            "inferfleet_queue_pending",
            "Entries delivered, not yet acknowledged.",
            multiprocess_mode="livemax",
        )
        # one series per live worker process (a pid label in a supervised fleet): summed per version
        # it counts the workers serving each version, and a dead worker's series goes with it
        self.model_info = make(
            Gauge,
            "inferfleet_model_info",
            "1 for the model version a worker serves.",
            ("version",),
            multiprocess_mode="liveall",
        )
        self.alerts = make(
            Counter, "inferfleet_alerts_total", "Result-check alerts, by kind.", ("kind",)
        )
        self.swaps = make(
            Counter, "inferfleet_swaps_total", "Model hot swaps, by result.", ("result",)
        )
        self.not_replicated = make(
            Counter,
            "inferfleet_replies_not_replicated_total",
            "Reply rounds fewer replicas confirmed than --wait-replicas asks, within its timeout.",
        )
        self.lane_reads = make(
            Counter, "inferfleet_lane_requests_total", "Entries read, by lane.", ("lane",)
        )
        self.lane_lag = make(
            Gauge,
            "inferfleet_lane_lag",
            "Entries of a lane not yet delivered.",
            ("lane",),
            multiprocess_mode="livemax",
        )


_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_FAMILIES_LOCK = threading.Lock()


def _families(registry: CollectorRegistry) -> _Families:
    with _FAMILIES_LOCK:
        families = _FAMILIES.get(registry)
        if families is None:
            families = _FAMILIES[registry] = _Families(registry)
        return families


class WorkerMetrics:
    """What one consumer counts, labelled with its queue; a no-op when ``registry`` is None.

    Several consumers of one process and queue (tests do that) share the same
    series. With ``report_depth`` False, :meth:`queue_depth` records nothing:
    in a supervised fleet the supervisor reports the depth once for the host.
    """

    def __init__(
        self,
        queue: str,
        registry: CollectorRegistry | None = REGISTRY,
        *,
        report_depth: bool = True,
    ) -> None:
        self.queue = queue
        self.enabled = registry is not None
        self.report_depth = report_depth
        self._version: str | None = None
        self._multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        if registry is None:
            return
        self._f = _families(registry)
        # bound once: labels() looks the child up under a lock on every call
        self._requests = {code: self._f.requests.labels(queue, code) for code in REPLY_CODES}
        self._alerts = {kind: self._f.alerts.labels(queue, kind) for kind in ALERT_KINDS}
        self._swaps = {result: self._f.swaps.labels(queue, result) for result in SWAP_RESULTS}
        self._rows = self._f.batch_rows.labels(queue)
        self._wait = self._f.queue_wait.labels(queue)
        self._infer = self._f.inference.labels(queue)

    def answered(self, codes: Mapping[str, int]) -> None:
        """Count one round's replies by code (``ok`` included)."""
        if not self.enabled:
            return
        for code, count in codes.items():
            if count:
                child = self._requests.get(code) or self._f.requests.labels(self.queue, code)
                child.inc(count)

    def batch_done(self, rows: int, infer_s: float, queue_wait_s: Sequence[float]) -> None:
        """One forward pass: its rows, its duration, and each of its requests' queue wait."""
        if not self.enabled:
            return
        self._rows.observe(rows)
        self._infer.observe(infer_s)
        observe_many(self._wait, queue_wait_s)

    def generated(self, first_token_s: Sequence[float], tokens: int, step_s: float) -> None:
        """One iteration of a generative model: the times to first token of the requests that
        got theirs, the tokens made (one a live sequence), the iteration's duration."""
        if not self.enabled:
            return
        observe_many(self._f.first_chunk.labels(self.queue), first_token_s)
        self._f.chunks.labels(self.queue).inc(tokens)
        self._infer.observe(step_s)

    def live_sequences(self, count: int) -> None:
        """Sequences live in a generative worker now."""
        if self.enabled:
            self._f.live_sequences.labels(self.queue).set(count)

    def cache_lookup(self, tier: str, hits: int, misses: int) -> None:
        """Result cache lookups of one round in one tier (local, fleet or batch)."""
        if not self.enabled:
            return
        if hits:
            self._f.cache_hits.labels(self.queue, tier).inc(hits)
        if misses:
            self._f.cache_misses.labels(self.queue, tier).inc(misses)

    def alert(self, kind: str) -> None:
        """One result-check alert (low_confidence, non_finite or inconsistent)."""
        if self.enabled:
            (self._alerts.get(kind) or self._f.alerts.labels(self.queue, kind)).inc()

    def swap(self, result: str) -> None:
        """One model hot swap attempt: ok, failed or stale."""
        if self.enabled:
            (self._swaps.get(result) or self._f.swaps.labels(self.queue, result)).inc()

    def replies_not_replicated(self) -> None:
        """One round of replies fewer replicas confirmed than ``--wait-replicas`` asks."""
        if self.enabled:
            self._f.not_replicated.labels(self.queue).inc()

    def model_version(self, version: str) -> None:
        """Now serving ``version``: its info series is 1, the previous version's goes away."""
        if not self.enabled or version == self._version:
            return
        old, self._version = self._version, version
        self._f.model_info.labels(self.queue, version).set(1)
        if old is not None:
            self._f.model_info.labels(self.queue, old).set(0)
            # multiprocess mode cannot remove a series (it warns): 0 stays
            if not self._multiprocess:
                self._f.model_info.remove(self.queue, old)

    def lanes(self, read: Sequence[int], lags: Mapping[str, int | None]) -> None:
        """Entries read per lane since the last call (high, normal, low) and each lane's lag, from
        housekeeping."""
        if not self.enabled:
            return
        for lane, count in zip(LANES, read):
            if count:
                self._f.lane_reads.labels(self.queue, lane).inc(count)
        for lane, lag in lags.items():
            if lag is not None and self.report_depth:
                self._f.lane_lag.labels(self.queue, lane).set(lag)

    def tenant_refused(self, tenant: str, code: str, count: int) -> None:
        """Entries of ``tenant`` (a label of bounded cardinality) refused with ``code`` by the
        limits check."""
        if self.enabled and count:
            self._f.tenant_refused.labels(self.queue, tenant, code).inc(count)

    def queue_depth(self, lag: int | None, pending: int) -> None:
        """The group's lag (None: unknown before Redis 7) and pending count, from housekeeping."""
        if not self.enabled or not self.report_depth:
            return
        if lag is not None:
            self._f.lag.labels(self.queue).set(lag)
        self._f.pending.labels(self.queue).set(pending)


class FleetMetrics:
    """The supervisor's one endpoint for the host: its own gauges and its children's metrics.

    :meth:`start` must run before the first child is spawned: it creates a
    private directory and sets ``PROMETHEUS_MULTIPROC_DIR`` in this process's
    environment, which spawned children inherit. The supervisor's own values
    are a collector read at scrape time (never files), so they appear once.
    """

    def __init__(self, queue: str, port: int, address: str = "0.0.0.0") -> None:
        self.queue = queue
        self.port = port
        self.address = address
        self.path: str | None = None
        self.workers = 0
        self.restarts = 0
        self.lag: int | None = None
        self.pending: int | None = None
        self.desired: int | None = None
        self._stop_server: Callable[[], None] | None = None

    def start(self) -> None:
        """Create the directory, point children at it, serve /metrics on the port."""
        self.path = tempfile.mkdtemp(prefix="inferfleet-metrics-")
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.path)
        registry.register(self)  # type: ignore[arg-type]  # a collector: collect() below
        try:
            self._stop_server = _http_server(self.port, registry, self.address)
        except ConfigError:
            self.close()
            raise
        os.environ[MULTIPROC_ENV] = self.path
        log.info(
            "metrics of the fleet on http://%s/metrics (children write to %s)",
            _host_port(self.address, self.port),
            self.path,
        )

    def observed(
        self,
        workers: int,
        lag: int | None = None,
        pending: int | None = None,
        desired: int | None = None,
    ) -> None:
        """The supervisor's latest view: live worker processes, the group's lag and pending, and
        the count its scaling policy asked for."""
        self.workers = workers
        if desired is not None:
            self.desired = desired
        if lag is not None:
            self.lag = lag
        if pending is not None:
            self.pending = pending

    def restarted(self) -> None:
        """A worker died unexpectedly and is being restarted."""
        self.restarts += 1

    def process_exited(self, pid: int | None) -> None:
        """Drop a dead child's live gauges (its counters and histograms stay in the sums)."""
        if self.path is not None and pid is not None:
            mark_process_dead(pid, self.path)

    def collect(self) -> Iterator[Metric]:
        """The supervisor's own metrics, read at scrape time."""
        workers = GaugeMetricFamily(
            "inferfleet_workers", "Live worker processes of the supervisor.", labels=["queue"]
        )
        workers.add_metric([self.queue], self.workers)
        yield workers
        restarts = CounterMetricFamily(
            "inferfleet_worker_restarts", "Workers restarted after dying.", labels=["queue"]
        )
        restarts.add_metric([self.queue], self.restarts)
        yield restarts
        for name, value, doc in (
            ("inferfleet_queue_lag", self.lag, "Entries not yet delivered to group workers."),
            ("inferfleet_queue_pending", self.pending, "Entries delivered, not yet acknowledged."),
            (DESIRED_WORKERS, self.desired, DESIRED_WORKERS_HELP),
        ):
            if value is not None:
                gauge = GaugeMetricFamily(name, doc, labels=["queue"])
                gauge.add_metric([self.queue], value)
                yield gauge

    def close(self) -> None:
        """Stop serving, stop pointing children at the directory, remove it."""
        if self._stop_server is not None:
            self._stop_server()
            self._stop_server = None
        if self.path is not None:
            if os.environ.get(MULTIPROC_ENV) == self.path:
                del os.environ[MULTIPROC_ENV]
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


#: The count the scaling policy asks for: the supervisor's gauge, and what ``inferfleet scaler``
#: serves to Prometheus beside its /desired (worker/fleet/scaler.py).
DESIRED_WORKERS = "inferfleet_desired_workers"
DESIRED_WORKERS_HELP = "Workers the scaling policy wants now."


def metric_names() -> list[str]:
    """Every metric name a worker or a supervisor exports, as scraped (``_total`` on counters),
    sorted.

    Read from the families themselves (a private registry and a supervisor that serves nothing), so
    docs/metrics.md and the deployment checks compare against the code, not a copy of it.
    """
    registry = CollectorRegistry()
    _Families(registry)
    fleet = FleetMetrics("", 0)
    fleet.observed(0, lag=0, pending=0, desired=0)  # every gauge it can export, named
    families = [*registry.collect(), *fleet.collect()]
    return sorted({f.name + "_total" if f.type == "counter" else f.name for f in families})
