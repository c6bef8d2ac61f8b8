"""The consumer loop: read, batch, infer, reply, acknowledge, reclaim, trim.

The loop is thin: what to batch, how to split and what to answer is decided
by the pure modules (:mod:`inferfleet.worker.serving.batching`,
:mod:`inferfleet.worker.serving.intake`); this module only moves bytes between them and Redis.

Replies and acknowledgements are written once per round, atomically, by
:class:`inferfleet.worker.serving.replies.ReplyWriter`: whoever acknowledges
an entry first answers it, so a request computed twice is answered once.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis

from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.producer.sharing import lane_keys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.errors import Cancelled
from inferfleet.worker.metrics import worker_metrics
from inferfleet.worker.runtime.devices import release_device_memory
from inferfleet.worker.runtime.loading import ModelRuntime
from inferfleet.worker.runtime.signature import describe_spec
from inferfleet.worker.serving.alerts import Alert
from inferfleet.worker.serving.alerts import publish as publish_alerts
from inferfleet.worker.serving.batching import (
    Request,
    collect,
    form_batches,
)
from inferfleet.worker.serving.columns import Columns, admit_read, merge_columns
from inferfleet.worker.serving.compute import (
    BatchComputer,
    ColumnsComputed,
    EncoderKind,
    encode_answer,
)
from inferfleet.worker.serving.deadletter import dead_fields
from inferfleet.worker.serving.hooks import Hooks
from inferfleet.worker.serving.intake import Answer, Intake, fields_of
from inferfleet.worker.serving.lanes import NORMAL, LaneReader
from inferfleet.worker.serving.lifecycle import ModelWatcher
from inferfleet.worker.serving.quality import CacheRound, ResultPolicy
from inferfleet.worker.serving.recovery import Delivery, Recovery
from inferfleet.worker.serving.replies import BatchEncoder, ReplyWriter
from inferfleet.worker.serving.rowlimit import RowLimit, ceiling
from inferfleet.worker.serving.sharing import LaneWork

__all__ = ["RETRYABLE", "Consumer", "dead_letter", "encode_answer", "ensure_group", "leave_group"]

log = logging.getLogger(__name__)

#: Errors the loop waits out: Redis unreachable, or full (maxmemory with noeviction).
RETRYABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.OutOfMemoryError,
)


def _describe_outage(exc: Exception) -> str:
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return "Redis refused our credentials"
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "Redis is out of memory (maxmemory)"
    return "Redis unreachable"


def ensure_group(client: redis.Redis, stream: str) -> None:
    """Create group ``workers`` at id 0 (so earlier requests are served), if missing."""
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def leave_group(client: redis.Redis, keys: QueueKeys, consumer: str) -> bool:
    """Delete ``consumer`` from the group, but only if it holds no pending entries.

    (XGROUP DELCONSUMER drops a consumer's pending entries with it; those
    must stay so another worker can reclaim them.)
    """
    try:
        mine = client.xpending_range(
            keys.requests, GROUP, min="-", max="+", count=1, consumername=consumer
        )
        if mine:
            log.warning(
                "consumer %s leaves %d+ pending entries for others to reclaim", consumer, len(mine)
            )
            return False
        client.xgroup_delconsumer(keys.requests, GROUP, consumer)
        return True
    except redis.exceptions.RedisError as exc:
        log.warning("consumer %s could not leave the group cleanly: %s", consumer, exc)
        return False


def _entries(items: list[Request | Answer | Columns]) -> int:
    """How many stream entries a round's items stand for (a Columns batch stands for many)."""
    return sum(len(item) if isinstance(item, Columns) else 1 for item in items)


def dead_letter(
    intake: Intake, entry_id: bytes, fields: Any, delivered: int, settings: WorkerSettings
) -> Answer:
    """The answer to an entry delivered ``delivered`` times, over ``max_deliveries``:
    dead-lettered."""
    reason = (
        f"delivery {delivered} is over the limit of {settings.max_deliveries}: "
        f"every worker that computed it died or lost it"
    )
    log.error("request entry %s dead-lettered: %s", entry_id.decode(errors="replace"), reason)
    answer = intake.refuse_entry(entry_id, fields, "dead_letter", reason)
    answer.dead = dead_fields(entry_id, fields, reason, delivered, settings.consumer)
    return answer


