"""Writing a round's replies: dead letters first, then reply and acknowledge in one script call.

Replies are written by one Lua script per round (:data:`REPLY_SCRIPT`): for
each entry it pushes the reply, then XACKs, and takes the reply back if that
XACK found the entry already acknowledged. The push and the acknowledgement
are one atomic step (the reply is written first, as the contract asks), and
a request computed twice (a slow worker whose entry was taken over) is
answered once: whoever acknowledges first answers.

The script is registered with redis-py (``register_script``), which loads it
again when Redis answers NOSCRIPT (after a restart or SCRIPT FLUSH). On Redis
Cluster every key of one call is in one slot: the stream and the reply keys
of a queue (or of a shard) share its hash tag, and intake refuses a
``reply_to`` outside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import redis

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import GROUP, QueueKeys, ReplyTemplate, encode_reply_error
from inferfleet.producer.sharing import cancels_key
from inferfleet.worker.counters import Counters
from inferfleet.worker.serving.deadletter import DEAD_MAXLEN
from inferfleet.worker.serving.intake import Answer

__all__ = ["REPLY_SCRIPT", "BatchEncoder", "ReplyWriter"]

log = logging.getLogger(__name__)

#: KEYS = [stream, cancels, reply_key...]; ARGV = [group, ttl_ms, (entry_id, payload)...].
#: An empty payload means "acknowledge only". The reply is pushed first and
#: taken back if the XACK finds the entry already answered (so exactly one
#: reply stands); a push that fails (the key holds another type) leaves the
#: entry pending and unacknowledged (a non-list key: answered elsewhere; any
#: other error, such as Redis out of memory, aborts the round, which is retried).
#: Each reply key gets its TTL once, after its replies (a shared inbox takes
#: many in one call; the state the atomic call leaves is the same), also when
#: the call stops early on an error.
#: Returns {pushed, {failed 0-based indexes}, whether the queue's cancels set exists}: a round
#: checks its requests' cancel marks only while some exist (no round trip of its own otherwise).
REPLY_SCRIPT = """
local stream, group, ttl = KEYS[1], ARGV[1], ARGV[2]
local pushed, failed, answered = 0, {}, {}
local function expire_answered()
  for key in pairs(answered) do
    redis.call('PEXPIRE', key, ttl)
  end
end
for i = 3, #KEYS do
  local id, payload = ARGV[2 * i - 3], ARGV[2 * i - 2]
  if payload == '' then
    redis.call('XACK', stream, group, id)
  else
    local res = redis.pcall('RPUSH', KEYS[i], payload)
    if type(res) == 'table' and res.err then
      if string.sub(res.err, 1, 9) ~= 'WRONGTYPE' then
        expire_answered()  -- what this call answered keeps its TTL
        return redis.error_reply(res.err)  -- out of memory and the like: retry the round later
      end
      table.insert(failed, i - 3)
    elseif redis.call('XACK', stream, group, id) == 1 then
      answered[KEYS[i]] = true
      pushed = pushed + 1
    else
      redis.call('RPOP', KEYS[i])
    end
  end
