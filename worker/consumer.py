"""The consumer loop: read, batch, infer, reply, acknowledge, reclaim, trim.

The loop is thin: what to batch, how to split and what to answer is decided
by the pure modules (:mod:`worker.batching`, :mod:`worker.intake`); this
module only moves bytes between them and Redis.

Replies are written by one Lua script per round (:data:`REPLY_SCRIPT`): for
each entry it XACKs, and pushes the reply only if that XACK removed the
entry from the pending list. The push and the acknowledgement are one atomic
step, and a request computed twice (a slow worker whose entry was reclaimed)
is answered once: whoever acknowledges first answers.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

import redis

from producer.protocol import GROUP, QueueKeys, encode_reply_error, encode_reply_ok
from worker.batching import Request, collect, concat_inputs, form_batches, predict_isolated, split_outputs
from worker.config import WorkerSettings
from worker.heartbeat import Meter
from worker.intake import Answer, Intake
from worker.runtime import ModelRuntime

__all__ = ["Consumer", "REPLY_SCRIPT", "ensure_group"]

log = logging.getLogger(__name__)

#: KEYS = [stream, reply_key...]; ARGV = [group, ttl_ms, (entry_id, payload)...].
#: An empty payload means "acknowledge only". Returns the number of replies pushed.
REPLY_SCRIPT = """
local stream, group, ttl = KEYS[1], ARGV[1], ARGV[2]
local pushed = 0
for i = 2, #KEYS do
  local id, payload = ARGV[2 * i - 1], ARGV[2 * i]
  if redis.call('XACK', stream, group, id) == 1 and payload ~= '' then
    redis.call('RPUSH', KEYS[i], payload)
    redis.call('PEXPIRE', KEYS[i], ttl)
    pushed = pushed + 1
  end
