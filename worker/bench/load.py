"""``inferfleet bench``: load generators, reports, and the fleet under test.

Two kinds of load drive a :class:`producer.Producer`:

* **closed loop** (:func:`run_closed`): ``concurrency`` requests in flight,
  sent pipelined by one client that collects replies from its own inbox.
  N in flight models N clients with one outstanding request each: every
  reply lets the next request go, so the load follows the fleet's speed.
* **open loop** (:func:`run_open`): request *i* is due at ``offsets[i]``
  (:func:`send_schedule`: fixed spacing, or Poisson arrivals from a seeded
  rng) and is sent then, whether or not replies came back. Latency is
  measured from each request's *scheduled* send time, so time spent queued
  behind a slow fleet, or behind a client that fell behind, counts (no
  coordinated omission); a client that fell behind also reports the send
  rate it achieved.

Latency is client-side, end to end, up to the moment the reply is taken
from the inbox. Before its warm-up each target answers one request timed on
its own (``first_ms``): a fleet worker loads and warms its model before it
joins the group, the naive baseline (:mod:`inferfleet.worker.bench.naive`) loads it then.

Schedules are pure; summaries, the markdown table, the comparison, JSON and
the PNG live in :mod:`inferfleet.worker.bench.report`;
:class:`~inferfleet.worker.bench.fleet.BenchFleet` starts and stops what a run needs (a private
Redis, the ``--spawn`` workers and the naive server). Errors: :class:`BenchError` (bad options, a
``ValueError``: the CLI exits 2) and :class:`FleetStartError` (something it started did not come up:
exit 1). Every public name is re-exported here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from inferfleet.producer import Producer, errors
from inferfleet.producer.connections import (
    translate_errors,
)  # the SDK's one seam for redis-py errors
from inferfleet.producer.protocol import Reply, decode_reply, encode_body, request_fields
from inferfleet.worker.bench.fleet import (
    BASELINES,
    BenchError,
    BenchFleet,
    FleetSetup,
    FleetStartError,
)
from inferfleet.worker.bench.plan import (
    ARRIVALS,
    BenchPlan,
    bench_inputs,
    parse_rates,
    send_schedule,
)
from inferfleet.worker.bench.report import (
    BenchReport,
    RunSpec,
    Samples,
    compare,
    first_latencies,
    latency_percentiles_ms,
    markdown_table,
    mean_batch_rows,
    render_markdown,
    report_json,
    summarize,
    write_outputs,
    write_png,
)

__all__ = [
    "ARRIVALS",
    "BASELINES",
    "BenchError",
    "BenchFleet",
    "BenchPlan",
    "BenchReport",
    "FleetSetup",
    "FleetStartError",
    "OpenLoop",
    "ProgressBars",
    "RunSpec",
    "Samples",
    "bench_inputs",
    "compare",
    "first_latencies",
    "heading",
    "latency_percentiles_ms",
    "markdown_table",
    "mean_batch_rows",
    "parse_rates",
    "render_markdown",
    "report_json",
    "run_all",
    "run_bench",
    "run_paced",
    "run_closed",
    "run_open",
    "run_target",
    "send_schedule",
    "summarize",
    "write_outputs",
    "write_png",
]

log = logging.getLogger(__name__)

_POP_COUNT = 1000  # replies taken from the inbox per round trip
_POLL_S = 0.05  # longest blocking wait for a reply
_DEADLINE_S = 60.0  # the deadline of every open-loop request, like the producer's default

#: ``on_progress(label, done, total)``: how far the current step is.
ProgressFn = Callable[[str, int, int], None]


# --------------------------------------------------------------------------- tables


def heading(setup: FleetSetup, plan: BenchPlan) -> str:
    """The report's title and one line on what was measured."""
    return f"# inferfleet bench\n\n{setup.describe()}; {plan.describe()}."


# --------------------------------------------------------------------------- load generators


class _Tally:
    """Latency, batch rows and errors of each reply, as replies arrive."""

    def __init__(self, requests: int, on_progress: Callable[[int], None] | None) -> None:
        self.latencies_s = np.empty(requests)
        self.batch_rows = np.zeros(requests)
        self.errors = 0
        self.done = 0
        self.on_progress = on_progress

    def add(self, reply: Reply, latency_s: float) -> None:
        """Count one reply that took ``latency_s``."""
        self.latencies_s[self.done] = latency_s
        self.batch_rows[self.done] = reply.timing.get("batch_rows") or 0
        self.errors += not reply.ok
        self.done += 1
        if self.on_progress is not None and (
            self.done % 100 == 0 or self.done == len(self.latencies_s)
        ):
            self.on_progress(self.done)

    def samples(self, seconds: float, send_rate: float | None = None) -> Samples:
        """What was counted so far, as the run's samples."""
        done = self.done
        return Samples(
            self.latencies_s[:done], self.batch_rows[:done], self.errors, seconds, send_rate
        )


