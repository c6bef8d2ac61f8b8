"""Pipeline stages: a consumer that serves one stage of a split model and forwards its activations.

A split model (``inferfleet split``) runs as one group of workers per stage.
Stage 0 reads the queue's request stream; stage K >= 1 reads its own stream
``PREFIX:{NAME}:stage:K`` (:class:`~inferfleet.worker.keys.StageKeys`). A stage
other than the last does not reply: it forwards each request's activations to
the next stage's stream as a new entry in the contract's encoding (``id``,
``body`` with the activations as ``inputs``, and the request's ``deadline``,
``reply_to`` and ``traceparent``), plus ``version``, the split's digest. The
last stage answers with the ordinary reply script, so producers see nothing
of the pipeline.

Exactly once across stages: :data:`FORWARD_SCRIPT` adds the next entry and
acknowledges this one in one atomic call, and takes the added entry back
(XDEL) if the XACK found the entry already acknowledged. A request computed
twice by a stage (a slow worker whose entry was taken over) is forwarded once.
Errors (bad input, ``model_error``, ``expired``, dead letters) are answered at
the stage where they happen, by the same script, and stop the request there.

Versions: stage K >= 1 computes only entries whose ``version`` is the split
it holds. During a hot swap a stage that meets activations of another split
answers the request ``model_error`` ("pipeline version changed while the
request was in flight: retry") rather than mix two splits in one reply.

The loop itself is :class:`~inferfleet.worker.serving.consumer.Consumer`'s:
:class:`StageConsumer` only swaps in its intake, encoder and writer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from inferfleet.producer.durability import Durability
from inferfleet.producer.protocol import GROUP, QueueKeys, encode_body
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import lua_source, script
from inferfleet.worker.counters import Counters
from inferfleet.worker.errors import ConfigError
from inferfleet.worker.keys import StageKeys
from inferfleet.worker.metrics import worker_metrics
from inferfleet.worker.runtime.loading import ModelRuntime
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.consumer import Consumer
from inferfleet.worker.serving.intake import Answer, Intake
from inferfleet.worker.serving.replies import BatchEncoder, Encode, ReplyWriter
from inferfleet.worker.serving.sharing import NORMAL

__all__ = [
    "CARRIED",
    "FORWARD_SCRIPT",
    "Forward",
    "ForwardEncoder",
    "ForwardWriter",
    "StageConsumer",
    "StageIntake",
    "stage_label",
]

log = logging.getLogger(__name__)

#: Entry fields a stage carries over to the next one unchanged.
CARRIED = (b"deadline", b"reply_to", b"traceparent")

#: The forward script (``worker/lua/forward.lua``, which documents its KEYS and ARGV).
FORWARD_SCRIPT = lua_source("forward")


def stage_label(settings: WorkerSettings) -> str:
    """The ``queue`` label of a stage worker's metrics: ``NAME/stageK``."""
    return f"{settings.name}/stage{settings.stage}"


@dataclass(slots=True)
class Forward(Answer):
    """A request's activations for the next stage: the entry's field-value pairs (``payload`` is the
    body)."""

    fields: list = field(default_factory=list)


@dataclass
class StageIntake(Intake):
    """Intake for a stage: the contract's checks, then the split's version and the fields to carry.

    ``version`` (stage K >= 1) is the split digest an entry must name;
    ``carry`` (every stage but the last) keeps :data:`CARRIED` in the
    request's ``extra`` for the next stage.
    """

    version: bytes = b""
    carry: bool = False

    def admit_fast(
        self, entry_id: bytes, fields: Mapping[bytes, bytes] | None, now_ms: float
    ) -> Request | Answer:
        return self._stage(entry_id, fields, super().admit_fast(entry_id, fields, now_ms))

    def admit(
        self, entry_id: bytes, fields: Mapping[bytes, bytes] | None, now_ms: float
    ) -> Request | Answer:
        return self._stage(entry_id, fields, super().admit(entry_id, fields, now_ms))

    def _stage(
        self, entry_id: bytes, fields: Mapping[bytes, bytes] | None, admitted: Request | Answer
    ) -> Request | Answer:
        if not isinstance(admitted, Request) or not fields:
            return admitted
        if self.version and fields.get(b"version") != self.version:
            seen = fields.get(b"version", b"none")
            return self.refuse_entry(
                entry_id,
                fields,
                "model_error",
                (
                    f"pipeline version changed while the request was in flight (this stage serves "
                    f"{self.version.decode()}, its activations came from "
                    f"{seen.decode(errors='replace')}): retry"
                ),
            )
        if self.carry:
            admitted.extra = {name: fields[name] for name in CARRIED if name in fields}
        return admitted


