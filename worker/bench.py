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
joins the group, the naive baseline (:mod:`worker.naive`) loads it then.

Schedules, summaries, the markdown table and the comparison are pure.
:class:`BenchFleet` starts and stops what a run needs: a private Redis, the
``--spawn`` workers and the naive server. Errors: :class:`BenchError` (bad
options, a ``ValueError``: the CLI exits 2) and :class:`FleetStartError`
(something it started did not come up: exit 1).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import numpy as np
import redis

from producer import Producer, errors
from producer.client import DEFAULT_REDIS_URL
from producer.protocol import DEFAULT_PREFIX, GROUP, QueueKeys, Reply, decode_reply, encode_body, request_fields
from worker.embedded import EmbeddedRedis
from worker.errors import WorkerError
from worker.npfiles import load_inputs

__all__ = [
    "ARRIVALS",
    "BASELINES",
    "BenchError",
    "BenchFleet",
    "BenchPlan",
    "BenchReport",
    "FleetSetup",
    "FleetStartError",
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
    "run_closed",
    "run_open",
    "run_target",
    "send_schedule",
    "summarize",
    "write_outputs",
    "write_png",
]

log = logging.getLogger(__name__)

ARRIVALS = ("fixed", "poisson")
BASELINES = ("none", "naive")
NAIVE_SUFFIX = "-naive"  # the naive server's queue is NAME-naive
DEFAULT_CONCURRENCY = 256
DEFAULT_NAME = "bench"
_POOL = 256  # distinct inputs cycled through (avoids measuring input generation)
_POP_COUNT = 1000  # replies taken from the inbox per round trip
_POLL_S = 0.05  # longest blocking wait for a reply
_DEADLINE_S = 60.0  # the deadline of every open-loop request, like the producer's default
_JOIN_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 10.0

#: ``on_progress(label, done, total)``: how far the current step is.
ProgressFn = Callable[[str, int, int], None]


class BenchError(ValueError):
    """The benchmark was asked for something it cannot do (bad or contradictory options)."""


class FleetStartError(WorkerError):
    """Something the benchmark started (Redis, a worker, the naive server) did not come up."""


# --------------------------------------------------------------------------- what to run


@dataclass(frozen=True)
class RunSpec:
    """One measured run: a closed loop (``concurrency``) or an open loop (``rate``)."""

    concurrency: int | None = None
    rate: float | None = None
    arrival: str = "poisson"

    @property
    def mode(self) -> str:
        """``closed`` or ``open``."""
        return "closed" if self.rate is None else "open"

    @property
    def label(self) -> str:
        """How the run reads in tables and legends."""
        if self.rate is None:
            return f"closed, {self.concurrency} in flight"
        return f"open, {self.arrival} {self.rate:,.0f}/s"


def parse_rates(rate: float | None, rates: str | None) -> tuple[float, ...]:
    """``--rate R`` or ``--rates R1,R2,...`` as a tuple of positive rates (empty: closed loop)."""
    if rate is not None and rates is not None:
        raise BenchError("give --rate or --rates, not both")
    if rate is not None:
        values = [rate]
    elif rates is not None:
        try:
            values = [float(part) for part in rates.split(",") if part.strip()]
        except ValueError as exc:
            raise BenchError(f"--rates must be numbers separated by commas, got {rates!r}") from exc
        if not values:
            raise BenchError("--rates needs at least one rate")
    else:
        return ()
    if any(not value > 0 or value == float("inf") for value in values):
        raise BenchError(f"rates must be positive requests per second, got {values}")
    return tuple(values)