end
expire_answered()
return {pushed, failed, redis.call('EXISTS', KEYS[2])}
"""


class ReplyWriter:
    """Writes one consumer's answers: dead letters, replies and acknowledgements, counted.

    ``model_meta`` (name, version) names the model in the ``bad_request``
    written when a reply key holds another type; the consumer sets it when it
    switches models.
    """

    def __init__(self, client: redis.Redis, keys: QueueKeys, reply_ttl_s: int, model_meta: tuple[str, str],
                 counters: Counters) -> None:
        self.redis = client
        self.keys = keys
        self.reply_ttl_ms = reply_ttl_s * 1000
        self.model_meta = model_meta
        self.counters = counters
        self._script = client.register_script(REPLY_SCRIPT)
        self.cancels_key = cancels_key(keys)
        #: whether the queue had cancel marks at the last reply call (true at start: check once)
        self.cancels_pending = True

    def load(self) -> None:
        """Load the script now (at start: a missing permission shows before the first reply)."""
        self.redis.script_load(REPLY_SCRIPT)

    def write(self, answers: list[Answer]) -> None:
        """Reply and XACK every answer in one atomic script call (dead letters first)."""
        if not answers:
            return
        dead = [a.dead for a in answers if a.dead is not None]
        if dead:  # dead letter first: a crash before the reply duplicates it, never loses it
            pipe = self.redis.pipeline(transaction=False)
            for fields in dead:
                pipe.xadd(self.keys.dead, fields, maxlen=DEAD_MAXLEN, approximate=True)
            pipe.execute()
        pushed, failed = self._run_script(answers)
        self._count(answers, failed)
        expected = sum(1 for a in answers if a.payload) - len(failed)
        if pushed < expected:
            self.counters.replies_skipped(expected - pushed)
            log.info("%d replies skipped: those requests were already answered by another consumer",
                     expected - pushed)
        if failed:
            self._reply_elsewhere([answers[i] for i in failed])

    def _run_script(self, answers: list[Answer]) -> tuple[int, list[int]]:
        keys = [self.keys.requests, self.cancels_key]
        args: list[Any] = [GROUP, self.reply_ttl_ms]
        for answer in answers:
            keys.append(answer.reply_key or self.keys.requests)
            args.append(answer.entry_id)
            args.append(answer.payload or b"")
        pushed, failed, cancels = self._script(keys=keys, args=args)
        self.cancels_pending = bool(cancels)
        return int(pushed), [int(i) for i in failed]

    def _reply_elsewhere(self, answers: list[Answer]) -> None:
        """Replies whose key holds another type: answer bad_request to the default key,
        and if even that fails, acknowledge without a reply (logged) rather than loop."""
        retry = []
        for a in answers:
            log.error("entry %s: reply key %s holds a non-list value", a.entry_id.decode(), a.reply_key)
            default = self.keys.reply(a.rid) if a.rid else None
            if a.rid and default and default != a.reply_key:
                message = f"reply key {a.reply_key} holds a value that is not a list"
                retry.append(Answer(a.entry_id, default, encode_reply_error(
                    a.rid, "bad_request", message, self.model_meta), rid=a.rid, code="bad_request"))
            else:
                retry.append(Answer(a.entry_id, None, None))
        _, failed = self._run_script(retry)
        self._count(retry, failed)
        if failed:
            self._run_script([Answer(retry[i].entry_id, None, None) for i in failed])

    def _count(self, answers: list[Answer], failed: list[int]) -> None:
        """Replies written, by code, for the metrics; each error reply logged (debug) with its id."""
        self.counters.replied(answers, failed)
        if log.isEnabledFor(logging.DEBUG):
            for a in answers:
                if a.payload and not a.ok:
                    log.debug("request %s answered %s", a.rid, a.code, extra={"request_ids": [a.rid]})


#: The general encoder a BatchEncoder falls back on: (meta, request, result, infer_ms, batch_rows) -> Answer.
Encode = Callable[[tuple[str, str], Any, Any, float, int], Answer]


class BatchEncoder:
    """Encodes one batch's answers; an ok reply of one tensor comes from a :class:`ReplyTemplate`.

    The template's bytes equal the general encoder's, at a fifth of its cost.
    Anything else (errors, several tensors, a dtype the contract lacks)
    goes to ``general``. One template is kept per output dtype and shape.
    """

    def __init__(self, model_meta: tuple[str, str], general: Encode) -> None:
        self.model_meta = model_meta
        self.general = general
        self._templates: dict[tuple[np.dtype, tuple[int, ...]], ReplyTemplate | None] = {}

    def encode(self, batch: Sequence[Any], results: Sequence[Any], infer_ms: float, batch_rows: int) -> list[Answer]:
        """The answers to ``batch`` (Requests) given each one's result (outputs or an exception)."""
        tail: bytes | None = None
        answers = []
        for req, result in zip(batch, results):
            template = self._template(result) if type(result) is np.ndarray else None
            if template is None:
                answers.append(self.general(self.model_meta, req, result, infer_ms, batch_rows))
                continue
            tail = tail or ReplyTemplate.batch_tail(infer_ms, batch_rows)
            payload = template.encode(req.rid, result.tobytes(), max(0.0, req.picked_ms - req.enqueued_ms), tail)
            answers.append(Answer(req.entry_id, req.reply_key, payload, True, rid=req.rid))
        return answers

    def _template(self, result: np.ndarray) -> ReplyTemplate | None:
        key = (result.dtype, result.shape)
        if key not in self._templates:
            self._templates[key] = self._make(result) if len(self._templates) < 64 else None
        return self._templates[key]

    def _make(self, result: np.ndarray) -> ReplyTemplate | None:
        if result.dtype.str[0] not in "<|" or result.ndim == 0:  # the wire is little-endian
            return None
        try:
            return ReplyTemplate(self.model_meta, result.dtype, result.shape)
        except ProtocolError:  # a dtype the contract does not carry: the general encoder answers model_error
            return None

