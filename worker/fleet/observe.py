"""What the supervisor observes each interval: the queue's lag and pending, the workers' rates.

:func:`observe` reads them from Redis (the lanes' group info, the
heartbeats, the deadlines the newest requests carry) into the
:class:`~inferfleet.worker.fleet.scaling_data.Observation` the pure policy
decides on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import redis

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import QueueKeys, parse_deadline
from inferfleet.producer.sharing import read_lanes
from inferfleet.worker.fleet.scaling_data import Observation
from inferfleet.worker.heartbeat import read_heartbeats

__all__ = ["DEADLINE_SAMPLE", "DEADLINE_WINDOW_S", "observe", "tightest_budget_s"]

log = logging.getLogger(__name__)


def _lag_and_pending(client: redis.Redis, keys: QueueKeys) -> tuple[int | None, int, float]:
    """Lag and pending summed over the queue's lanes (the lag unknown if one lane's is), and how
    long the high lane's oldest waiting request has waited."""
    try:
        lanes = read_lanes(client, keys)
    except redis.exceptions.ResponseError:  # a stream without its group yet
        return int(client.xlen(keys.requests)), 0, 0.0
    lags = [lane.lag for lane in lanes]
    lag = None if None in lags else sum(lag for lag in lags if lag is not None)
    return lag, sum(lane.pending for lane in lanes), lanes[0].wait_s


#: How many of a shard's recent requests the deadline sample reads (one XRANGE a second)...
DEADLINE_SAMPLE = 64
#: ...of those enqueued in the last this many seconds.
DEADLINE_WINDOW_S = 5.0
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def tightest_budget_s(
    client: redis.Redis, keys: QueueKeys, now_ms: float | None = None
) -> float | None:
    """The time budget recent requests carry, deadline less enqueue time (the entry id's
    milliseconds): the 10th percentile of up to DEADLINE_SAMPLE requests enqueued in the last
    DEADLINE_WINDOW_S, so one odd caller's tiny deadline does not size the fleet alone; None
    when none of them carries a deadline, or the user may not read the stream.

    XRANGE from a time, not XREVRANGE: the worker's and the operator's ACL (docs/security.md)
    grant XRANGE only."""
    since_ms = int((time.time() * 1000 if now_ms is None else now_ms) - DEADLINE_WINDOW_S * 1000)
    try:
        entries = client.xrange(keys.requests, min=f"{max(since_ms, 0)}-0", count=DEADLINE_SAMPLE)
    except redis.exceptions.NoPermissionError as exc:
        _warn_once(f"no deadline budgets for the scaling policy: {exc}")
        return None
    budgets = []
    for entry_id, fields in entries:
        try:
            deadline_ms = parse_deadline(fields.get(b"deadline"))
        except ProtocolError:
            continue  # the worker answers it bad_request; it says nothing of a budget
        if deadline_ms is not None:
            budgets.append(deadline_ms - int(entry_id.split(b"-")[0]))
    if not budgets:
        return None
    return max(0.0, sorted(budgets)[len(budgets) // 10] / 1000)


def observe(
    client: redis.Redis, keys: QueueKeys | Sequence[QueueKeys], workers: int, now_s: float
) -> Observation:
    """Read lag, pending and the workers' measured rates into an Observation.

    ``keys`` may be every shard of a sharded queue: lag and pending are then
    summed (the lag is unknown if one shard's is) and every shard's workers count.
    """
    lag: int | None = 0
    pending = 0
    high_wait_s = 0.0
    beats = []
    budgets = []
    for one in [keys] if isinstance(keys, QueueKeys) else keys:
        shard_lag, shard_pending, shard_wait_s = _lag_and_pending(client, one)
        lag = None if lag is None or shard_lag is None else lag + shard_lag
        pending += shard_pending
        high_wait_s = max(high_wait_s, shard_wait_s)
        beats.extend(read_heartbeats(client, one))
        budgets.append(tightest_budget_s(client, one))
    serving = [b for b in beats if b.state == "serving"]
    return Observation(
        now_s=now_s,
        workers=workers,
        lag=lag,
        pending=pending,
        rate_rps=sum(b.rate_rps for b in beats),
        capacity_rps=_median(b.capacity_rps for b in beats),
        high_wait_s=high_wait_s,
        ready=len(serving),
        warm_s=_median(b.warm_s for b in serving),
        service_s=_ms_to_s(_median(b.batch_ms for b in serving)),
        batch_rows=_median(b.batch_rows for b in serving),
        max_rows=_int_or_none(_median(b.max_rows for b in serving)),
        deadline_s=min((b for b in budgets if b is not None), default=None),
    )


def _median(values: Iterable[float | None]) -> float | None:
    """The median of the known values (the upper one of an even count), None if none is known."""
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _ms_to_s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000
