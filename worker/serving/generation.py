"""The loop of a worker serving a step-wise (generative) model: continuous batching over Redis.

Every iteration it takes new requests into free slots (read from the lanes), runs one
:meth:`Generator.iterate` (their prefill, one step of every live sequence) and writes what
that made in one script call (worker/lua/chunks.lua): a chunk to each streaming request's
reply stream (contract 1.3, :mod:`inferfleet.producer.protocol.stream`), the final chunk or
the one reply of each finished request with its XACK. The same call reads the cancel marks of
the live requests, so a cancel ends a sequence at its next step; a passed deadline does too.

A request taken over from a worker that died (or replayed after a lost connection) continues:
its stream's chunks so far are read back, the prompt and the tokens already sent are prefilled,
and numbering goes on under the next ``attempt``. The script writes a chunk only if it is its
stream's next, so a worker still writing for a request another took over is refused and drops
it: a stream never holds two chunks of one number. Admission (ids, deadlines, sizes, tenants,
the fleet-wide limits) is the one-reply worker's (:class:`Intake`, :class:`LaneWork`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import (
    GROUP,
    OK_FALSE,
    encode_chunk,
    encode_final,
    encode_reply_error,
    encode_reply_ok,
    is_expired,
    parse_chunk,
    parse_deadline,
    wants_stream,
)
from inferfleet.producer.sharing import cancels_key, lane_keys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import script
from inferfleet.worker.counters import Counters
from inferfleet.worker.runtime.stepwise import StepwiseHandler
from inferfleet.worker.serving.consumer import RETRYABLE, dead_letter, ensure_group, leave_group
from inferfleet.worker.serving.continuous import GenerationParams, Generator, Token, chunk_due
from inferfleet.worker.serving.intake import Answer, Intake, fields_of
from inferfleet.worker.serving.lanes import NORMAL, LaneReader
from inferfleet.worker.serving.recovery import Recovery
from inferfleet.worker.serving.replies import ReplyWriter
from inferfleet.worker.serving.sharing import LaneWork

__all__ = ["GenerationConsumer", "Sequence"]

log = logging.getLogger(__name__)

#: What an error reply holds near its start (its second key; stream.py and reply.py write it).
_NOT_OK = OK_FALSE


@dataclass
class Sequence:
    """One request being generated: where its output goes and what was sent so far."""

    rid: str
    entry_id: bytes
    lane: int
    stream: bool  # a streamed reply (chunks) rather than one reply
    key: str  # its reply stream, or its reply list
    enqueued_ms: float
    deadline_ms: int | None
    attempt: int = 1
    next_n: int = 0  # the number of its next chunk
    tokens: list[int] = field(default_factory=list)  # made by this attempt (the one reply's all)
    sent: int = 0  # tokens of earlier attempts (a continued stream)
    picked_s: float = field(default_factory=time.monotonic)
    first_s: float | None = None
    unsent: list[int] = field(default_factory=list)  # made, not yet in a chunk (chunk_ms)
    unsent_since: float = 0.0
    chunked: bool = False  # a chunk of this attempt went out (the first goes at once)


@dataclass
class _Item:
    """One write of an iteration (chunks.lua's item): ``kind`` c, f, r or a."""

    kind: str
    seq: Sequence
    body: bytes = b""


class GenerationConsumer:
    """One consumer of group ``workers`` serving a :class:`StepwiseHandler` continuously."""

    def __init__(
        self,
        settings: WorkerSettings,
        model: StepwiseHandler,
        client: redis.Redis,
        counters: Counters,
        model_meta: tuple[str, str],
    ) -> None:
        self.settings, self.model, self.redis = settings, model, client
        self.keys = settings.queue_keys
        self.counters, self.model_meta = counters, model_meta
        self.generator = Generator(model, "continuous")
        self.seqs: dict[str, Sequence] = {}  # by request id: waiting or live
        self.intake = Intake(self.keys, settings.limits, model_meta, None, True, True)
        replies = ReplyWriter(client, self.keys, settings.reply_ttl_s, model_meta, counters)
        self.lanes = LaneReader(self.keys)
        self.work = LaneWork(
            client,
            self.keys,
            settings,
            counters,
            replies,
            Recovery(client, self.keys, settings, counters),
        )
        self._lane_streams = lane_keys(self.keys)
        self._ready = False
        self.loop_at_s = time.time()
        self.tokens_made = 0

    # -- the loop --

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set, then finish what is live; Redis outages are waited out."""
        backoff = 0.1
        while not (stop.is_set() and not self.seqs):
            self.loop_at_s = time.time()
            try:
                if not self._ready:
                    self.prepare()
                self.iteration(admit=not stop.is_set())
                backoff = 0.1
            except RETRYABLE as exc:
                log.warning("Redis unreachable (%s); retrying in %.1f s", exc, backoff)
                self._drop_all()  # pending on us: the replay continues them from their streams
                if stop.wait(backoff):
                    break
                backoff = min(backoff * 2, 5.0)
        leave_group(self.redis, self.keys, self.settings.consumer)
        log.info("consumer %s stopped after %d tokens", self.settings.consumer, self.tokens_made)

    def prepare(self) -> None:
        """Join the group on every lane and load the scripts."""
        for stream in self._lane_streams:
            ensure_group(self.redis, stream)
            self.redis.xgroup_createconsumer(stream, GROUP, self.settings.consumer)
        self.work.prepare()
        self._script = script(self.redis, "chunks")
        self._ready = True
        log.info(
            "consumer %s generating on %s (%d slots of %d tokens)",
            self.settings.consumer,
            self.keys.requests,
            self.model.max_slots,
            self.model.max_length,
        )

    def iteration(self, admit: bool = True) -> int:
        """Admit (unless stopping), step once, write; the tokens made. Blocks in Redis (up to
        ``idle_block_ms``) only when nothing is live."""
        if self.work.replay_due():
            self._drop_all()
            self.work.replay_own_pending()
        items: list[_Item] = []
        if admit:
            self._admit(items, self.generator.idle)
        self._expire(items)
        made = self._step(items)
        self._write(items)
        self.counters.metrics.live_sequences(len(self.generator.live))
        if self.generator.idle:
            self._housekeep()
        return len(made)

    # -- admission --

    def _admit(self, items: list[_Item], block: bool) -> None:
        """Take suspects, then new entries, while the generator has room for them to wait."""
        room = self.model.max_slots - len(self.generator.waiting) - len(self.generator.live)
        entries: list[tuple[bytes, Any, int, int | None]] = []  # id, fields, lane, delivery
        while room > len(entries):
            suspect, lane = self.work.next_suspect()
            if suspect is None:
                break
            entry_id, fields, delivered = suspect
            attempt = self.work.recoveries[lane].start_attempt(entry_id, delivered)
            if attempt is not None:
                entries.append((entry_id, fields_of_any(fields), lane, attempt))
        if room > len(entries):
            entries.extend(self._read(room - len(entries), block and not entries))
        self._take(entries, items)

    def _read(self, count: int, block: bool) -> list[tuple[bytes, Any, int, int | None]]:
        wait = self.settings.idle_block_ms if block else None
        read, lanes = self.lanes.read(self.redis, self.settings.consumer, count, wait)
        self.work.read_said(self.lanes.cancels)
        return [
            (entry_id, fields_of_any(fields), NORMAL if lanes is None else lanes[i], None)
            for i, (entry_id, fields) in enumerate(read)
        ]

    def _take(self, entries: list, items: list[_Item]) -> None:
        """Admit each entry: refuse it, or queue it in the generator (streams read back first)."""
        now_ms = time.time() * 1000.0
        admitted = []
        for entry_id, fields, lane, delivered in entries:
            if delivered is not None and delivered > self.settings.max_deliveries:
                answer = dead_letter(self.intake, entry_id, fields, delivered, self.settings)
                self.work.write(self.work.on_lane([answer], lane))
                continue
            got = self.intake.admit(entry_id, fields, now_ms)
            got.lane = lane
            admitted.append((got, fields))
        if self.work.limits.active:
            checked = [a for a, _ in admitted]
            self.work.refuse_over_limits(
                self.intake, [(a.entry_id, f) for a, f in admitted], checked
            )
            admitted = list(zip(checked, (f for _, f in admitted)))
        streams = self._read_back(
            [a for a, f in admitted if not isinstance(a, Answer) and wants_stream(f or {})]
        )
        for got, fields in admitted:
            self._queue(got, fields or {}, streams, items)

    def _read_back(self, requests: list[Any]) -> dict[str, list]:
        """The chunks already in each streaming request's reply stream (one round trip)."""
        if not requests:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for req in requests:
            pipe.xrange(self.keys.chunks(req.rid))
        return {req.rid: found for req, found in zip(requests, pipe.execute())}

    def _queue(self, got: Any, fields: dict, streams: dict, items: list[_Item]) -> None:
        stream = wants_stream(fields)
        if isinstance(got, Answer):
            if got.reply_key is None or got.payload is None:
                self.work.write([got])  # no readable id: acknowledged only
                return
            seq = self._sequence(got, fields, stream)
            items.append(_Item("f" if stream else "r", seq, got.payload))
            return
        seq = self._sequence(got, fields, stream)
        try:
            prompt = self.model.encode_prompt(got.inputs)
            params = GenerationParams.from_params(got.params)
            if stream and b"reply_to" in fields:
                raise ValueError("a streamed reply goes to its own stream: drop reply_to")
        except (ValueError, TypeError) as exc:
            items.append(_Item("f" if stream else "r", seq, self._error(seq, "bad_request", exc)))
            return
        if stream and not self._continue(seq, streams.get(seq.rid, []), items):
            return
        if seq.sent:  # a stream taken over: its prompt is what it was, and the tokens sent
            prompt = np.concatenate([prompt, np.asarray(seq.tokens[: seq.sent], np.int64)])
            left = _fewer(params, seq.sent)
            seq.tokens = []
            if left is None or prompt.size >= self.model.max_length:
                items.append(_Item("f", seq, self._final(seq, [], "length")))
                return
            params = left
        try:
            self.generator.submit(seq.rid, prompt, params)
        except ValueError as exc:  # the prompt's size: the generator's rule
            items.append(_Item("f" if stream else "r", seq, self._error(seq, "bad_request", exc)))
            return
        self.seqs[seq.rid] = seq

    def _sequence(self, got: Any, fields: dict, stream: bool) -> Sequence:
        rid = got.rid or ""
        key = self.keys.chunks(rid) if stream else (got.reply_key or self.keys.reply(rid))
        try:
            deadline = parse_deadline(fields.get(b"deadline"))
        except ProtocolError:
            deadline = None  # refused by the intake already
        enqueued = float(got.entry_id.split(b"-")[0])
        return Sequence(rid, got.entry_id, got.lane, stream, key, enqueued, deadline)

    def _continue(self, seq: Sequence, found: list, items: list[_Item]) -> bool:
        """Pick up ``seq``'s stream where it is: False if it is already final (acknowledge only)."""
        tokens: list[int] = []
        for entry_id, fields in found:
            chunk = parse_chunk(entry_id, fields)
            if chunk.final:
                items.append(_Item("a", seq))
                return False
            tokens.extend(int(t) for t in chunk.tokens)
            seq.next_n, seq.attempt = chunk.n + 1, chunk.attempt + 1
        seq.tokens, seq.sent = tokens, len(tokens)
        if found:
            log.info(
                "request %s: continuing its stream at chunk %d (attempt %d, %d tokens sent)",
                seq.rid,
                seq.next_n,
                seq.attempt,
                seq.sent,
            )
        return True

    # -- generating --

    def _expire(self, items: list[_Item]) -> None:
        """End every sequence whose deadline passed (waiting or live) with ``expired``."""
        now_ms = time.time() * 1000.0
        for seq in list(self.seqs.values()):
            if seq.deadline_ms is not None and is_expired(seq.deadline_ms, now_ms):
                self._end(
                    seq, "expired", f"its deadline passed after {len(seq.tokens)} tokens", items
                )

    def _step(self, items: list[_Item]) -> list[Token]:
        """One iteration of the generator; its tokens turned into writes."""
        if self.generator.idle:
            return []
        started = time.perf_counter()
        try:
            made = self.generator.iterate()
        except Exception as exc:  # every sequence of the pass ends; the worker goes on
            log.exception("the model failed while generating: every live sequence ends")
            message = f"{type(exc).__name__}: {exc}"
            for seq in list(self.seqs.values()):
                items.append(
                    _Item("f" if seq.stream else "r", seq, self._error(seq, "model_error", message))
                )
            self._reset_slots()
            return []
        now = time.monotonic()
        first = []
        for token in made:
            seq = self.seqs[token.rid]
            seq.tokens.append(token.token)
            if seq.first_s is None:
                seq.first_s = now
                first.append(now - seq.picked_s)
            items.append(self._made(seq, token))
        self.tokens_made += len(made)
        self.counters.metrics.generated(first, len(made), time.perf_counter() - started)
        return made

    def _reset_slots(self) -> None:
        """After a failed pass: every slot released and a fresh generator, so no slot stays
        taken by a sequence the pass left half admitted."""
        for slot in range(self.model.max_slots):
            try:
                self.model.release(slot)
            except Exception:  # a model that cannot even release: logged, go on
                log.exception("the model could not release slot %d", slot)
        self.generator = Generator(self.model, "continuous")

    def _made(self, seq: Sequence, token: Token) -> _Item:
        """What ``token`` of ``seq`` writes: nothing yet (a plain request, or a chunk still
        gathering tokens: :func:`chunk_due`), a chunk, or its final chunk or reply."""
        if token.finished is None:
            if not seq.stream:
                return _Item("", seq)
            now = time.monotonic()
            if not seq.unsent:
                seq.unsent_since = now
            seq.unsent.append(token.token)
            due = chunk_due(
                len(seq.unsent), seq.chunked, seq.unsent_since, now, self.settings.chunk_ms / 1e3
            )
            if not due:
                return _Item("", seq)
            seq.chunked, tokens, seq.unsent = True, seq.unsent, []
            return _Item("c", seq, encode_chunk(seq.rid, tokens))
        del self.seqs[seq.rid]
        if seq.stream:
            last = [*seq.unsent, token.token]
            return _Item("f", seq, self._final(seq, last, token.finished))
        outputs = np.asarray(seq.tokens, np.int64)
        return _Item(
            "r", seq, encode_reply_ok(seq.rid, outputs, self.model_meta, self._timing(seq))
        )

    def _final(self, seq: Sequence, tokens: list[int], reason: str) -> bytes:
        self.seqs.pop(seq.rid, None)
        return encode_final(seq.rid, tokens, reason, self.model_meta, self._timing(seq))

    def _timing(self, seq: Sequence) -> dict[str, Any]:
        first = None if seq.first_s is None else round(1000 * (seq.first_s - seq.picked_s), 3)
        return {
            "queued_ms": max(
                0.0,
                time.time() * 1000.0 - seq.enqueued_ms - 1000 * (time.monotonic() - seq.picked_s),
            ),
            "first_token_ms": first,
            "infer_ms": round(1000 * (time.monotonic() - seq.picked_s), 3),
            "tokens": seq.sent + len(seq.tokens),
        }

    def _error(self, seq: Sequence, code: str, exc: Any) -> bytes:
        self.seqs.pop(seq.rid, None)
        message = str(exc) if not isinstance(exc, BaseException) else str(exc) or repr(exc)
        return encode_reply_error(seq.rid, code, message, self.model_meta)

    def _end(self, seq: Sequence, code: str, message: str, items: list[_Item]) -> None:
        """Stop ``seq`` now (its slot freed) and answer it with error ``code``."""
        self.generator.cancel(seq.rid)
        items.append(_Item("f" if seq.stream else "r", seq, self._error(seq, code, message)))

    # -- writing --

    def _write(self, items: list[_Item]) -> None:
        """One script call: every write of the iteration, and the live requests' cancel marks."""
        writes = [item for item in items if item.kind]
        live = list(self.seqs)
        if not writes and not (live and self.work.cancels_pending()):
            return
        keys = [cancels_key(self.keys)]
        args: list[Any] = [GROUP, self.settings.reply_ttl_s * 1000, len(writes)]
        for item in writes:
            seq = item.seq
            keys += [seq.key, self._lane_streams[seq.lane]]
            args += [item.kind, seq.entry_id, seq.next_n, seq.attempt, item.body]
            if item.kind in "cf":
                seq.next_n += 1
        refused, marked = self._script(keys=keys, args=args + live)
        for index in refused:
            self._refused(writes[index - 1])
        cancelled = [rid for rid, on in zip(live, marked) if on and rid in self.seqs]
        if cancelled:
            ends: list[_Item] = []
            for rid in cancelled:
                self._end(self.seqs[rid], "cancelled", "cancelled while generating", ends)
            self._write(ends)
        done = [w for i, w in enumerate(writes, 1) if w.kind in "fr" and i not in refused]
        self.counters.answered(len(done), sum(1 for w in done if w.body[:40].find(_NOT_OK) >= 0))

    def _refused(self, item: _Item) -> None:
        """A write the script refused: another worker holds the request now, or answered it."""
        seq = item.seq
        if seq.rid in self.seqs and self.seqs[seq.rid] is seq:
            self.generator.cancel(seq.rid)
            del self.seqs[seq.rid]
        log.warning(
            "request %s: write to %s refused (another worker took it over and wrote on, or the "
            "key holds another type): dropped",
            seq.rid,
            seq.key,
        )

    def _drop_all(self) -> None:
        """Forget every sequence (after a lost connection): the replay continues them."""
        for rid in list(self.seqs):
            self.generator.cancel(rid)
        self.seqs.clear()
        self.lanes.drop_held()
        self.work.replay_own()

    def _housekeep(self) -> None:
        now = time.monotonic()
        if self.work.recoveries[NORMAL].housekeeping_due(now):
            self.work.housekeep(self.lanes.holding, self.lanes.taken)


def _fewer(params: GenerationParams, sent: int) -> GenerationParams | None:
    """``params`` for the rest of a sequence that already made ``sent`` tokens (None: none left)."""
    left = params.max_new_tokens - sent
    if left < 1:
        return None
    seed = None if params.seed is None else params.seed + sent  # a fresh draw, not a repeat
    return GenerationParams(left, params.temperature, params.top_k, seed, params.stop)


def fields_of_any(fields: Any) -> dict | None:
    """An entry's fields as a dict, whether XREADGROUP gave a dict or a flat list."""
    return fields if fields is None or isinstance(fields, dict) else fields_of(fields)
