"""The scaling policy's data: its settings, what it observes, its state, its decision.

Each is a frozen dataclass validated on construction: PolicySettings raises
ConfigError naming the field (a user's setting), Observation ValueError (the
supervisor's own bug). The policy itself is in
:mod:`inferfleet.worker.fleet.scaling`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from inferfleet.worker.errors import ConfigError

__all__ = [
    "POLICY_KINDS",
    "MAX_WORKERS_LIMIT",
    "Observation",
    "PolicySettings",
    "PolicyState",
    "Decision",
]

#: The policies :func:`~inferfleet.worker.fleet.scaling.desired_workers` knows.
POLICY_KINDS = ("target", "lag", "article", "keda", "fixed")
#: The largest worker count a setting may name.
MAX_WORKERS_LIMIT = 4096


@dataclass(frozen=True)
class Observation:
    """What the supervisor saw at ``now_s``.

    ``lag`` None means unknown (Redis reports NULL after deletions), never
    zero. ``capacity_rps`` that is None, not finite or not positive is
    treated as unknown. Counts must be non-negative and ``rate_rps`` a
    finite non-negative number, else ValueError names the field.
    """

    now_s: float  # monotonic seconds (supervisor's clock)
    workers: int  # live workers now
    lag: int | None  # undelivered entries (XINFO GROUPS lag); None = unknown
    pending: int  # delivered but not yet acknowledged entries
    rate_rps: float  # fleet throughput over the last interval
    capacity_rps: float | None  # what ONE worker does flat out; None = unknown
    high_wait_s: float | None = None  # how long the high lane's oldest waiting request has waited
    ready: int | None = None  # workers serving now (heartbeats); None = all of ``workers``
    warm_s: float | None = None  # how long a new worker took to serve (heartbeats); None = unknown
    service_s: float | None = None  # one batch's time (heartbeats); None = unknown
    deadline_s: float | None = None  # the tightest time budget requests carried lately; None = none
    batch_rows: float | None = None  # rows a batch lately (heartbeats); None = unknown
    max_rows: int | None = None  # the most rows a batch may have; None = unknown

    def __post_init__(self) -> None:
        _require(
            _is_number(self.now_s) and math.isfinite(self.now_s),
            "now_s",
            self.now_s,
            "a finite number",
        )
        _require(_is_count(self.workers), "workers", self.workers, "an int >= 0")
        _require(self.lag is None or _is_count(self.lag), "lag", self.lag, "None or an int >= 0")
        _require(_is_count(self.pending), "pending", self.pending, "an int >= 0")
        rate_ok = _is_number(self.rate_rps) and math.isfinite(self.rate_rps) and self.rate_rps >= 0
        _require(rate_ok, "rate_rps", self.rate_rps, "a finite number >= 0")
        _require(
            self.capacity_rps is None or _is_number(self.capacity_rps),
            "capacity_rps",
            self.capacity_rps,
            "None or a number",
        )
        wait_ok = self.high_wait_s is None or (
            _is_number(self.high_wait_s)
            and math.isfinite(self.high_wait_s)
            and self.high_wait_s >= 0
        )
        _require(wait_ok, "high_wait_s", self.high_wait_s, "None or a finite number >= 0")
        _require(self.ready is None or _is_count(self.ready), "ready", self.ready, "None or >= 0")
        ok = self.max_rows is None or (_is_count(self.max_rows) and self.max_rows >= 1)
        _require(ok, "max_rows", self.max_rows, "None or an int >= 1")
        for name in ("warm_s", "service_s", "deadline_s", "batch_rows"):
            value = getattr(self, name)
            ok = value is None or (_is_number(value) and math.isfinite(value) and value >= 0)
            _require(ok, name, value, "None or a finite number >= 0")


@dataclass(frozen=True)
class PolicySettings:
    """How the fleet scales. Validated on construction (ConfigError names the field).

    A field with a CLI option (``inferfleet supervise``) holds its help in its metadata.
    """

    kind: str = field(
        default="lag",
        metadata={  # one of POLICY_KINDS
            "help": "target: fewest workers whose predicted p99 meets --target-p99-ms; lag: "
            "drain-time target with cooldowns; article: queue>50 +1, <10 -1 every 5 s; keda: "
            "KEDA's lagCount rule (15 s sync, 300 s down window); fixed: min.",
            "env": "INFERFLEET_POLICY",
        },
    )
    min_workers: int = field(default=1, metadata={"help": "Fewest workers, even when idle."})
    max_workers: int = 4  # the CLI's default is computed: one per GPU, or the CPU count
    target_drain_s: float = field(
        default=5.0,
        metadata={"help": "Scale up when the backlog would take longer than this to drain."},
    )
    target_utilization: float = field(
        default=0.75,
        metadata={"help": "lag: steady arrivals use at most this fraction of capacity."},
    )
    down_utilization: float = field(
        default=0.4,
        metadata={"help": "lag: shrink only if the smaller fleet is at most this busy."},
    )
    up_cooldown_s: float = field(
        default=2.0, metadata={"help": "Least time between two scale-ups."}
    )
    down_cooldown_s: float = field(
        default=20.0,
        metadata={  # after ANY change
            "help": "Least time after a change before scaling down."
        },
    )
    max_step: int = field(default=2, metadata={"help": "Most workers added or removed at once."})
    target_high_wait_s: float = field(
        default=0.0,
        metadata={
            "help": "Scale up while the high lane's oldest request has waited longer than this (0: "
            "off)."
        },
    )
    target_p99_ms: float = field(
        default=200.0,
        metadata={"help": "Policy target: the p99 latency to keep requests under (ms)."},
    )
    target_down_fraction: float = (
        0.7  # target: shrink only if the smaller fleet stays this far under
    )
    default_warm_s: float = 5.0  # target: a new worker's warm-up time until one is measured
    default_capacity_rps: float = 500.0  # per-worker capacity until one is measured
    keda_lag_count: float = field(
        default=50.0, metadata={"help": "keda: one worker per this many waiting entries."}
    )
    keda_interval_s: float = 15.0  # keda: the HPA's sync period
    keda_down_window_s: float = 300.0  # keda: the HPA's scale-down stabilization window
    article_up_queue: float = field(
        default=50.0, metadata={"help": "article: +1 over this average queue per worker."}
    )
    article_down_queue: float = field(
        default=10.0, metadata={"help": "article: -1 under this average queue per worker."}
    )
    article_interval_s: float = field(
        default=5.0, metadata={"help": "article: decide at most this often (s)."}
    )

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise ConfigError(f"kind {self.kind!r} is not one of {', '.join(POLICY_KINDS)}")
        self._check_counts()
        self._check_fractions()
        _check_range("target_drain_s", self.target_drain_s, 0.0, 86400.0, low_open=True)
        _check_range("target_high_wait_s", self.target_high_wait_s, 0.0, 86400.0)
        _check_range("up_cooldown_s", self.up_cooldown_s, 0.0, 86400.0)
        _check_range("down_cooldown_s", self.down_cooldown_s, 0.0, 86400.0)
        _check_range("default_capacity_rps", self.default_capacity_rps, 0.0, 1e9, low_open=True)
        self._check_article()
        _check_range("target_p99_ms", self.target_p99_ms, 0.0, 3.6e6, low_open=True)
        _check_range(
            "target_down_fraction",
            self.target_down_fraction,
            0.0,
            1.0,
            low_open=True,
            high_open=True,
        )
        _check_range("default_warm_s", self.default_warm_s, 0.0, 86400.0)
        _check_range("keda_lag_count", self.keda_lag_count, 0.0, 1e12, low_open=True)
        _check_range("keda_interval_s", self.keda_interval_s, 0.0, 86400.0)
        _check_range("keda_down_window_s", self.keda_down_window_s, 0.0, 86400.0)

    def _check_counts(self) -> None:
        _check_int("min_workers", self.min_workers, 0, MAX_WORKERS_LIMIT)
        _check_int("max_workers", self.max_workers, 1, MAX_WORKERS_LIMIT)
        _check_int("max_step", self.max_step, 1, MAX_WORKERS_LIMIT)
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"min_workers ({self.min_workers}) must be at most max_workers ({self.max_workers})"
            )

    def _check_fractions(self) -> None:
        _check_range("target_utilization", self.target_utilization, 0.0, 1.0, low_open=True)
        _check_range(
            "down_utilization",
            self.down_utilization,
            0.0,
            self.target_utilization,
            low_open=True,
            high_open=True,
            high_name="target_utilization",
        )

    def _check_article(self) -> None:
        _check_range("article_down_queue", self.article_down_queue, 0.0, 1e12)
        _check_range(
            "article_up_queue",
            self.article_up_queue,
            self.article_down_queue,
            1e12,
            low_open=True,
            low_name="article_down_queue",
        )
        _check_range("article_interval_s", self.article_interval_s, 0.0, 86400.0)


@dataclass(frozen=True)
class PolicyState:
    """What one decision leaves for the next; the supervisor starts with ``PolicyState()``.

    Beyond the change times: when observing began, the previous observation's
    time and backlog (for the backlog's growth; None while the lag is
    unknown), the last measured per-worker capacity, and the recent arrival
    estimates as ``(now_s, arrivals_rps)`` pairs for the scale-down peak; the
    ``target`` and ``keda`` policies keep what they measure or propose too.
    """

    last_up_s: float = -math.inf
    last_down_s: float = -math.inf
    last_change_s: float = -math.inf
    last_decision_s: float = -math.inf  # the article preset's cadence
    first_observed_s: float | None = None
    last_observed_s: float = -math.inf
    last_backlog: int | None = None
    capacity_rps: float | None = None
    arrivals: tuple[tuple[float, float], ...] = ()
    capacities: tuple[tuple[float, float], ...] = ()  # target: measured capacities, for their peak
    warm_s: float | None = None  # target: the last measured warm-up time
    service_s: float | None = None  # target: the last measured batch time
    # target: (now_s, rows a batch, seconds a batch) lately, for the batch time's fit
    batches: tuple[tuple[float, float, float], ...] = ()
    max_rows: int | None = None  # target: the last known batch row limit
    proposals: tuple[tuple[float, float], ...] = ()  # keda: the raw counts, for the down window
    levels: tuple[tuple[float, float], ...] = ()  # target: unclipped arrival samples, for the mean
    means: tuple[tuple[float, float], ...] = ()  # target: those means over the last warm-up
    rises: tuple[tuple[float, float], ...] = ()  # target: how far each mean rose within a warm-up


@dataclass(frozen=True)
class Decision:
    """The worker count to run (inside the bounds, step-limited), why, and the next state."""

    workers: int
    reason: str
    state: PolicyState


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{name} must be an int from {low} to {high}, got {value!r}")


def _check_range(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    low_name: str = "",
    high_name: str = "",
) -> None:
    """ConfigError naming ``name`` and the allowed interval unless ``value`` lies inside it."""
    if not _inside(value, low, high, low_open=low_open, high_open=high_open):
        low_text = f"{low_name}={low:g}" if low_name else f"{low:g}"
        high_text = f"{high_name}={high:g}" if high_name else f"{high:g}"
        interval = f"{'(' if low_open else '['}{low_text}, {high_text}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be a number in {interval}, got {value!r}")


def _inside(value: object, low: float, high: float, *, low_open: bool, high_open: bool) -> bool:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        return False
    number = float(value)
    above = low < number if low_open else low <= number
    below = number < high if high_open else number <= high
    return above and below
