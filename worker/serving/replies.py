"""Writing a round's replies: dead letters first, then reply and acknowledge in one script call.

Replies are written by one Lua script per round (:data:`REPLY_SCRIPT`): for
each entry it pushes the reply, then XACKs, and takes the reply back if that
XACK found the entry already acknowledged. Replies in a row to one inbox
(a ``map``'s) go out in one RPUSH before their XACKs: a ``redis.call`` costs
Redis about as much as the command it runs. The push and the acknowledgement
are one atomic step (the reply is written first, as the contract asks), and
a request computed twice (a slow worker whose entry was taken over) is
answered once: whoever acknowledges first answers.

The script (``worker/lua/reply.lua``) is registered once a client
(:func:`~inferfleet.worker.connections.script`) and loaded again when Redis
answers NOSCRIPT (after a restart or SCRIPT FLUSH). On Redis Cluster every
key of one call is in one slot: the stream and the reply keys of a queue
(or of a shard) share its hash tag, and intake refuses a
``reply_to`` outside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import redis

from inferfleet.producer.durability import Durability
from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import GROUP, QueueKeys, encode_reply_error
from inferfleet.producer.transport import pack_command
from inferfleet.worker.connections import lua_constant, lua_source, script
from inferfleet.worker.counters import Counters
from inferfleet.worker.resp import call_packed, pack_evalsha, send_packed_then
from inferfleet.worker.serving.behind import BehindRead
from inferfleet.worker.serving.columns import Columns
from inferfleet.worker.serving.deadletter import DEAD_MAXLEN
from inferfleet.worker.serving.intake import Answer
from inferfleet.worker.serving.templates import QUEUED_SIZE, ReplyTemplate

__all__ = ["REPLY_SCRIPT", "BatchEncoder", "ReplyWriter"]

log = logging.getLogger(__name__)

#: The reply script (``worker/lua/reply.lua``, which documents its KEYS, ARGV and rules).
REPLY_SCRIPT = lua_source("reply")
#: The most replies one RPUSH of the reply script pushes: the script defines it.
RUN_MAX = lua_constant("reply", "RUN_MAX")


class ReplyWriter:
    """Writes one consumer's answers: dead letters, replies and acknowledgements, counted.

    ``model_meta`` (name, version) names the model in the ``bad_request``
    written when a reply key holds another type; :meth:`model_changed` follows a
    hot swap. ``hold_behind_reads``: hold each Columns round's call
    until the next read (:mod:`~inferfleet.worker.serving.behind`), only on a
    plain Redis client (a cluster routes the call itself) and only for a
    consumer whose reads and writes take turns on one thread.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        reply_ttl_s: int,
        model_meta: tuple[str, str],
        counters: Counters,
        *,
        hold_behind_reads: bool = False,
        durability: Durability | None = None,
    ) -> None:
        self.redis = client
        #: replicas to WAIT for after each reply call (None: none)
        self.durability = durability
        self._wait = (
            None
            if durability is None
            else pack_command(["WAIT", durability.replicas, durability.timeout_ms])
        )
        self.keys = keys
        self.reply_ttl_ms = reply_ttl_s * 1000
        # PEXPIREAT until the ACL refuses it once; then PEXPIRE, so ACL LOG gets one refusal
        self._expire_at = True
        self.model_meta = model_meta
        self.counters = counters
        self._script = script(client, "reply")
        # the script's call packed by hand (a Columns batch) where the client is one plain Redis
        self._direct = (
            isinstance(client, redis.Redis) and getattr(client, "connection", None) is None
        )
        self.behind = (
            BehindRead(client, self._call_packed, self.load)
            if hold_behind_reads and self._direct and durability is None
            else None
        )

    def model_changed(self, model_meta: tuple[str, str]) -> None:
        """Name ``model_meta`` in the replies written from now on (after a hot swap)."""
        self.model_meta = model_meta

    def load(self) -> None:
        """Load the script now (at start: a missing permission shows before the first reply)."""
        self.redis.script_load(REPLY_SCRIPT)

    def write(self, answers: list[Answer]) -> None:
        """Reply and XACK every answer in one atomic script call (dead letters first)."""
        if not answers:
            return
        self.settle()  # a held call first: replies go out in the order they were computed
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
            log.info(
                "%d replies skipped: those requests were already answered by another consumer",
                expected - pushed,
            )
        if failed:
            self._reply_elsewhere([answers[i] for i in failed])

    def write_columns(
        self, cols: Columns, template: ReplyTemplate, outputs: np.ndarray, infer_ms: float
    ) -> None:
        """Reply ok to every request of ``cols`` and XACK it, in one script call packed from
        ``template``.

        ``outputs`` holds every request's rows in order, each request's part
        of the template's dtype and shape. The same script and the same
        outcome as :meth:`write`, without an Answer or a packed argument per
        request.
        """
        tail = ReplyTemplate.batch_tail(infer_ms, cols.rows)
        data, size = outputs.tobytes(), template.nbytes
        waits = cols.picked_ms - np.array(cols.enqueued_ms(), dtype=np.float64)
        if not self._direct:  # Redis Cluster: redis-py routes the script call to the stream's node
            self.write(
                [
                    Answer(
                        entry_id,
                        key.decode("ascii"),
                        template.encode(
                            rid.decode("ascii"),
                            data[i * size : (i + 1) * size],
                            float(waits[i]),
                            tail,
                        ),
                        True,
                        rid=rid.decode("ascii"),
                    )
                    for i, (entry_id, rid, key) in enumerate(
                        zip(cols.entry_ids, cols.rids, cols.reply_keys)
                    )
                ]
            )
            return
        packed = self._packed_call(
            cols.reply_keys,
            _packed_pairs(cols, template, tail, data, ReplyTemplate.queued_bytes(waits)),
        )
        if self.behind is not None:  # goes out with the next read (behind.py)
            self.behind.hold(packed, lambda answer: self._columns_done(cols, *self._told(answer)))
            return
        self._columns_done(cols, *self._told(self._call_packed(packed)))

    def settle(self) -> None:
        """Write the replies held for the next read now (``hold_behind_reads``)."""
        if self.behind is not None:
            self.behind.settle()

    def drop_held(self) -> None:
        """Forget a held call after a lost connection: its entries are pending on us, and
        replayed."""
        if self.behind is not None:
            self.behind.drop()

    def _columns_done(self, cols: Columns, pushed: int, failed: list[int]) -> None:
        """Count a Columns round's replies and answer those whose key held another type
        elsewhere."""
        self.counters.replied_ok(len(cols) - len(failed))
        if pushed < len(cols) - len(failed):
            self.counters.replies_skipped(len(cols) - len(failed) - pushed)
            log.info(
                "%d replies skipped: those requests were already answered by another consumer",
                len(cols) - len(failed) - pushed,
            )
        if failed:
            self._reply_elsewhere(
                [
                    Answer(
                        cols.entry_ids[i],
                        cols.reply_keys[i].decode("ascii"),
                        None,
                        True,
                        rid=cols.rids[i].decode("ascii"),
                    )
                    for i in failed
                ]
            )

    def _packed_call(self, reply_keys: list[bytes], packed_args: bytes) -> bytes:
        """The reply script's EVALSHA over ``reply_keys`` and the RESP-packed (entry id, payload)
        pairs."""
        return pack_evalsha(
            self._script.sha,
            self.keys.requests.encode(),
            reply_keys,
            (GROUP.encode(), self._ttl_arg()),
            packed_args,
            2 * len(reply_keys),
        )

    def _call_packed(self, packed: bytes) -> Any:
        """Send a packed EVALSHA of the reply script and return its answer (loading the script if
        Redis lost it), followed by the WAIT durability asks for."""
        pool = self.redis.connection_pool
        if self._wait is None:
            return call_packed(pool, packed, self.load)
        answer, told = send_packed_then(pool, packed, self._wait)
        if isinstance(answer, redis.exceptions.NoScriptError):
            self.load()  # nothing ran: send both again
            answer, told = send_packed_then(pool, packed, self._wait)
        if isinstance(answer, Exception):
            raise answer
        self._replicated(told)
        return answer

    def _run_script(self, answers: list[Answer]) -> tuple[int, list[int]]:
        keys = [self.keys.requests]
        args: list[Any] = [GROUP, self._ttl_arg()]
        for answer in answers:
            keys.append(answer.reply_key or self.keys.requests)
            args.append(answer.entry_id)
            args.append(answer.payload or b"")
        return self._told(self._call_script(self._script, keys, args))

    def _call_script(self, script_: Any, keys: list, args: list) -> Any:
        """Call ``script_`` (a redis-py Script) and return its answer, followed by the WAIT
        durability asks for on the same connection."""
        if self.durability is None:
            return script_(keys=keys, args=args)
        answer, told = self._script_then_wait(script_, keys, args)
        if isinstance(answer, redis.exceptions.NoScriptError):
            self.load()  # a cluster pipeline does not load it: nothing ran, call it again
            answer, told = self._script_then_wait(script_, keys, args)
        if isinstance(answer, Exception):
            raise answer
        self._replicated(told)
        return answer

    def _script_then_wait(self, script_: Any, keys: list, args: list) -> tuple[Any, Any]:
        """The script's answer and the WAIT's, sent on one connection (errors in their place)."""
        assert self.durability is not None
        pipe = self.redis.pipeline(transaction=False)
        script_(keys=keys, args=args, client=pipe)
        node = {}
        if not isinstance(self.redis, redis.Redis):  # a cluster: the node that ran the script
            node = {"target_nodes": self.redis.get_node_from_key(self.keys.requests)}
        pipe.execute_command("WAIT", self.durability.replicas, self.durability.timeout_ms, **node)
        answer, told = pipe.execute(raise_on_error=False)
        return answer, told

    def _replicated(self, told: Any) -> None:
        """Count and log a WAIT that fell short (or failed); close the idle connections then, so
        that the next call finds the primary again (a switch-over leaves this one writable)."""
        assert self.durability is not None
        if not isinstance(told, Exception) and int(told) >= self.durability.replicas:
            return
        self.counters.replies_not_replicated()
        log.warning(
            "replies not confirmed by %d replicas within %d ms (%s): a failover now could "
            "compute those requests again; reconnecting",
            self.durability.replicas,
            self.durability.timeout_ms,
            told,
        )
        pool = getattr(self.redis, "connection_pool", None)
        if pool is not None:
            pool.disconnect(inuse_connections=False)

    def _ttl_arg(self) -> bytes:
        """The script's ttl argument: ``<ms>`` (PEXPIREAT), or ``p<ms>`` once the ACL refused
        PEXPIREAT (a grant older than the script)."""
        return b"%d" % self.reply_ttl_ms if self._expire_at else b"p%d" % self.reply_ttl_ms

    def _told(self, answer: Any) -> tuple[int, list[int]]:
        """(pushed, failed indexes) of a reply script's answer, learning a refused PEXPIREAT."""
        pushed, failed, *refused = answer
        if refused and int(refused[0]) and self._expire_at:
            self._expire_at = False
            log.warning(
                "the ACL refuses PEXPIREAT: reply TTLs are set with PEXPIRE from now on "
                "(grant +pexpireat to this user: docs/security.md)"
            )
        return int(pushed), [int(i) for i in failed]

    def _reply_elsewhere(self, answers: list[Answer]) -> None:
        """Replies whose key holds another type: answer bad_request to the default key,
        and if even that fails, acknowledge without a reply (logged) rather than loop."""
        retry = []
        for a in answers:
            log.error(
                "entry %s: reply key %s holds a non-list value", a.entry_id.decode(), a.reply_key
            )
            default = self.keys.reply(a.rid) if a.rid else None
            if a.rid and default and default != a.reply_key:
                message = f"reply key {a.reply_key} holds a value that is not a list"
                retry.append(
                    Answer(
                        a.entry_id,
                        default,
                        encode_reply_error(a.rid, "bad_request", message, self.model_meta),
                        rid=a.rid,
                        code="bad_request",
                    )
                )
            else:
                retry.append(Answer(a.entry_id, None, None))
        _, failed = self._run_script(retry)
        self._count(retry, failed)
        if failed:
            self._run_script([Answer(retry[i].entry_id, None, None) for i in failed])

    def _count(self, answers: list[Answer], failed: list[int]) -> None:
        """Replies written, by code, for the metrics; each error reply logged (debug) with its
        id."""
        self.counters.replied(answers, failed)
        if log.isEnabledFor(logging.DEBUG):
            for a in answers:
                if a.payload and not a.ok:
                    log.debug(
                        "request %s answered %s", a.rid, a.code, extra={"request_ids": [a.rid]}
                    )