class ForwardEncoder:
    """Encodes one batch's results as :class:`Forward` entries (errors as replies, by
    ``general``)."""

    def __init__(self, model_meta: tuple[str, str], general: Encode) -> None:
        self.model_meta = model_meta
        self.general = general
        self.version = model_meta[1].encode()

    def encode(
        self, batch: Sequence[Request], results: Sequence[Any], infer_ms: float, batch_rows: int
    ) -> list[Answer]:
        answers: list[Answer] = []
        for req, result in zip(batch, results):
            if not isinstance(result, Exception):
                try:
                    answers.append(self._forward(req, result))
                    continue
                except Exception as exc:  # noqa: BLE001 - activations the contract cannot carry
                    result = exc
            answers.append(self.general(self.model_meta, req, result, infer_ms, batch_rows))
        return answers

    def _forward(self, req: Request, activations: Any) -> Forward:
        body = encode_body(activations)
        pairs: list = [b"id", req.rid, b"body", body, b"version", self.version]
        for name, value in req.extra.items():
            pairs += [name, value]
        return Forward(req.entry_id, req.reply_key, body, True, rid=req.rid, fields=pairs)


class ForwardWriter(ReplyWriter):
    """A :class:`ReplyWriter` whose script also forwards: :data:`FORWARD_SCRIPT` for every round."""

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        reply_ttl_s: int,
        model_meta: tuple[str, str],
        counters: Counters,
        next_stream: str,
        durability: Durability | None = None,
    ) -> None:
        super().__init__(client, keys, reply_ttl_s, model_meta, counters, durability=durability)
        self.next_stream = next_stream
        self._forward = script(client, "forward")

    def load(self) -> None:
        super().load()
        self.redis.script_load(FORWARD_SCRIPT)

    def _run_script(self, answers: list[Answer]) -> tuple[int, list[int]]:
        keys = [self.keys.requests, self.next_stream]
        args: list[Any] = [GROUP, self.reply_ttl_ms]
        for answer in answers:
            if isinstance(answer, Forward):
                keys.append(self.next_stream)
                args += [answer.entry_id, len(answer.fields) // 2, *answer.fields]
            elif answer.payload:
                keys.append(answer.reply_key or self.keys.requests)
                args += [answer.entry_id, -1, answer.payload]
            else:
                keys.append(self.keys.requests)
                args += [answer.entry_id, 0]
        done, failed = self._call_script(self._forward, keys, args)
        return int(done), [int(i) for i in failed]


class StageConsumer(Consumer):
    """A :class:`Consumer` of one stage: its stream (``settings.queue_keys``), and for every stage
    but the last a forwarding encoder and writer. Its metrics are labelled :func:`stage_label`."""

    def __init__(
        self,
        settings: WorkerSettings,
        runtime: ModelRuntime,
        client: redis.Redis,
        **collaborators: Any,
    ) -> None:
        if settings.stage is None or runtime.pipeline is None:
            raise ConfigError("a stage consumer needs --stage and a split (--pipeline DIR)")
        if "counters" not in collaborators:
            collaborators["counters"] = Counters(
                worker_metrics(stage_label(settings), settings.metrics_port)
            )
        super().__init__(settings, runtime, client, **collaborators)
        self._fit(runtime)

    def _fit(self, runtime: ModelRuntime) -> None:
        stage, manifest = self.settings.stage or 0, runtime.pipeline
        assert manifest is not None
        last = stage == manifest.last
        if (
            self.settings.cache_size and not last
        ):  # a cache hit answers at once: only the last stage may
            raise ConfigError(
                f"--cache-size caches replies: use it on the last stage ({manifest.last}) only"
            )
        self.intake = StageIntake(
            self.keys,
            self.settings.limits,
            runtime.model_meta,
            runtime.input_spec,
            runtime.accepts_params,
            version=runtime.version.encode() if stage else b"",
            carry=not last,
        )
        args = (self.redis, self.keys, self.settings.reply_ttl_s, runtime.model_meta, self.counters)
        # a stage answers through its own encoder and writer: never the columnar path, which
        # replies straight from a template (stage 0 reads the queue's own request stream)
        self.columnar = False
        durability = self.settings.durability
        if last:
            self.replies = ReplyWriter(*args, durability=durability)
            self.computer = self._computer(runtime, BatchEncoder)
        else:
            self.replies = ForwardWriter(
                *args,
                StageKeys(self.keys.name, self.keys.prefix, stage=stage + 1).requests,
                durability,
            )
            self.computer = self._computer(runtime, ForwardEncoder)
        self.work.writers[NORMAL] = self.replies  # a stage stream has one lane: the normal one
        log.info(
            "consumer %s: stage %d of %d of %s version %s, %s",
            self.settings.consumer,
            stage,
            manifest.last + 1,
            self.settings.name,
            runtime.version,
            "answering" if last else f"forwarding to stage {stage + 1}",
        )

    def switch_runtime(self, new: ModelRuntime, source: str) -> None:
        """Switch to the same stage of another split (a hot swap)."""
        super().switch_runtime(new, source)
        self._fit(new)
