"""What one consumer counts: totals since start, read as snapshots, fed to Prometheus.

The consumer reports each round, batch and reply here, once. The totals only
grow; whoever shows a rate or a window subtracts an earlier
:meth:`Counters.snapshot` from a later one:

* the consumer's log line every 10 s (requests, batches, rows per batch, errors);
* the heartbeat's ``rate_rps`` and ``busy`` over each interval
  (:class:`inferfleet.worker.heartbeat.Heartbeat`), which also publishes the totals;
* the line a consumer logs when it stops.

The Prometheus series (:class:`inferfleet.worker.metrics.WorkerMetrics`) are
fed as the counts happen; with metrics off that is one attribute test a call.

One writer (the consumer thread) and readers in other threads (the
heartbeat): a snapshot reads the totals one by one, so one taken in the middle
of a round may show part of it, which the next snapshot makes up.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from inferfleet.worker.metrics import WorkerMetrics, reply_codes

__all__ = ["Counters", "Queued", "Tally"]


class Queued(Protocol):
    """What the queue-wait histogram reads of a request (a serving Request is one)."""

    enqueued_ms: int
    picked_ms: float


@dataclass(frozen=True)
class Tally:
    """Totals at one moment; the difference of two tallies is what happened between them."""

    requests: int = (
        0  # entries answered by the consumer loop (refused ones and cache hits included)
    )
    batches: int = 0  # forward passes
    rows: int = 0  # rows computed in them
    errors: int = 0  # answers that are not ok
    skipped: int = 0  # replies not written: another consumer answered first
    busy_s: float = 0.0  # seconds spent computing and replying, not waiting

    def __sub__(self, earlier: Tally) -> Tally:
        return Tally(
            self.requests - earlier.requests,
            self.batches - earlier.batches,
            self.rows - earlier.rows,
            self.errors - earlier.errors,
            self.skipped - earlier.skipped,
            self.busy_s - earlier.busy_s,
        )


class Counters:
    """One consumer's counts: the totals behind every window and rate, and the Prometheus feed.

    ``metrics`` may be replaced at any time (the metrics benchmark switches it
    between a recording and a no-op one); the totals stay.
    """

    def __init__(self, metrics: WorkerMetrics | None = None) -> None:
        self.metrics = metrics if metrics is not None else WorkerMetrics("", None)
        self.requests = 0
        self.batches = 0
        self.rows = 0
        self.errors = 0
        self.skipped = 0
        self.busy_s = 0.0

    def snapshot(self) -> Tally:
        """The totals now."""
        return Tally(self.requests, self.batches, self.rows, self.errors, self.skipped, self.busy_s)

    # -- the loop ----------------------------------------------------------

    def answered(self, requests: int, errors: int) -> None:
        """One round's entries answered, ``errors`` of them not ok."""
        self.requests += requests
        self.errors += errors

    def batch_computed(self, batch: Sequence[Queued], rows: int, infer_s: float) -> None:
        """One forward pass of ``rows`` rows over ``batch``, taking ``infer_s`` seconds."""
        self.batch_waited(
            rows, infer_s, lambda: [(r.picked_ms - r.enqueued_ms) / 1000.0 for r in batch]
        )

    def batch_waited(
        self, rows: int, infer_s: float, queue_waits_s: Callable[[], Sequence[float]]
    ) -> None:
        """One forward pass of ``rows`` rows in ``infer_s`` seconds; ``queue_waits_s()`` gives each
        of its requests' queue wait, asked for only when metrics are recorded."""
        self.batches += 1
        self.rows += rows
        if self.metrics.enabled:
            self.metrics.batch_done(rows, infer_s, queue_waits_s())

    def busy(self, seconds: float) -> None:
        """Time spent on a round: computing and replying, not waiting for entries."""
        self.busy_s += seconds

    # -- replies -----------------------------------------------------------

    def replied(self, answers: Sequence[Any], failed: Collection[int] = ()) -> None:
        """Replies written, by code (``answers`` at the indexes in ``failed`` were not)."""
        if self.metrics.enabled:
            self.metrics.answered(reply_codes(answers, failed))

    def replied_ok(self, count: int) -> None:
        """``count`` ok replies written (a batch answered from a template)."""
        if self.metrics.enabled and count:
            self.metrics.answered({"ok": count})

    def replies_not_replicated(self) -> None:
        """A round of replies too few replicas confirmed in time (``--wait-replicas``)."""
        self.metrics.replies_not_replicated()

    def replies_skipped(self, count: int) -> None:
        """Replies not written because another consumer had answered those entries."""
        self.skipped += count

    # -- the rest goes to Prometheus only ----------------------------------

    def cache_looked_up(
        self, looked_up: int, local: int, fleet: int | None, duplicates: int, unique: int
    ) -> None:
        """One round's cache lookups: hits per tier (``fleet`` None: no fleet tier), in-round
        duplicates."""
        metrics = self.metrics
        if not metrics.enabled:
            return
        metrics.cache_lookup("local", local, looked_up - local)
        if fleet is not None:
            metrics.cache_lookup("fleet", fleet, looked_up - local - fleet)
        metrics.cache_lookup("batch", duplicates, unique)

    def alert(self, kind: str) -> None:
        """One result-check or swap alert."""
        self.metrics.alert(kind)

    def swap(self, result: str) -> None:
        """One hot swap attempt: ok, failed or stale."""
        self.metrics.swap(result)

    def model_version(self, version: str) -> None:
        """Now serving ``version``."""
        self.metrics.model_version(version)

    def queue_depth(self, lag: int | None, pending: int) -> None:
        """The group's lag and pending count, as housekeeping read them."""
        self.metrics.queue_depth(lag, pending)