def _packed_pairs(
    cols: Columns, template: ReplyTemplate, tail: bytes, data: bytes, queued: bytes
) -> bytes:
    """The script's (entry id, reply) arguments of a Columns batch as RESP bulk strings, in one
    join."""
    size = template.nbytes
    # id length -> the reply's fixed parts, the first with the reply's RESP header before it
    around = {}
    for length in set(map(len, cols.rids)):
        head, *rest = template.payload_parts(length, tail)
        reply_length = template.reply_length(length, tail)
        around[length] = (b"\r\n$%d\r\n" % reply_length + head, rest[0], rest[1], rest[2] + b"\r\n")
    id_heads = {length: b"$%d\r\n" % length for length in set(map(len, cols.entry_ids))}
    datas = [data[i : i + size] for i in range(0, len(data), size)]
    waits = [queued[i : i + QUEUED_SIZE] for i in range(0, len(queued), QUEUED_SIZE)]
    pieces: list[bytes] = []
    extend = pieces.extend
    if len(around) == 1:  # one id length: the usual batch
        ((a, b, c, d),) = around.values()
        for entry_id, rid, out, wait in zip(cols.entry_ids, cols.rids, datas, waits):
            extend((id_heads[len(entry_id)], entry_id, a, rid, b, out, c, wait, d))
    else:
        for entry_id, rid, out, wait in zip(cols.entry_ids, cols.rids, datas, waits):
            a, b, c, d = around[len(rid)]
            extend((id_heads[len(entry_id)], entry_id, a, rid, b, out, c, wait, d))
    return b"".join(pieces)


