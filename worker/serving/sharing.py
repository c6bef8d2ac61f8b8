"""Fleet-wide limits and cancellation on the worker side: a check per read, never per request.

- **Limits** (``inferfleet limit``) are read at every housekeeping (one
  HGET). While none are in force the read path does nothing more. While
  some are, entries that did not come through the admission function (no
  ``admitted`` stamp: a raw producer, or a producer that has not seen the
  limits yet) are checked in one ``FCALL inferfleet_check`` per read and
  answered ``rate_limited`` or ``overloaded`` without compute.
- **Cancels**: the read tells, at no extra round trip (an EXISTS sent with
  the XREADGROUP), whether the queue's ``cancels`` set exists; only then does
  a round look its requests' marks up in one ``ZMSCORE``
  (and again before a bisect retry), and the marked ones are answered
  ``cancelled``, never computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import redis

from inferfleet.producer.protocol import QueueKeys, is_tenant
from inferfleet.producer.sharing import LIBRARY, cancels_key, check_keys, limits_key
from inferfleet.producer.transport import Round, run
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.errors import Cancelled
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.intake import Answer, Intake, fields_of
from inferfleet.worker.serving.lanes import NORMAL, lane_view
from inferfleet.worker.serving.recovery import Delivery, Recovery
from inferfleet.worker.serving.replies import ReplyWriter

__all__ = ["REFUSALS", "FleetLimits", "LaneWork", "load_library", "take_cancels"]

log = logging.getLogger(__name__)

#: The worker check's verdicts: code and message.
REFUSALS = {
    1: (
        "rate_limited",
        "the entry's tenant is over its quota and the entry bypassed the admission check",
    ),
    2: (
        "overloaded",
        "the queue is over its fleet-wide backlog limit and the entry bypassed the admission check",
    ),
}


def load_library(client: redis.Redis) -> None:
    """Load (or replace) the inferfleet Redis Function library."""
    client.function_load(LIBRARY, replace=True)


def take_cancels(client: redis.Redis, keys: QueueKeys, rids: Sequence[str]) -> set[str]:
    """The ids among ``rids`` with a live cancel mark (one ZMSCORE); their marks are removed."""
    if not rids:
        return set()
    round_ = Round()
    round_.command(("ZMSCORE", cancels_key(keys), *rids))
    now_ms = time.time() * 1000
    marked = [
        rid
        for rid, score in zip(rids, run(client, round_)[0])
        if score is not None and float(score) > now_ms
    ]
    if marked:
        client.zrem(cancels_key(keys), *marked)
    return set(marked)


def _tenant_of(fields: Mapping[bytes, bytes]) -> str:
    raw = fields.get(b"tenant")
    return raw.decode() if isinstance(raw, bytes) and is_tenant(raw) else ""


class FleetLimits:
    """The limits in force on one queue, as this worker last read them, and the per-read check."""

    def __init__(self, keys: QueueKeys) -> None:
        self.keys = keys
        self.active = False
        self.stamp: bytes | None = None
        self.quota_tenants: set[str] = set()
        self.refused: dict[
            tuple[str, str], int
        ] = {}  # (tenant label, code) -> entries refused here

    def refresh(self, client: redis.Redis) -> None:
        """Read the limits in force (at housekeeping): one HGETALL of a small hash."""
        limits = client.hgetall(limits_key(self.keys))
        self.active = bool(limits)
        self.stamp = limits.get(b"stamp")
        self.quota_tenants = {name[5:].decode() for name in limits if name.startswith(b"rate:")}

    def label(self, tenant: str) -> str:
        """The metrics label of ``tenant``.

        Itself if it has a quota (at most MAX_TENANTS), ``*`` for any other tenant, ``-`` for none.
        """
        return tenant if tenant in self.quota_tenants else "*" if tenant else "-"

    def check(
        self, client: redis.Redis, entries: Sequence[tuple[bytes, Any]]
    ) -> dict[int, tuple[str, str]]:
        """(code, message) for each position of ``entries`` refused (unstamped entries only)."""
        unstamped: list[int] = []
        tenants: list[str] = []
        for index, (_, fields) in enumerate(entries):
            if fields and fields.get(b"admitted") != self.stamp:
                unstamped.append(index)
                tenants.append(_tenant_of(fields))
        if not unstamped:
            return {}
        verdicts = client.fcall(
            "inferfleet_check", 5 + len(tenants), *check_keys(self.keys, tenants), *tenants
        )
        refused = {}
        for index, tenant, verdict in zip(unstamped, tenants, verdicts):
            if int(verdict):
                refused[index] = REFUSALS[int(verdict)]
                label = (self.label(tenant), refused[index][0])
                self.refused[label] = self.refused.get(label, 0) + 1
        if refused:
            log.info(
                "%d of %d entries refused by the fleet-wide limits", len(refused), len(entries)
            )
        return refused


class _LaneDepth:
    """Stands in for the counters in a lane's Recovery: keeps the lane's lag and pending count."""

    def __init__(self) -> None:
        self.lag: int | None = 0
        self.pending = 0

    def queue_depth(self, lag: int | None, pending: int) -> None:
        self.lag, self.pending = lag, pending


Predict = Callable[[Sequence[Request]], list[Any]]


class LaneWork:
    """What a consumer does per lane besides reading: replies and XACKs to the entry's own stream,
    each lane's recovery (replay, takeover, trim), the limits check and the cancel marks.

    The normal lane's writer and recovery are the consumer's own; with only the
    normal lane in use every call is the one the consumer made before lanes.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        settings: WorkerSettings,
        counters: Counters,
        replies: ReplyWriter,
        recovery: Recovery,
    ) -> None:
        self.redis = client
        self.keys = keys
        views = {lane: lane_view(keys, lane) for lane in (0, 2)}
        self.depths = {lane: _LaneDepth() for lane in views}
        self.writers = [
            ReplyWriter(
                client,
                views[0],
                settings.reply_ttl_s,
                replies.model_meta,
                counters,
                durability=settings.durability,
            ),
            replies,
            ReplyWriter(
                client,
                views[2],
                settings.reply_ttl_s,
                replies.model_meta,
                counters,
                durability=settings.durability,
            ),
        ]
        self.recoveries = [
            Recovery(client, views[0], settings, cast(Counters, self.depths[0])),
            recovery,
            Recovery(client, views[2], settings, cast(Counters, self.depths[2])),
        ]
        self.limits = FleetLimits(keys)
        self.counters = counters
        self._taken = [0, 0, 0]  # entries read per lane at the last housekeeping
        self.tagged = (
            False  # set once an entry of another lane was read: answers then carry their lane
        )
        self._cancels = True  # whether cancel marks existed right after the last read (read_said)

    def prepare(self) -> None:
        """At start: load the reply script and the function library; read the limits in force."""
        self.writers[NORMAL].load()
        load_library(self.redis)
        self.limits.refresh(self.redis)

    def model_changed(self, model_meta: tuple[str, str]) -> None:
        for writer in self.writers:
            writer.model_meta = model_meta

    # -- recovery of every lane --

    def replay_own(self) -> None:
        for recovery in self.recoveries:
            recovery.replay_own = True

    def replay_due(self) -> bool:
        return any(recovery.replay_own for recovery in self.recoveries)

    def replay_own_pending(self) -> None:
        for recovery in self.recoveries:
            if recovery.replay_own:
                recovery.replay_own_pending()

    def next_suspect(self) -> tuple[Delivery | None, int]:
        """The next suspect of the highest lane that has one, and its lane."""
        for lane, recovery in enumerate(self.recoveries):
            if recovery.suspects:
                return recovery.next_suspect(), lane
        return None, NORMAL

    def read_said(self, cancels: bool) -> None:
        """What the last read said of cancel marks (its EXISTS, in the same round trip)."""
        self._cancels = cancels

    def housekeep(self, read_ahead: int, taken: Sequence[int]) -> None:
        """Every lane's housekeeping, the limits, the cancel marks and the lane and tenant metrics.

        High and low lanes are kept only once their stream has entries; ``taken`` is the entries
        read per lane.
        """
        self.recoveries[NORMAL].housekeep(read_ahead=read_ahead)
        for lane in (0, 2):
            if self.redis.xlen(self.recoveries[lane].keys.requests):
                self.recoveries[lane].housekeep(read_ahead=read_ahead)
        self.limits.refresh(self.redis)
        if self._cancels:  # expired marks go (the key itself expires with its last one)
            self.redis.zremrangebyscore(cancels_key(self.keys), "-inf", int(time.time() * 1000))
        metrics = self.counters.metrics
        metrics.lanes(
            [now - before for now, before in zip(taken, self._taken)],
            {"high": self.depths[0].lag, "low": self.depths[2].lag},
        )
        self._taken = list(taken)
        for (tenant, code), count in self.limits.refused.items():
            metrics.tenant_refused(tenant, code, count)
        self.limits.refused.clear()

    # -- answers --

    def after_read(
        self,
        intake: Intake,
        entries: Sequence[tuple[bytes, Any]],
        items: list[Any],
        lanes: Sequence[int] | None,
    ) -> None:
        """Give each item of a read its entry's lane; refuse those over the fleet-wide limits."""
        if lanes is not None:
            self.tagged = True
            for item, lane in zip(items, lanes):
                item.lane = lane
        if self.limits.active:
            self.refuse_over_limits(intake, entries, items)

    def carry_lanes(self, answers: list[Answer], batch: Sequence[Request]) -> list[Answer]:
        """``answers`` (one per request of ``batch``, in order) on their requests' lanes."""
        if self.tagged:
            for answer, req in zip(answers, batch):
                answer.lane = req.lane
        return answers

    def on_lane(self, items: list[Any], lane: int) -> list[Any]:
        """``items`` (Requests or Answers) marked as entries of ``lane``."""
        if lane != NORMAL:
            self.tagged = True
            for item in items:
                item.lane = lane
        return items

    def write(self, answers: list[Answer]) -> None:
        """Reply and XACK each answer on its own lane's stream (one script call a lane)."""
        if not self.tagged:
            self.writers[NORMAL].write(answers)
            return
        by_lane: list[list[Answer]] = [[], [], []]
        for answer in answers:
            by_lane[answer.lane].append(answer)
        for lane, mine in enumerate(by_lane):
            if mine:
                self.writers[lane].write(mine)

    def refuse_over_limits(
        self, intake: Intake, entries: Sequence[tuple[bytes, Any]], items: list[Request | Answer]
    ) -> None:
        """Replace the items of entries refused by the fleet-wide limits with their refusal."""
        positions = [i for i, item in enumerate(items) if isinstance(item, Request)]
        chosen = [(entries[i][0], _as_dict(entries[i][1])) for i in positions]
        for index, (code, message) in self.limits.check(self.redis, chosen).items():
            entry_id, fields = chosen[index]
            answer = intake.refuse_entry(entry_id, fields or {}, code, message)
            answer.lane = items[positions[index]].lane
            items[positions[index]] = answer

    # -- cancel marks --

    def cancels_pending(self) -> bool:
        """Whether a round must check its requests' cancel marks (some existed at the read)."""
        return self._cancels

    def take_cancels(self, rids: Sequence[str]) -> set[str]:
        return take_cancels(self.redis, self.keys, rids)

    def drop_cancelled(
        self, requests: list[Request], answers: list[Answer], cancelled: Callable[[Request], Answer]
    ) -> list[Request]:
        """The requests not marked cancelled; the marked ones are answered (``cancelled``: their
        answer) in ``answers``. One round trip for the whole round."""
        marked = self.take_cancels([req.rid for req in requests])
        if not marked:
            return requests
        answers.extend(cancelled(req) for req in requests if req.rid in marked)
        return [req for req in requests if req.rid not in marked]

    def recheck_cancels(self, predict: Predict) -> Predict:
        """``predict`` that, on a bisect retry (every call after the first: a model error, rare),
        first looks the part's cancel marks up (one round trip): the marked requests get a
        :class:`Cancelled` result and are not computed."""
        calls = 0
        cancelled: set[str] = set()

        def guarded(part: Sequence[Request]) -> list[Any]:
            nonlocal calls
            calls += 1
            if calls > 1:
                cancelled.update(self.take_cancels([req.rid for req in part]))
            if not cancelled or not any(req.rid in cancelled for req in part):
                return predict(part)
            keep = [req for req in part if req.rid not in cancelled]
            outputs = iter(predict(keep) if keep else [])
            return [Cancelled() if req.rid in cancelled else next(outputs) for req in part]

        return guarded


def _as_dict(fields: Any) -> dict | None:
    return fields if fields is None or isinstance(fields, dict) else fields_of(fields)