end
return pushed
"""

_RETRYABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def ensure_group(client: redis.Redis, stream: str) -> None:
    """Create group ``workers`` at id 0 (so earlier requests are served), if missing."""
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _id_key(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class Stats:
    """Counters since the last periodic log line."""

    requests: int = 0
    batches: int = 0
    rows: int = 0
    errors: int = 0
    skipped: int = 0

    def reset(self) -> Stats:
        snapshot = Stats(**vars(self))
        self.__init__()  # type: ignore[misc]
        return snapshot


class Consumer:
    """One consumer of group ``workers`` on one queue, with one model runtime."""

    def __init__(self, settings: WorkerSettings, runtime: ModelRuntime, client: redis.Redis) -> None:
        self.settings = settings
        self.runtime = runtime
        self.redis = client
        self.keys = QueueKeys(settings.name, settings.prefix)
        self.intake = Intake(self.keys, settings.limits, runtime.model_meta,
                             runtime.input_spec, runtime.accepts_params)
        self._sha = ""
        self._ready = False
        self._backlog: list[tuple[bytes, Any]] = []
        self._replay_own = True  # first thing after start or reconnect
        self._next_housekeeping = 0.0
        self._next_stats_log = time.monotonic() + 10.0
        self.stats = Stats()
        self.total = Stats()
        self.meter = Meter()

    # -- the loop ----------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; Redis outages are waited out with backoff."""
        backoff = 0.1
        while not stop.is_set():
            try:
                if not self._ready:
                    self.prepare()
                self.run_once()
                backoff = 0.1
            except _RETRYABLE as exc:
                log.warning("Redis unreachable (%s); retrying in %.1f s", exc, backoff)
                self._replay_own = True
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("stream or group %s vanished; recreating it", self.keys.requests)
                self._ready = False
        self.leave()
        log.info("consumer %s stopped after %d requests in %d batches",
                 self.settings.consumer, self.total.requests, self.total.batches)

    def leave(self) -> bool:
        """Delete this consumer from the group, but only if it holds no pending entries.

        (XGROUP DELCONSUMER drops a consumer's pending entries with it; those
        must stay so another worker can reclaim them.)
        """
        try:
            mine = self.redis.xpending_range(self.keys.requests, GROUP, min="-", max="+", count=1,
                                             consumername=self.settings.consumer)
            if mine:
                log.warning("consumer %s leaves %d+ pending entries for others to reclaim",
                            self.settings.consumer, len(mine))
                return False
            self.redis.xgroup_delconsumer(self.keys.requests, GROUP, self.settings.consumer)
            return True
        except redis.exceptions.RedisError as exc:
            log.warning("consumer %s could not leave the group cleanly: %s", self.settings.consumer, exc)
            return False

    def prepare(self) -> None:
        """Join the group (creating it if needed) and load the reply script."""
        ensure_group(self.redis, self.keys.requests)
        self._sha = self.redis.script_load(REPLY_SCRIPT)
        self._ready = True
        log.info("consumer %s serving %s (max %d rows, wait %.1f ms)", self.settings.consumer,
                 self.keys.requests, self.settings.max_batch_rows, self.settings.max_wait_ms)

    def run_once(self) -> int:
        """One round: collect entries, answer them, acknowledge. Returns entries handled."""
        if self._replay_own:
            self._load_own_pending()
        items = collect(self._read, self.settings.max_batch_rows, self.settings.max_wait_s,
                        rows_of=lambda item: item.rows if isinstance(item, Request) else 0)
        if items:
            started = time.perf_counter()
            batches, rows = self._answer(items)
            self.meter.record(len(items), batches, rows, time.perf_counter() - started)
        self._maybe_housekeep()
        return len(items)

    def _answer(self, items: list[Request | Answer]) -> tuple[int, int]:
        """Compute and reply to one round of items; returns (batches, rows)."""
        answers = [item for item in items if isinstance(item, Answer)]
        requests = [item for item in items if isinstance(item, Request)]
        batches = form_batches(requests, self.settings.max_batch_rows)
        for batch in batches:
            answers.extend(self._infer(batch))
        self._write(answers)
        self.stats.requests += len(items)
        self.total.requests += len(items)
        self.stats.errors += sum(1 for a in answers if not a.ok)
        return len(batches), sum(r.rows for r in requests)

    # -- reading -----------------------------------------------------------

    def _read(self, count: int, timeout_s: float | None) -> list[Request | Answer]:
        if self._backlog:
            taken, self._backlog = self._backlog[:count], self._backlog[count:]
            return self._admit(taken)
        block_ms = self.settings.idle_block_ms if timeout_s is None else int(timeout_s * 1000)
        response = self.redis.xreadgroup(
            GROUP, self.settings.consumer, {self.keys.requests: ">"},
            count=count, block=block_ms if block_ms >= 1 else None,
        )
        return self._admit(response[0][1]) if response else []

    def _admit(self, entries: Iterable[tuple[bytes, Any]]) -> list[Request | Answer]:
        now_ms = time.time() * 1000.0
        return [self.intake.admit(entry_id, fields, now_ms) for entry_id, fields in entries]

    def _load_own_pending(self) -> None:
        """Replay what this consumer name was given but never acknowledged (a restart)."""
        response = self.redis.xreadgroup(GROUP, self.settings.consumer, {self.keys.requests: "0"},
                                         count=100_000)
        entries = response[0][1] if response else []
        if entries:
            log.info("replaying %d pending entries of consumer %s", len(entries), self.settings.consumer)
        self._backlog.extend(entries)
        self._replay_own = False

    # -- computing ---------------------------------------------------------

    def _infer(self, batch: list[Request]) -> list[Answer]:
        rows_total = sum(r.rows for r in batch)
        started = time.perf_counter()

        def predict(part: list[Request]) -> list[Any]:
            outputs = self.runtime.predict(concat_inputs(part), part[0].params)
            return split_outputs(outputs, [r.rows for r in part])

        results = predict_isolated(batch, predict)
        infer_ms = (time.perf_counter() - started) * 1000.0
        self.stats.batches += 1
        self.stats.rows += rows_total
        self.total.batches += 1
        log.debug("consumer %s: batch of %d rows, %d requests, %.2f ms",
                  self.settings.consumer, rows_total, len(batch), infer_ms)
        return [self._encode(req, res, infer_ms, rows_total) for req, res in zip(batch, results)]

    def _encode(self, req: Request, result: Any, infer_ms: float, batch_rows: int) -> Answer:
        meta = self.runtime.model_meta
        timing = {"queued_ms": max(0.0, req.picked_ms - req.enqueued_ms),
                  "infer_ms": infer_ms, "batch_rows": batch_rows}
        if not isinstance(result, Exception):
            try:
                return Answer(req.entry_id, req.reply_key, encode_reply_ok(req.rid, result, meta, timing), True)
            except Exception as exc:  # noqa: BLE001 - an output the contract cannot carry
                result = exc
        log.warning("request %s: model error: %s: %s", req.rid, type(result).__name__, result)
        message = f"{type(result).__name__}: {result}"
        return Answer(req.entry_id, req.reply_key, encode_reply_error(req.rid, "model_error", message, meta, timing))

    # -- writing -----------------------------------------------------------

    def _write(self, answers: list[Answer]) -> None:
        """Reply and XACK every answer in one atomic script call."""
        if not answers:
            return
        keys = [self.keys.requests]
        args: list[Any] = [GROUP, self.settings.reply_ttl_s * 1000]
        for answer in answers:
            keys.append(answer.reply_key or self.keys.requests)
            args.append(answer.entry_id)
            args.append(answer.payload or b"")
        try:
            pushed = self.redis.evalsha(self._sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:  # Redis restarted or SCRIPT FLUSH
            self._sha = self.redis.script_load(REPLY_SCRIPT)
            pushed = self.redis.evalsha(self._sha, len(keys), *keys, *args)
        expected = sum(1 for a in answers if a.payload)
        if pushed < expected:
            self.stats.skipped += expected - pushed
            log.info("%d replies skipped: those requests were already answered by another consumer",
                     expected - pushed)

    # -- housekeeping ------------------------------------------------------

    def _maybe_housekeep(self) -> None:
        now = time.monotonic()
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + self.settings.housekeeping_s
            self._trim()
            if not self._backlog:
                self._reclaim()
        if now >= self._next_stats_log:
            self._next_stats_log = now + 10.0
            s = self.stats.reset()
            if s.requests:
                log.info("consumer %s: %d requests, %d batches, %.1f rows/batch, %d errors in the last 10 s",
                         self.settings.consumer, s.requests, s.batches, s.rows / max(s.batches, 1), s.errors)

    def _trim(self) -> None:
        """Drop acknowledged entries: everything below the oldest one still needed.

        Entries at or after the group's last-delivered id may be undelivered;
        entries at or after the oldest pending id are still owed a reply.
        Neither bound can move backwards, so a concurrent read is safe.
        """
        groups = self.redis.xinfo_groups(self.keys.requests)
        group = next((g for g in groups if g["name"] in (GROUP, GROUP.encode())), None)
        if group is None:
            return
        bound = _id_key(group["last-delivered-id"])
        pending = self.redis.xpending(self.keys.requests, GROUP)
        if pending["pending"]:
            bound = min(bound, _id_key(pending["min"]))
        if bound > (0, 0):
            self.redis.xtrim(self.keys.requests, minid=f"{bound[0]}-{bound[1]}", approximate=False)

    def _reclaim(self) -> None:
        """Take over entries another consumer has held for too long (it likely died)."""
        min_idle_ms = int(self.settings.reclaim_idle_s * 1000)
        response = self.redis.xautoclaim(self.keys.requests, GROUP, self.settings.consumer,
                                         min_idle_ms, start_id="0-0", count=self.settings.max_batch_rows)
        entries = response[1] if len(response) > 1 else []
        deleted = response[2] if len(response) > 2 else []
        entries = list(entries) + [(entry_id, None) for entry_id in deleted]
        if entries:
            log.warning("consumer %s reclaimed %d entries idle for over %.0f s",
                        self.settings.consumer, len(entries), self.settings.reclaim_idle_s)
            self._backlog.extend(entries)