class Consumer:
    """One consumer of group ``workers`` on one queue, with one model runtime.

    It owns the loop and what the loop alone touches (the read-ahead entries,
    the intake of the current model, the batch numbers); the rest is in its
    parts: :class:`Recovery` (suspects, replay, housekeeping),
    :class:`CacheRound` and :class:`ResultPolicy` (cache and checks),
    :class:`RowLimit`, :class:`ReplyWriter` and :class:`Counters`.

    Collaborators it does not build: ``counters`` (default: this worker's
    Prometheus series, or none when metrics are off; the heartbeat reads
    them), ``watcher`` (default none: no hot swaps), ``model_source``
    (default ``settings.model``: what the runtime was loaded from) and
    ``hooks`` (default none: no shadow, no tracing), a factory given the
    consumer because the shadow reads its runtime and writers.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        runtime: ModelRuntime,
        client: redis.Redis,
        *,
        counters: Counters | None = None,
        watcher: ModelWatcher | None = None,
        model_source: str | None = None,
        hooks: Callable[[Consumer], Hooks] | None = None,
    ) -> None:
        self.settings = settings
        self.runtime = runtime
        self.redis = client
        self.keys = settings.queue_keys  # its shard's keys when the queue is sharded
        self.intake = self._intake(runtime)
        self._ready = False
        # when the loop last went round (wall clock: another process reads it)
        self.loop_at_s = time.time()
        self._prefetched: list[Request | Answer | Columns] = []  # read ahead, answered next round
        self._pool: ThreadPoolExecutor | None = None
        self.prefetch = settings.prefetch == "on" or (
            settings.prefetch == "auto" and runtime.device.type == "cuda"
        )
        # lowered after an out-of-memory error, and to what the warm-up found fits
        self.row_limit = RowLimit(ceiling(settings.max_batch_rows, runtime.fits_rows))
        self._next_stats_log = time.monotonic() + 10.0
        if counters is None:  # its metrics are labelled NAME, for every shard
            counters = Counters(worker_metrics(settings.name, settings.metrics_port))
        self.counters = counters
        self.counters.model_version(runtime.version)
        self._window = self.counters.snapshot()  # the totals at the last periodic log line
        self.results = ResultPolicy(settings, self.keys, client)
        # reads that fit a body template are admitted, computed and answered as Columns, unless
        # every request needs a digest of its own (the result cache, the consistency check), or the
        # handler decodes each request itself (per-request hooks: docs/handlers.md)
        self.columnar = not self.results.keyed and not runtime.per_request
        self._writers(client, runtime)
        self.computer = self._computer(runtime, BatchEncoder)
        self.watcher = watcher  # follows hot swaps
        # the runtime's file or handler
        self.model_source = settings.model if model_source is None else model_source
        # shadow/canary and tracing, one call per read, batch, round (serve.py)
        self.hooks: Hooks | None = None if hooks is None else hooks(self)

    def _intake(self, runtime: ModelRuntime) -> Intake:
        """The admission check for ``runtime``'s inputs, parameters and reply metadata."""
        limits, meta, spec = self.settings.limits, runtime.model_meta, runtime.input_spec
        return Intake(self.keys, limits, meta, spec, runtime.accepts_params, runtime.per_request)

    def _writers(self, client: redis.Redis, runtime: ModelRuntime) -> None:
        """What reads, recovers and answers: built once, each given what it works with."""
        self.recovery = Recovery(client, self.keys, self.settings, self.counters)
        self.cache_round = CacheRound(self.results, self.counters)
        # a read-ahead thread reads while this one writes: nothing may be held between them
        self.replies = ReplyWriter(
            client,
            self.keys,
            self.settings.reply_ttl_s,
            runtime.model_meta,
            self.counters,
            hold_behind_reads=not self.prefetch,
            durability=self.settings.durability,
        )
        self.lanes = LaneReader(self.keys)
        self.work = LaneWork(
            client, self.keys, self.settings, self.counters, self.replies, self.recovery
        )

    def _computer(self, runtime: ModelRuntime, encoder: EncoderKind) -> BatchComputer:
        """The batch computer for ``runtime``, its answers encoded by ``encoder``."""
        return BatchComputer(
            self.settings,
            runtime,
            self.results,
            self.cache_round,
            self.counters,
            # a bisect retry rechecks
            self.row_limit,
            guard=self.work.recheck_cancels,
            on_computed=self._computed,
            encoder=encoder,
        )

    def _computed(self, batch: list[Request], results: list[Any]) -> None:
        if self.hooks is not None:  # the shadow keeps a sample of the live batches
            self.hooks.computed(batch, results)

    # -- the loop ----------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; Redis outages are waited out with backoff."""
        backoff = 0.1
        while not stop.is_set():
            # once a round (or a retry): the heartbeat's loop_ms, for liveness
            self.loop_at_s = time.time()
            try:
                if not self._ready:
                    self.prepare()
                self._round()  # its replies may stay held for the next round's read (behind.py)
                backoff = 0.1
            except RETRYABLE as exc:
                log.warning("%s (%s); retrying in %.1f s", _describe_outage(exc), exc, backoff)
                self.work.replay_own()
                self.lanes.drop_held()
                self.replies.drop_held()
                self._prefetched = []  # still pending on us: the replay brings them back
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("stream or group %s vanished; recreating it", self.keys.requests)
                self.replies.drop_held()
                self._ready = False
        self._finish_prefetched()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.leave()
        log.info(
            "consumer %s stopped after %d requests in %d batches",
            self.settings.consumer,
            self.counters.requests,
            self.counters.batches,
        )

    def _finish_prefetched(self) -> None:
        """Answer what was read ahead, and write the replies held for the next read, before stopping
        or switching models (best effort: else another consumer takes them over)."""
        try:
            if self._prefetched:
                items, self._prefetched = self._prefetched, []
                self._answer(items)
            self.replies.settle()
        except redis.exceptions.RedisError as exc:
            log.warning(
                "consumer %s could not answer its read-ahead or held entries: %s",
                self.settings.consumer,
                exc,
            )

    def leave(self) -> bool:
        """Leave the group if this consumer holds no pending entries (:func:`leave_group`)."""
        return leave_group(self.redis, self.keys, self.settings.consumer)

    def prepare(self) -> None:
        """Join the group (creating it if needed) and load the reply script."""
        for stream in lane_keys(self.keys):  # every lane; the normal one is the contract's stream
            ensure_group(self.redis, stream)
            # Redis 7.0 lists a consumer only once it has been handed an entry; make it visible now
            self.redis.xgroup_createconsumer(stream, GROUP, self.settings.consumer)
        self.work.prepare()  # the reply script and the function library
        self._ready = True
        log.info(
            "consumer %s serving %s (max %d rows, wait %.1f ms)",
            self.settings.consumer,
            self.keys.requests,
            self.settings.max_batch_rows,
            self.settings.max_wait_ms,
        )

    def run_once(self) -> int:
        """One round: collect entries, answer them, acknowledge. Returns entries handled.

        Every reply of the round is written when it returns; :meth:`run` lets
        a fast-path round's replies go out with the next round's read instead.
        """
        handled = self._round()
        self.replies.settle()
        return handled

    def _round(self) -> int:
        if self.watcher is not None:
            self._maybe_switch()
        if self.work.replay_due():
            self.replies.settle()  # what it holds is pending on us too: answer it before the replay
            self._prefetched = []  # pending on us too: they come back among the suspects
            self.lanes.drop_held()
            self.work.replay_own_pending()
        suspect, lane = self.work.next_suspect()
        if suspect is not None:
            started = time.perf_counter()
            handled = self._run_suspect(suspect, lane)
            self.counters.busy(time.perf_counter() - started)
            return handled
        items = collect(
            self._read,
            self.row_limit.rows,
            self.settings.max_wait_s,
            rows_of=lambda item: 0 if isinstance(item, Answer) else item.rows,
        )
        if items:
            started = time.perf_counter()
            ahead = self._read_ahead() if self.prefetch else None
            self._answer(items)
            if ahead is not None:
                self._prefetched = ahead.result()
            self.counters.busy(time.perf_counter() - started)
        self._maybe_housekeep()
        return _entries(items)

    def _read_ahead(self) -> Future:
        """Read and decode the next round's entries in a thread while this round computes.

        torch releases the GIL inside operators, so decoding overlaps the
        forward pass. The read does not block: it takes what is queued now.
        The entries are held in ``_prefetched`` until the next round.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                1, thread_name_prefix=f"read-ahead-{self.settings.consumer}"
            )
        return self._pool.submit(self._read, self.row_limit.rows, 0.0)

    def _answer(self, items: list[Request | Answer | Columns]) -> None:
        """Compute and reply to one round of items."""
        answers = [item for item in items if isinstance(item, Answer)]
        fallback: list[Answer] = []
        columns = [item for item in items if isinstance(item, Columns)]
        for cols in merge_columns(columns) if columns else ():
            computed = self.computer.infer_columns(cols)
            if isinstance(computed, ColumnsComputed):  # answered now, from its reply template
                self.replies.write_columns(
                    computed.cols, computed.template, computed.outputs, computed.infer_ms
                )
            else:  # it left the fast path: answered with the rest
                fallback.extend(computed)
        answers.extend(fallback)
        requests = [item for item in items if isinstance(item, Request)]
        if self.work.cancels_pending() and requests:
            requests = self.work.drop_cancelled(
                requests,
                answers,
                lambda req: encode_answer(self.runtime.model_meta, req, Cancelled(), 0.0, 0),
            )
        requests, hits = self.cache_round.start(requests, self.runtime.version)
        meta = self.runtime.model_meta
        # 0 rows: not computed
        answers.extend(encode_answer(meta, req, outputs, 0.0, 0) for req, outputs in hits)
        for batch in form_batches(requests, self.row_limit.rows):
            computed = (
                self.computer.infer(batch)
                if self.hooks is None
                else self.hooks.infer(batch, self.runtime, self.computer.infer)
            )
            answers.extend(self.work.carry_lanes(computed, batch))
        answers.extend(encode_answer(meta, *duplicate) for duplicate in self.cache_round.finish())
        alerts = self.results.take_alerts()
        if alerts:  # before the replies: a client that sees its reply can see its alert
            self._alert(alerts)
        self.work.write(answers)
        self.results.flush()  # after the replies: a cache write must never delay or block one
        if self.hooks is not None:
            # after the replies: they never wait for a candidate or spans
            self.hooks.replied(self.runtime)
        self.counters.answered(_entries(items), sum(1 for a in answers if not a.ok))

    # -- reading -----------------------------------------------------------

    def _read(self, count: int, timeout_s: float | None) -> list[Request | Answer | Columns]:
        if self._prefetched:
            items, self._prefetched = self._prefetched, []
            return items
        # Idle: block in Redis (an arriving entry wakes it at once). Filling a batch:
        # never block in Redis, which ends a short BLOCK only at its next timer tick
        # (up to 100 ms with the default hz 10); collect() sleeps between polls instead.
        block = self.settings.idle_block_ms if timeout_s is None else None
        entries, lanes = self.lanes.read_behind(self.replies.behind, self.settings.consumer, count)
        if not entries:
            # never wait for entries with a held call's answer unread (its counts, its errors)
            if block is not None:
                self.replies.settle()
            entries, lanes = self.lanes.read(self.redis, self.settings.consumer, count, block)
        self.work.read_said(self.lanes.cancels)
        now_ms = time.time() * 1000.0
        special = lanes is not None or self.work.limits.active or self.lanes.cancels
        traced = self.hooks is not None and self.hooks.active  # a shadow, tracing: per request
        # the normal lane only, no limits, no cancel marks
        if self.columnar and not special and not traced:
            return admit_read(self.intake, entries, now_ms)
        admit = self.intake.admit_fast
        items = [
            admit(entry_id, fields if isinstance(fields, dict) else fields_of(fields), now_ms)
            for entry_id, fields in entries
        ]
        if special:
            self.work.after_read(self.intake, entries, items, lanes)
        return items if self.hooks is None else self.hooks.read(entries, items)

    def _run_suspect(self, delivery: Delivery, lane: int = NORMAL) -> int:
        """Compute one entry whose previous holder died, alone, counting the attempt.

        Alone, so a request that kills its worker takes no batch-mates with it;
        past ``max_deliveries`` attempts it is dead-lettered instead.
        """
        entry_id, fields, delivered = delivery
        if not fields:
            # deleted while pending: acknowledge only
            self.work.write([Answer(entry_id, None, None, lane=lane)])
            return 1
        attempt = self.work.recoveries[lane].start_attempt(entry_id, delivered)
        if attempt is None:
            return 0  # no longer ours: answered elsewhere
        if attempt > self.settings.max_deliveries:
            self.work.write(
                self.work.on_lane(
                    [dead_letter(self.intake, entry_id, fields, attempt, self.settings)], lane
                )
            )
        else:
            self._answer(
                self.work.on_lane([self.intake.admit(entry_id, fields, time.time() * 1000.0)], lane)
            )
        return 1

    # -- model hot swap ----------------------------------------------------

    def _maybe_switch(self) -> None:
        """Between rounds: take over a newly loaded model if it is still the current one."""
        assert self.watcher is not None
        outcome, published, loaded = self.watcher.take()
        if outcome == "none":
            return
        self.counters.swap(outcome)
        if outcome == "failed":
            self._alert(
                [
                    Alert(
                        "swap_failed",
                        self.watcher.error,
                        self.settings.consumer,
                        self.runtime.version,
                    )
                ]
            )
        elif outcome == "ok" and isinstance(loaded, ModelRuntime):
            self.switch_runtime(loaded, published.model)

    def _alert(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            self.counters.alert(alert.kind)
        publish_alerts(self.redis, self.keys, alerts)

    def switch_runtime(self, new: ModelRuntime, source: str) -> None:
        """Serve ``new`` (loaded from ``source``) from the next round on; the read-ahead
        entries finish on the old copy."""
        self._finish_prefetched()
        old, self.runtime, self.model_source = self.runtime, new, source
        self.intake = self._intake(new)
        self.columnar = not self.results.keyed and not new.per_request
        self.results.model_changed()
        self.replies.model_changed(new.model_meta)
        self.computer.use(new)
        self.row_limit.set_ceiling(ceiling(self.settings.max_batch_rows, new.fits_rows))
        self.work.model_changed(new.model_meta)
        self.counters.model_version(new.version)
        log.info(
            "consumer %s switched model %s from version %s to %s",
            self.settings.consumer,
            self.settings.name,
            old.version,
            new.version,
        )
        device = old.device
        del old
        gc.collect()  # the old copy's tensors go now, not at some later collection...
        # ...so the cache they leave can be returned (two workers share a GPU)
        release_device_memory(device)

    def heartbeat_fields(self) -> dict[str, Any]:
        """What the heartbeat publishes besides the counters: version, swap error, cache use."""
        return {
            "version": self.runtime.version,
            "model": self.model_source,
            "loop_ms": int(self.loop_at_s * 1000),
            "max_rows": self.row_limit.max_rows,  # the scaling policy's full batch
            "swap_error": self.watcher.error if self.watcher else "",
            # what swap and shadow check a candidate against
            "input_spec": describe_spec(spec) if (spec := self.runtime.input_spec) else "",
            **self.results.cache_fields(),
        }

    # -- housekeeping ------------------------------------------------------

    def _maybe_housekeep(self) -> None:
        now = time.monotonic()
        if self.recovery.housekeeping_due(now):
            if self.watcher is not None:
                self.watcher.poll(self.runtime.version)
            if self.hooks is not None:
                self.hooks.housekeep(self.runtime)
            self.work.housekeep(_entries(self._prefetched) + self.lanes.holding, self.lanes.taken)
        if now >= self._next_stats_log:
            self._next_stats_log = now + 10.0
            totals = self.counters.snapshot()
            s, self._window = totals - self._window, totals
            if s.requests:
                log.info(
                    "consumer %s: %d requests, %d batches, %.1f rows/batch, %d errors in the "
                    "last 10 s",
                    self.settings.consumer,
                    s.requests,
                    s.batches,
                    s.rows / max(s.batches, 1),
                    s.errors,
                )