def run_closed(
    producer: Producer,
    pool: list[Any],
    requests: int,
    concurrency: int,
    timeout_s: float,
    on_progress: Callable[[int], None] | None = None,
) -> Samples:
    """Keep ``concurrency`` requests in flight until ``requests`` were answered.

    One pipelined client (``Producer.imap``) stands for ``concurrency``
    clients with one outstanding request each. Latency runs from just before
    a request's pipeline is sent to the moment its reply is taken.
    """
    sent_at: dict[str, float] = {}

    def stamp(rids: list[str]) -> None:
        now = time.perf_counter()
        for rid in rids:
            sent_at[rid] = now

    tally = _Tally(requests, on_progress)
    started = time.perf_counter()
    inputs = (pool[i % len(pool)] for i in range(requests))
    for reply in producer.imap(inputs, window=concurrency, timeout_s=timeout_s, on_send=stamp):
        tally.add(reply, time.perf_counter() - sent_at.pop(reply.id))
    return tally.samples(time.perf_counter() - started)


class OpenLoop:
    """Send each request at its scheduled time (this thread); take replies as they come (another).

    Pacing uses the local clock, never a Redis blocking timeout (an idle
    Redis serves those late, at its ``hz`` tick). The receiver only
    timestamps raw replies, so it holds the GIL for microseconds; replies are
    decoded and matched to their scheduled times after the run.
    """

    def __init__(
        self,
        producer: Producer,
        pool: list[Any],
        offsets: np.ndarray,
        timeout_s: float,
        on_progress: Callable[[int], None] | None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.producer = producer
        self.bodies = [encode_body(x) for x in pool]
        self.offsets = offsets
        self.timeout_s = timeout_s
        self.on_progress = on_progress
        self.due_at: dict[str, float] = {}  # request id -> scheduled send time
        self.received: list[tuple[bytes, float]] = []  # (raw reply, when taken)
        self.failure: BaseException | None = None
        self.failed = threading.Event()
        self.clock = clock  # seconds, monotonic; tests pass a fake one
        self.pause: Callable[[float], bool] = (
            self.failed.wait
        )  # sleeps; True if the receiver failed meanwhile
        self.start = self.last_send = clock()

    def run(self) -> Samples:
        """Send every request on schedule, wait for every reply, return the samples."""
        receiver = threading.Thread(
            target=self._receive_all, name="bench-open-loop-receiver", daemon=True
        )
        self.start = self.last_send = self.clock()
        receiver.start()
        try:
            self._send_all()
            receiver.join()
        finally:
            # stops the receiver if the sender stopped early (Ctrl-C, Redis error)
            self.failed.set()
        if self.failure is not None:
            raise self.failure
        return self._samples()

    def _send_all(self) -> None:
        sent = 0
        while sent < len(self.offsets) and not self.failed.is_set():
            wait = self.start + float(self.offsets[sent]) - self.clock()
            if wait > 0 and self.pause(wait):
                break  # the receiver failed: stop sending
            due = int(np.searchsorted(self.offsets, self.clock() - self.start, side="right"))
            self._send(sent, max(due, sent + 1))
            sent = max(due, sent + 1)

    def _send(self, first: int, end: int) -> None:
        """One pipeline of XADDs for requests ``first`` to ``end - 1``, replies to the inbox."""
        pipe = self.producer.redis.pipeline(transaction=False)
        deadline_ms = int((time.time() + _DEADLINE_S) * 1000)
        for i in range(first, end):
            rid = self.producer.new_request_id()
            body = self.bodies[i % len(self.bodies)]
            pipe.xadd(
                self.producer.keys.requests,
                request_fields(rid, body, deadline_ms, self.producer.inbox),
            )
            self.due_at[rid] = self.start + float(self.offsets[i])
        with translate_errors():
            pipe.execute()
        self.last_send = self.clock()

    def _receive_all(self) -> None:
        try:
            while len(self.received) < len(self.offsets) and not self.failed.is_set():
                self._receive_some()
        except BaseException as exc:  # noqa: BLE001 - handed to the sending thread
            self.failure = exc
            self.failed.set()

    def _receive_some(self) -> None:
        with translate_errors():
            got = self.producer.redis.blpop([self.producer.inbox], timeout=_POLL_S)
            more = self.producer.redis.lpop(self.producer.inbox, _POP_COUNT) if got else None
        now = self.clock()
        before = len(self.received)
        self.received.extend((raw, now) for raw in ([got[1]] if got else []) + (more or []))
        total = len(self.offsets)
        if self.on_progress is not None and (
            len(self.received) // 100 > before // 100 or len(self.received) >= total
        ):
            self.on_progress(min(len(self.received), total))
        in_flight = len(self.due_at) - len(self.received)
        if (
            in_flight > 0
            and now - max(self.last_send, self.received[-1][1] if self.received else 0)
            > self.timeout_s
        ):
            raise errors.ReplyTimeout(
                f"no reply for {self.timeout_s} s with {in_flight} requests in flight"
            )

    def _samples(self) -> Samples:
        tally = _Tally(len(self.offsets), None)
        for raw, taken in self.received:
            reply = decode_reply(raw)
            due = self.due_at.pop(reply.id, None)
            if due is not None:  # else a stale reply of an earlier run
                tally.add(reply, taken - due)
        last = max((taken for _, taken in self.received), default=self.start)
        return tally.samples(last - self.start, self._send_rate())

    def _send_rate(self) -> float | None:
        spent = self.last_send - self.start
        return (len(self.offsets) - 1) / spent if len(self.offsets) > 1 and spent > 0 else None


def run_open(
    producer: Producer,
    pool: list[Any],
    offsets: np.ndarray,
    timeout_s: float,
    on_progress: Callable[[int], None] | None = None,
) -> Samples:
    """Send request *i* at ``offsets[i]`` s from now whatever the replies; collect them all.

    Requests due together go in one pipeline of XADDs (``reply_to`` this
    producer's inbox); a second thread takes replies from the inbox (BLPOP,
    then LPOP of the rest). Latency runs from each request's scheduled send
    time to the moment its reply was taken; ``send_rate`` is the rate the
    client achieved.
    """
    return OpenLoop(producer, pool, offsets, timeout_s, on_progress).run()


# --------------------------------------------------------------------------- one target, every
# target


def _first_request_ms(producer: Producer, inputs: Any, timeout_s: float) -> float:
    """Latency of one lone request; an error reply raises (nothing else would work either)."""
    started = time.perf_counter()
    producer.result(producer.submit(inputs), timeout_s)
    return (time.perf_counter() - started) * 1000


def _bar(on_progress: ProgressFn | None, label: str, total: int) -> Callable[[int], None] | None:
    if on_progress is None:
        return None
    on_progress(label, 0, total)
    return lambda done: on_progress(label, done, total)


def _run_spec(
    producer: Producer,
    pool: list[Any],
    spec: RunSpec,
    plan: BenchPlan,
    bar: Callable[[int], None] | None,
) -> Samples:
    if spec.rate is None:
        return run_closed(producer, pool, plan.requests, spec.concurrency or 1, plan.timeout_s, bar)
    offsets = send_schedule(plan.requests, spec.rate, spec.arrival, plan.seed)
    return run_open(producer, pool, offsets, plan.timeout_s, bar)


def run_target(
    producer: Producer,
    target: str,
    pool: list[Any],
    plan: BenchPlan,
    on_progress: ProgressFn | None = None,
) -> list[BenchReport]:
    """First request (timed alone), warm-up, then every run of ``plan`` against one target."""
    first_ms = _first_request_ms(producer, pool[0], plan.timeout_s)
    if plan.warmup_requests:
        run_closed(
            producer,
            pool,
            plan.warmup_requests,
            plan.warmup_window,
            plan.timeout_s,
            _bar(on_progress, f"{target}: warm-up", plan.warmup_requests),
        )
    reports: list[BenchReport] = []
    for spec in plan.runs():
        samples = _run_spec(
            producer, pool, spec, plan, _bar(on_progress, f"{target}: {spec.label}", plan.requests)
        )
        reports.append(summarize(samples, target, spec, None if reports else first_ms))
    return reports


def run_all(
    fleet: BenchFleet, pool: list[Any], plan: BenchPlan, on_progress: ProgressFn | None = None
) -> list[BenchReport]:
    """The same plan against every target of ``fleet``, one after the other."""
    reports: list[BenchReport] = []
    for target, queue in fleet.setup.targets():
        with Producer(fleet.url, queue, prefix=fleet.setup.prefix) as producer:
            reports += run_target(producer, target, pool, plan, on_progress)
    return reports


def run_bench(
    producer: Producer,
    pool: list[Any],
    requests: int,
    window: int,
    warmup: int,
    timeout_s: float,
    on_reply: Callable[[int], None] | None = None,
) -> BenchReport:
    """Warm up, then one closed loop of ``requests`` with ``window`` in flight (scripts/demo.py).

    ``on_reply(done)`` is called every 100 replies (progress bars).
    """
    if requests < 1:
        raise BenchError(f"--requests must be at least 1, got {requests}")
    if warmup:
        run_closed(producer, pool, warmup, window, timeout_s)
    spec = RunSpec(concurrency=window)
    return summarize(
        run_closed(producer, pool, requests, window, timeout_s, on_reply), "fleet", spec
    )


def run_paced(
    producer: Producer, pool: list[Any], rate: float, seconds: float, timeout_s: float
) -> BenchReport:
    """An open loop at ``rate`` requests a second for ``seconds``: the service latency at a
    stated load, not the queueing of a burst (scripts/demo.py reports it beside the peak)."""
    if rate <= 0 or seconds <= 0:
        raise BenchError(f"a paced run needs a positive rate and duration, got {rate}, {seconds}")
    requests = max(int(rate * seconds), 1)
    offsets = send_schedule(requests, rate, "poisson")
    spec = RunSpec(rate=rate)
    return summarize(run_open(producer, pool, offsets, timeout_s), "fleet", spec)


class ProgressBars:
    """Adapts a ``rich.progress.Progress`` to the ``on_progress(label, done, total)`` callback."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}

    def __call__(self, label: str, done: int, total: int) -> None:
        if label not in self.tasks:
            self.tasks[label] = self.progress.add_task(label, total=total)
        self.progress.update(self.tasks[label], completed=done)


# --------------------------------------------------------------------------- the fleet under test