@dataclass(frozen=True)
class BenchPlan:
    """The load every target gets. Validated on construction (BenchError names the option)."""

    requests: int
    rows: int = 1
    concurrency: int | None = None
    rates: tuple[float, ...] = ()
    arrival: str | None = None
    warmup: int | None = None
    seed: int = 0
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise BenchError(f"--requests must be at least 1, got {self.requests}")
        if self.rows < 1:
            raise BenchError(f"--rows must be at least 1, got {self.rows}")
        if self.concurrency is not None and self.rates:
            raise BenchError("--concurrency (closed loop) contradicts --rate/--rates (open loop): give one")
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.arrival is not None and not self.rates:
            raise BenchError("--arrival needs --rate or --rates (an open loop)")
        if self.arrival is not None and self.arrival not in ARRIVALS:
            raise BenchError(f"--arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.warmup is not None and self.warmup < 0:
            raise BenchError(f"--warmup must be at least 0, got {self.warmup}")
        if not self.timeout_s > 0:
            raise BenchError(f"--timeout-s must be positive, got {self.timeout_s}")

    def runs(self) -> list[RunSpec]:
        """The measured runs, in order: one closed loop, or one open loop per rate."""
        if not self.rates:
            return [RunSpec(concurrency=self.concurrency or DEFAULT_CONCURRENCY)]
        return [RunSpec(rate=rate, arrival=self.arrival or "poisson") for rate in self.rates]

    @property
    def warmup_requests(self) -> int:
        """``--warmup``, or by default a fifth of the requests, at most 1000."""
        return self.warmup if self.warmup is not None else min(1000, self.requests // 5)

    @property
    def warmup_window(self) -> int:
        """Requests in flight during the warm-up."""
        return self.concurrency or 64

    def describe(self) -> str:
        """One line on the load, for report headings."""
        rows = f"{self.rows} row{'s' if self.rows != 1 else ''}"
        return f"{self.requests:,} requests of {rows} per run after {self.warmup_requests:,} warm-up requests"


@dataclass(frozen=True)
class FleetSetup:
    """Which fleet to measure and what to start for it. Validated on construction."""

    name: str | None
    model: str | None = None
    spawn: int = 0
    worker_args: tuple[str, ...] = ()
    baseline: str = "none"
    redis_url: str | None = None
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if self.spawn < 0:
            raise BenchError(f"--spawn must be at least 0, got {self.spawn}")
        if self.spawn and not self.model:
            raise BenchError("--spawn needs --model: the model the spawned workers serve")
        if self.worker_args and not self.spawn:
            raise BenchError("--worker-arg is passed to spawned workers: it needs --spawn")
        if self.baseline not in BASELINES:
            raise BenchError(f"--baseline must be one of {', '.join(BASELINES)}, got {self.baseline!r}")
        if self.baseline == "naive" and not self.model:
            raise BenchError("--baseline naive needs --model: the model the naive server loads")
        if self.name is None and not self.spawn:
            raise BenchError("--name is required to measure running workers (or use --spawn N --model PATH)")
        try:
            QueueKeys(self.naive_queue if self.baseline == "naive" else self.queue, self.prefix)
        except errors.ProtocolError as exc:
            raise BenchError(str(exc)) from exc

    @property
    def queue(self) -> str:
        """The fleet's queue name."""
        return self.name or DEFAULT_NAME

    @property
    def naive_queue(self) -> str:
        """The naive server's queue name: the fleet's plus ``-naive``."""
        return self.queue + NAIVE_SUFFIX

    def targets(self) -> list[tuple[str, str]]:
        """(target label, queue name) of everything to measure: the fleet, then the baseline."""
        found = [("fleet", self.queue)]
        return found + [("naive", self.naive_queue)] if self.baseline == "naive" else found

    def describe(self) -> str:
        """One line on what was measured, for report headings."""
        fleet = f"{self.spawn} spawned worker{'s' if self.spawn != 1 else ''}" if self.spawn else "running workers"
        if self.worker_args:
            fleet += f" ({' '.join(self.worker_args)})"
        baseline = "; baseline: naive (one request at a time, model loaded on the first)" \
            if self.baseline == "naive" else ""
        return f"queue `{self.queue}`, fleet: {fleet}, model: `{self.model or '-'}`{baseline}"


# --------------------------------------------------------------------------- inputs


def _random_like(example: Any, rows: int, rng: np.random.Generator) -> Any:
    if isinstance(example, dict):
        return {k: _random_like(v, rows, rng) for k, v in example.items()}
    if isinstance(example, list):
        return [_random_like(v, rows, rng) for v in example]
    shape = (rows, *example.shape[1:])
    if example.dtype.kind == "f":
        return rng.standard_normal(shape).astype(example.dtype)
    if example.dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    high = int(min(np.iinfo(example.dtype).max, 10**6))
    return rng.integers(0, high, shape, dtype=example.dtype)


def _model_example(model_path: str) -> Any:
    import torch

    from worker.errors import ModelLoadError
    from worker.runtime import load_model

    try:
        example = load_model(model_path, torch.device("cpu"))[1]
    except ModelLoadError as exc:
        raise BenchError(f"--model: {exc}") from exc
    if example is None:
        raise BenchError(f"{model_path} carries no example inputs: pass --input instead")
    return example


def bench_inputs(model_path: str | None, input_path: str | None, rows: int, seed: int = 0) -> list[Any]:
    """A pool of random inputs shaped like ``--input`` (if given) or the model's example."""
    if model_path is None and input_path is None:
        raise BenchError("give --model (its example inputs) or --input (a .npy/.npz file)")
    if rows < 1:
        raise BenchError(f"--rows must be at least 1, got {rows}")
    if input_path is not None:
        try:
            example = load_inputs(input_path)
        except ValueError as exc:
            raise BenchError(f"--input: {exc}") from exc
    else:
        example = _model_example(model_path or "")
    rng = np.random.default_rng(seed)
    return [_random_like(example, rows, rng) for _ in range(_POOL)]


# --------------------------------------------------------------------------- pure measurements


def send_schedule(requests: int, rate: float, arrival: str, seed: int = 0) -> np.ndarray:
    """Send offsets (seconds from the start) of ``requests`` requests at ``rate`` per second.

    ``fixed``: exactly ``1 / rate`` apart. ``poisson``: exponential gaps of
    mean ``1 / rate`` from a rng seeded with ``seed`` (the same schedule for
    every target). The first request is due at 0.
    """
    if arrival == "fixed":
        return np.arange(requests, dtype=float) / rate
    if arrival != "poisson":
        raise BenchError(f"arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(requests - 1, 0))
    return np.concatenate(([0.0], np.cumsum(gaps)))


def latency_percentiles_ms(latencies_s: np.ndarray) -> tuple[float, float, float, float]:
    """(p50, p95, p99, max) of latencies given in seconds, in milliseconds."""
    p50, p95, p99 = np.percentile(latencies_s, [50, 95, 99]) * 1000
    return float(p50), float(p95), float(p99), float(np.max(latencies_s) * 1000)


def mean_batch_rows(batch_rows: np.ndarray) -> float:
    """Mean rows of the batches replies came from (replies without the figure left out)."""
    known = batch_rows[batch_rows > 0]
    return float(known.mean()) if known.size else 0.0


@dataclass
class Samples:
    """Raw measurements of one run. ``send_rate``: open loop only, the rate actually sent."""

    latencies_s: np.ndarray
    batch_rows: np.ndarray
    errors: int
    seconds: float
    send_rate: float | None = None


@dataclass
class BenchReport:
    """What one run against one target measured. Times in milliseconds, rates per second."""

    target: str
    mode: str
    concurrency: int | None
    arrival: str | None
    offered_qps: float | None
    sent_qps: float | None
    requests: int
    errors: int
    seconds: float
    qps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    first_ms: float | None
    mean_batch_rows: float
    latencies_ms: np.ndarray = field(repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """Every figure but the raw latencies, floats rounded to 3 places."""
        shown = {k: v for k, v in asdict(self).items() if k != "latencies_ms"}
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in shown.items()}

    @property
    def spec(self) -> RunSpec:
        """The run this report measured (runs of two targets pair up by it)."""
        return RunSpec(self.concurrency, self.offered_qps, self.arrival or "poisson")


def summarize(samples: Samples, target: str, spec: RunSpec, first_ms: float | None = None) -> BenchReport:
    """Turn one run's samples into its report."""
    p50, p95, p99, top = latency_percentiles_ms(samples.latencies_s)
    count = len(samples.latencies_s)
    return BenchReport(
        target=target, mode=spec.mode, concurrency=spec.concurrency,
        arrival=spec.arrival if spec.rate is not None else None, offered_qps=spec.rate,
        sent_qps=samples.send_rate, requests=count, errors=samples.errors, seconds=samples.seconds,
        qps=count / samples.seconds if samples.seconds > 0 else 0.0, p50_ms=p50, p95_ms=p95, p99_ms=p99,
        max_ms=top, first_ms=first_ms, mean_batch_rows=mean_batch_rows(samples.batch_rows),
        latencies_ms=samples.latencies_s * 1000)


# --------------------------------------------------------------------------- tables


_COLUMNS = ("target", "mode", "offered/s", "QPS", "p50 ms", "p95 ms", "p99 ms", "max ms", "first ms",
            "mean batch rows", "errors")


def _offered_cell(report: BenchReport) -> str:
    if report.offered_qps is None:
        return "-"
    cell = f"{report.offered_qps:,.0f}"
    if report.sent_qps is not None and report.sent_qps < 0.95 * report.offered_qps:
        cell += f" (sent {report.sent_qps:,.0f})"
    return cell


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_table(reports: list[BenchReport]) -> str:
    """One row per run: target, mode, offered rate, QPS, latencies, first request, batch rows, errors."""
    lines = [_row(list(_COLUMNS)), _row(["---", "---"] + ["---:"] * (len(_COLUMNS) - 2))]
    for r in reports:
        first = f"{r.first_ms:.2f}" if r.first_ms is not None else "-"
        lines.append(_row([r.target, r.spec.label, _offered_cell(r), f"{r.qps:,.0f}", f"{r.p50_ms:.2f}",
                           f"{r.p95_ms:.2f}", f"{r.p99_ms:.2f}", f"{r.max_ms:.2f}", first,
                           f"{r.mean_batch_rows:.1f}", str(r.errors)]))
    return "\n".join(lines)


def compare(reports: list[BenchReport]) -> list[dict[str, Any]]:
    """fleet / naive ratios of QPS and p99 for every run both targets made."""
    naive = {r.spec: r for r in reports if r.target == "naive"}
    pairs = [(r, naive[r.spec]) for r in reports if r.target == "fleet" and r.spec in naive]
    return [{"run": f.spec.label, "qps_ratio": round(f.qps / n.qps, 3) if n.qps else None,
             "p99_ratio": round(f.p99_ms / n.p99_ms, 3) if n.p99_ms else None} for f, n in pairs]


def first_latencies(reports: list[BenchReport]) -> dict[str, float]:
    """Each target's first-request latency (ms)."""
    return {r.target: r.first_ms for r in reports if r.first_ms is not None}


def _ratio_text(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def render_markdown(reports: list[BenchReport], heading: str | None = None) -> str:
    """The whole report: the runs table, fleet/naive ratios if any, first-request latencies."""
    parts = [heading] if heading else []
    parts.append(markdown_table(reports))
    ratios = compare(reports)
    if ratios:
        lines = [_row(["run", "QPS fleet/naive", "p99 fleet/naive"]), _row(["---", "---:", "---:"])]
        lines += [_row([c["run"], _ratio_text(c["qps_ratio"]), _ratio_text(c["p99_ratio"])]) for c in ratios]
        parts.append("\n".join(lines))
    firsts = first_latencies(reports)
    if firsts:
        parts.append("first request: " + ", ".join(f"{t} {ms:,.1f} ms" for t, ms in firsts.items()))
    return "\n\n".join(parts) + "\n"


def heading(setup: FleetSetup, plan: BenchPlan) -> str:
    """The report's title and one line on what was measured."""
    return f"# inferfleet bench\n\n{setup.describe()}; {plan.describe()}."


def report_json(reports: list[BenchReport], setup: str = "") -> dict[str, Any]:
    """The machine-readable report: setup, every run, ratios, first-request latencies."""
    return {"setup": setup, "runs": [r.as_dict() for r in reports], "comparison": compare(reports),
            "first_ms": {t: round(ms, 3) for t, ms in first_latencies(reports).items()}}


# --------------------------------------------------------------------------- the picture


def _is_sweep(reports: list[BenchReport]) -> bool:
    targets = [r.target for r in reports if r.offered_qps is not None]
    return any(targets.count(t) > 1 for t in set(targets))


_LINE_STYLES = ("-", "--", ":", "-.")


def _plot_cdf(ax: Any, reports: list[BenchReport]) -> None:
    targets = list(dict.fromkeys(r.target for r in reports))  # one colour per target
    for i, r in enumerate(reports):
        lat = np.sort(r.latencies_ms)
        nth = sum(1 for other in reports[:i] if other.target == r.target)  # one line style per run
        ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, drawstyle="steps-post",
                color=f"C{targets.index(r.target)}", linestyle=_LINE_STYLES[nth % len(_LINE_STYLES)],
                label=f"{r.target}, {r.spec.label}")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("latency CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")


def _plot_sweep(ax: Any, reports: list[BenchReport]) -> None:
    opened = [r for r in reports if r.offered_qps is not None]
    for target in dict.fromkeys(r.target for r in opened):
        runs = sorted((r for r in opened if r.target == target), key=lambda r: r.offered_qps or 0.0)
        ax.plot([r.offered_qps for r in runs], [r.qps for r in runs], "o-", label=target)
    top = max(r.offered_qps or 0.0 for r in opened)
    ax.plot([0, top], [0, top], "--", color="grey", label="achieved = offered")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("achieved QPS")
    ax.set_title("QPS against offered load")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def _plot_bars(ax: Any, reports: list[BenchReport]) -> None:
    labels = [f"{r.target}\n{r.spec.label}" for r in reports]
    targets = list(dict.fromkeys(r.target for r in reports))
    bars = ax.bar(range(len(reports)), [r.qps for r in reports],
                  color=[f"C{targets.index(r.target)}" for r in reports])
    ax.bar_label(bars, labels=[f"{r.qps:,.0f}" for r in reports])
    ax.set_xticks(range(len(reports)), labels, fontsize="small")
    ax.set_ylabel("achieved QPS")
    ax.set_title("QPS per run")
    ax.grid(True, axis="y", alpha=0.3)


def write_png(reports: list[BenchReport], path: str | Path, title: str = "") -> None:
    """Latency CDF of every run (left) and QPS against offered load, or QPS per run (right)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(13, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    _plot_cdf(left, reports)
    (_plot_sweep if _is_sweep(reports) else _plot_bars)(right, reports)
    if title:
        fig.suptitle(textwrap.fill(title, 130), fontsize="medium")
    fig.savefig(str(path), dpi=100, format="png")


def write_outputs(out_dir: str | Path, reports: list[BenchReport], markdown: str, setup: str = "") -> list[Path]:
    """Write report.md, report.json and report.png into ``out_dir`` (created); return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.md", out / "report.json", out / "report.png"]
    paths[0].write_text(markdown)
    paths[1].write_text(json.dumps(report_json(reports, setup), indent=2) + "\n")
    write_png(reports, paths[2], setup.replace("`", ""))
    return paths


# --------------------------------------------------------------------------- load generators


@contextmanager
def _redis_errors() -> Iterator[None]:
    """redis-py exceptions of the open loop's own commands, as the SDK's."""
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise errors.ConnectionError(f"Redis connection failed: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise errors.InferfleetError(f"Redis error: {exc}") from exc


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
        if self.on_progress is not None and (self.done % 100 == 0 or self.done == len(self.latencies_s)):
            self.on_progress(self.done)

    def samples(self, seconds: float, send_rate: float | None = None) -> Samples:
        """What was counted so far, as the run's samples."""
        done = self.done
        return Samples(self.latencies_s[:done], self.batch_rows[:done], self.errors, seconds, send_rate)


def run_closed(producer: Producer, pool: list[Any], requests: int, concurrency: int, timeout_s: float,
               on_progress: Callable[[int], None] | None = None) -> Samples:
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


class _OpenLoop:
    """Send each request at its scheduled time (this thread); take replies as they come (another).

    Pacing uses the local clock, never a Redis blocking timeout (an idle
    Redis serves those late, at its ``hz`` tick). The receiver only
    timestamps raw replies, so it holds the GIL for microseconds; replies are
    decoded and matched to their scheduled times after the run.
    """

    def __init__(self, producer: Producer, pool: list[Any], offsets: np.ndarray, timeout_s: float,
                 on_progress: Callable[[int], None] | None) -> None:
        self.producer = producer
        self.bodies = [encode_body(x) for x in pool]
        self.offsets = offsets
        self.timeout_s = timeout_s
        self.on_progress = on_progress
        self.due_at: dict[str, float] = {}  # request id -> scheduled send time
        self.received: list[tuple[bytes, float]] = []  # (raw reply, when taken)
        self.failure: BaseException | None = None
        self.failed = threading.Event()
        self.start = self.last_send = time.perf_counter()

    def run(self) -> Samples:
        """Send every request on schedule, wait for every reply, return the samples."""
        receiver = threading.Thread(target=self._receive_all, name="bench-open-loop-receiver", daemon=True)
        self.start = self.last_send = time.perf_counter()
        receiver.start()
        try:
            self._send_all()
            receiver.join()
        finally:
            self.failed.set()  # stops the receiver if the sender stopped early (Ctrl-C, Redis error)
        if self.failure is not None:
            raise self.failure
        return self._samples()

    def _send_all(self) -> None:
        sent = 0
        while sent < len(self.offsets) and not self.failed.is_set():
            wait = self.start + float(self.offsets[sent]) - time.perf_counter()
            if wait > 0 and self.failed.wait(wait):
                break  # the receiver failed: stop sending
            due = int(np.searchsorted(self.offsets, time.perf_counter() - self.start, side="right"))
            self._send(sent, max(due, sent + 1))
            sent = max(due, sent + 1)

    def _send(self, first: int, end: int) -> None:
        """One pipeline of XADDs for requests ``first`` to ``end - 1``, replies to the inbox."""
        pipe = self.producer.redis.pipeline(transaction=False)
        deadline_ms = int((time.time() + _DEADLINE_S) * 1000)
        for i in range(first, end):
            rid = self.producer.new_request_id()
            body = self.bodies[i % len(self.bodies)]
            pipe.xadd(self.producer.keys.requests, request_fields(rid, body, deadline_ms, self.producer.inbox))
            self.due_at[rid] = self.start + float(self.offsets[i])
        with _redis_errors():
            pipe.execute()
        self.last_send = time.perf_counter()

    def _receive_all(self) -> None:
        try:
            while len(self.received) < len(self.offsets) and not self.failed.is_set():
                self._receive_some()
        except BaseException as exc:  # noqa: BLE001 - handed to the sending thread
            self.failure = exc
            self.failed.set()

    def _receive_some(self) -> None:
        with _redis_errors():
            got = self.producer.redis.blpop([self.producer.inbox], timeout=_POLL_S)
            more = self.producer.redis.lpop(self.producer.inbox, _POP_COUNT) if got else None
        now = time.perf_counter()
        before = len(self.received)
        self.received.extend((raw, now) for raw in ([got[1]] if got else []) + (more or []))
        total = len(self.offsets)
        if self.on_progress is not None and (len(self.received) // 100 > before // 100 or len(self.received) >= total):
            self.on_progress(min(len(self.received), total))
        in_flight = len(self.due_at) - len(self.received)
        if in_flight > 0 and now - max(self.last_send, self.received[-1][1] if self.received else 0) > self.timeout_s:
            raise errors.ReplyTimeout(f"no reply for {self.timeout_s} s with {in_flight} requests in flight")

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


def run_open(producer: Producer, pool: list[Any], offsets: np.ndarray, timeout_s: float,
             on_progress: Callable[[int], None] | None = None) -> Samples:
    """Send request *i* at ``offsets[i]`` s from now whatever the replies; collect them all.

    Requests due together go in one pipeline of XADDs (``reply_to`` this
    producer's inbox); a second thread takes replies from the inbox (BLPOP,
    then LPOP of the rest). Latency runs from each request's scheduled send
    time to the moment its reply was taken; ``send_rate`` is the rate the
    client achieved.
    """
    return _OpenLoop(producer, pool, offsets, timeout_s, on_progress).run()


# --------------------------------------------------------------------------- one target, every target


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


def _run_spec(producer: Producer, pool: list[Any], spec: RunSpec, plan: BenchPlan,
              bar: Callable[[int], None] | None) -> Samples:
    if spec.rate is None:
        return run_closed(producer, pool, plan.requests, spec.concurrency or 1, plan.timeout_s, bar)
    offsets = send_schedule(plan.requests, spec.rate, spec.arrival, plan.seed)
    return run_open(producer, pool, offsets, plan.timeout_s, bar)


def run_target(producer: Producer, target: str, pool: list[Any], plan: BenchPlan,
               on_progress: ProgressFn | None = None) -> list[BenchReport]:
    """First request (timed alone), warm-up, then every run of ``plan`` against one target."""
    first_ms = _first_request_ms(producer, pool[0], plan.timeout_s)
    if plan.warmup_requests:
        run_closed(producer, pool, plan.warmup_requests, plan.warmup_window, plan.timeout_s,
                   _bar(on_progress, f"{target}: warm-up", plan.warmup_requests))
    reports: list[BenchReport] = []
    for spec in plan.runs():
        samples = _run_spec(producer, pool, spec, plan, _bar(on_progress, f"{target}: {spec.label}", plan.requests))
        reports.append(summarize(samples, target, spec, None if reports else first_ms))
    return reports


def run_all(fleet: BenchFleet, pool: list[Any], plan: BenchPlan,
            on_progress: ProgressFn | None = None) -> list[BenchReport]:
    """The same plan against every target of ``fleet``, one after the other."""
    reports: list[BenchReport] = []
    for target, queue in fleet.setup.targets():
        with Producer(fleet.url, queue, prefix=fleet.setup.prefix) as producer:
            reports += run_target(producer, target, pool, plan, on_progress)
    return reports


def run_bench(producer: Producer, pool: list[Any], requests: int, window: int, warmup: int,
              timeout_s: float, on_reply: Callable[[int], None] | None = None) -> BenchReport:
    """Warm up, then one closed loop of ``requests`` with ``window`` in flight (scripts/demo.py).

    ``on_reply(done)`` is called every 100 replies (progress bars).
    """
    if requests < 1:
        raise BenchError(f"--requests must be at least 1, got {requests}")
    if warmup:
        run_closed(producer, pool, warmup, window, timeout_s)
    spec = RunSpec(concurrency=window)
    return summarize(run_closed(producer, pool, requests, window, timeout_s, on_reply), "fleet", spec)


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


@dataclass
class _Child:
    """A process bench started, the consumer it should join as, and its captured stderr."""

    what: str
    queue: str
    consumer: str
    proc: subprocess.Popen
    log: IO[bytes]

    def log_tail(self, chars: int = 2000) -> str:
        """The end of what the process wrote to stderr."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:].strip()

    def check_alive(self) -> None:
        """Raise FleetStartError (with its stderr) if the process has exited."""
        if self.proc.poll() is not None:
            raise FleetStartError(f"{self.what} exited with status {self.proc.returncode} before joining "
                                  f"group {GROUP}:\n{self.log_tail()}")


def _child_env(url: str) -> dict[str, str]:
    env = dict(os.environ, REDIS_URL=url)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _consumers(client: redis.Redis, stream: str) -> set[str]:
    """Names of the consumers in group ``workers`` of ``stream`` (none yet: empty)."""
    try:
        found = client.xinfo_consumers(stream, GROUP)
    except redis.exceptions.ResponseError:
        return set()  # no stream or no group yet
    return {c["name"].decode() if isinstance(c["name"], bytes) else c["name"] for c in found}


def _connect(url: str) -> redis.Redis:
    try:
        return redis.Redis.from_url(url, socket_connect_timeout=5)
    except ValueError as exc:
        raise BenchError(f"--redis-url: {exc}") from exc


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class BenchFleet:
    """``with BenchFleet(setup) as fleet:`` everything ``setup`` asks to start, stopped on the way out.

    Resolves the Redis URL (a private :class:`EmbeddedRedis` when workers
    are spawned and no URL is given), starts ``setup.spawn`` ``inferfleet
    worker`` processes and the naive server, and waits until each joined
    group ``workers``. Leaving the block, normally, on an error, on Ctrl-C
    or on SIGTERM, stops what it started: SIGTERM, wait, SIGKILL.
    """

    def __init__(self, setup: FleetSetup) -> None:
        self.setup = setup
        self.url = ""
        self._redis: EmbeddedRedis | None = None
        self._children: list[_Child] = []
        self._old_sigterm: Any = None

    def __enter__(self) -> BenchFleet:
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        self.url = self._resolve_url()
        if not self.setup.spawn:
            self._check_workers_running()
        for i in range(self.setup.spawn):
            consumer = f"bench-{os.getpid()}-{i}"
            self._launch(f"worker {i}", self.setup.queue, consumer, self._worker_command(consumer))
        if self.setup.baseline == "naive":
            consumer = f"naive-{os.getpid()}"
            self._launch("the naive server", self.setup.naive_queue, consumer, self._naive_command(consumer))
        self._wait_joined()

    def _resolve_url(self) -> str:
        if self.setup.redis_url:
            return self.setup.redis_url
        if not self.setup.spawn:
            return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
        try:
            self._redis = EmbeddedRedis().start()
        except RuntimeError as exc:
            raise FleetStartError(f"cannot start a private Redis: {exc} (or pass --redis-url)") from exc
        return self._redis.url

    def _check_workers_running(self) -> None:
        stream = QueueKeys(self.setup.queue, self.setup.prefix).requests
        client = _connect(self.url)
        try:
            if not _consumers(client, stream):
                raise FleetStartError(f"no worker serves queue {self.setup.queue!r} (no consumer in group "
                                      f"{GROUP} of {stream}): start workers, or use --spawn N --model PATH")
        except redis.exceptions.RedisError as exc:
            raise FleetStartError(f"cannot reach Redis: {exc}") from exc
        finally:
            client.close()

    def _worker_command(self, consumer: str) -> list[str]:
        return [sys.executable, "-m", "worker.cli", "worker", "--name", self.setup.queue,
                "--model", self.setup.model or "", "--prefix", self.setup.prefix, "--consumer", consumer,
                "--log-level", "warning", *self.setup.worker_args]

    def _naive_command(self, consumer: str) -> list[str]:
        return [sys.executable, "-m", "worker.naive", "--name", self.setup.naive_queue,
                "--model", self.setup.model or "", "--redis-url", self.url, "--prefix", self.setup.prefix,
                "--consumer", consumer]

    def _launch(self, what: str, queue: str, consumer: str, command: list[str]) -> None:
        err = tempfile.TemporaryFile()
        proc = subprocess.Popen(command, env=_child_env(self.url), stdout=subprocess.DEVNULL, stderr=err)
        self._children.append(_Child(what, queue, consumer, proc, err))

    def _wait_joined(self) -> None:
        if not self._children:
            return
        client = _connect(self.url)
        waiting = list(self._children)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        try:
            while waiting:
                for child in list(waiting):
                    child.check_alive()
                    if child.consumer in _consumers(client, QueueKeys(child.queue, self.setup.prefix).requests):
                        waiting.remove(child)
                if waiting and time.monotonic() > deadline:
                    raise FleetStartError(f"{waiting[0].what} did not join within {_JOIN_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        except redis.exceptions.RedisError as exc:
            raise FleetStartError(f"Redis error while waiting for the workers to join: {exc}") from exc
        finally:
            client.close()

    def stop(self) -> None:
        """Stop every process started (SIGTERM, wait, SIGKILL) and the private Redis."""
        for child in self._children:
            if child.proc.poll() is None:
                child.proc.terminate()
        for child in self._children:
            try:
                child.proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            child.log.close()
        if self.setup.baseline == "naive" and self._children and self._redis is None:
            self._drop_naive_queue()
        self._children = []
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _drop_naive_queue(self) -> None:
        """The naive server never trims its stream: delete it on a shared Redis."""
        try:
            client = _connect(self.url)
            client.delete(QueueKeys(self.setup.naive_queue, self.setup.prefix).requests)
            client.close()
        except redis.exceptions.RedisError as exc:
            log.warning("could not delete the naive server's stream: %s", exc)