#: The general encoder a BatchEncoder falls back on: (meta, request, result, infer_ms, batch_rows)
#: -> Answer.
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

    def encode(
        self, batch: Sequence[Any], results: Sequence[Any], infer_ms: float, batch_rows: int
    ) -> list[Answer]:
        """The answers to ``batch`` (Requests) given each one's result (outputs or an exception)."""
        tail: bytes | None = None
        answers = []
        for req, result in zip(batch, results):
            template = self._template(result) if type(result) is np.ndarray else None
            if template is None:
                answers.append(self.general(self.model_meta, req, result, infer_ms, batch_rows))
                continue
            tail = tail or ReplyTemplate.batch_tail(infer_ms, batch_rows)
            payload = template.encode(
                req.rid, result.tobytes(), req.picked_ms - req.enqueued_ms, tail
            )
            answers.append(Answer(req.entry_id, req.reply_key, payload, True, rid=req.rid))
        return answers

    def _template(self, result: np.ndarray) -> ReplyTemplate | None:
        return self.template(result.dtype, result.shape)

    def template(self, dtype: np.dtype, shape: tuple[int, ...]) -> ReplyTemplate | None:
        """The template of ok replies whose outputs are one tensor of ``dtype`` and ``shape`` (None:
        none)."""
        key = (dtype, shape)
        if key not in self._templates:
            self._templates[key] = self._make(dtype, shape) if len(self._templates) < 64 else None
        return self._templates[key]

    def _make(self, dtype: np.dtype, shape: tuple[int, ...]) -> ReplyTemplate | None:
        if dtype.str[0] not in "<|" or not shape:  # the wire is little-endian
            return None
        try:
            return ReplyTemplate(self.model_meta, dtype, shape)
        except (
            ProtocolError
        ):  # a dtype the contract does not carry: the general encoder answers model_error
            return None
