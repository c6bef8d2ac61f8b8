"""Computing batches: the forward pass, failing requests isolated, answers encoded.

Two paths through the model, one outcome:

* :meth:`BatchComputer.infer`, the general one: a batch of
  :class:`~inferfleet.worker.serving.batching.Request` objects, concatenated,
  computed, split back, reviewed by the result checks and encoded one answer
  per request; a batch that raises is bisected so only the guilty requests
  fail (:func:`~inferfleet.worker.serving.batching.predict_isolated`).
* :meth:`BatchComputer.infer_columns`, the columnar one: a
  :class:`~inferfleet.worker.serving.columns.Columns` batch computed in one
  pass, returned as :class:`ColumnsComputed` for the consumer's writer to
  answer straight from a reply template in one script call
  (:meth:`~inferfleet.worker.serving.replies.ReplyWriter.write_columns`).
  Whatever is not the happy case (an exception, a suspicious output, outputs
  no template fits) is handed to the general path with what was computed.

Every forward pass also feeds the row limit, memory hygiene and the counters.
Nothing here writes to Redis: the consumer's writer writes what it returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferfleet.producer.protocol import encode_reply_error, encode_reply_ok, reply_timing
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.errors import Cancelled, DeviceBroken
from inferfleet.worker.logs import batch_context, clip
from inferfleet.worker.runtime.devices import drop_frames, is_device_broken
from inferfleet.worker.runtime.loading import ModelRuntime, is_out_of_memory
from inferfleet.worker.serving.batching import (
    Request,
    concat_inputs,
    predict_isolated,
    split_outputs,
)
from inferfleet.worker.serving.columns import Columns
from inferfleet.worker.serving.intake import Answer
from inferfleet.worker.serving.quality import CacheRound, ResultPolicy
from inferfleet.worker.serving.replies import BatchEncoder, Encode
from inferfleet.worker.serving.rowlimit import RowLimit
from inferfleet.worker.serving.templates import ReplyTemplate

__all__ = [
    "BatchComputer",
    "ColumnsComputed",
    "EncoderKind",
    "encode_answer",
    "model_error_message",
]

log = logging.getLogger(__name__)


def model_error_message(exc: BaseException, limit: int = 2000) -> str:
    """One line that names the cause: the exception's last line (a TorchScript error ends with the
    Python-level one, after pages of interpreter traceback), at most ``limit`` characters of its
    end."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    cause = lines[-1] if lines else ""
    head = cause.split(":", 1)[0]
    if not (head.endswith(("Error", "Exception")) and " " not in head):
        cause = f"{type(exc).__name__}: {cause}" if cause else type(exc).__name__
    return cause if len(cause) <= limit else "..." + cause[-(limit - 3) :]


def encode_answer(
    meta: tuple[str, str], req: Request, result: Any, infer_ms: float, batch_rows: int
) -> Answer:
    """The answer to ``req``: its outputs, or ``model_error`` for an exception or outputs the
    contract cannot carry. ``meta`` (name, version) names the model that computed it."""
    timing = reply_timing(req.picked_ms - req.enqueued_ms, infer_ms, batch_rows)
    if not isinstance(result, Exception):
        try:
            return Answer(
                req.entry_id,
                req.reply_key,
                encode_reply_ok(req.rid, result, meta, timing),
                True,
                rid=req.rid,
                lane=req.lane,
            )
        except Exception as exc:  # noqa: BLE001 - an output the contract cannot carry
            result = exc
    if isinstance(result, Cancelled):  # its cancel mark was taken
        return Answer(
            req.entry_id,
            req.reply_key,
            encode_reply_error(req.rid, "cancelled", str(result), meta, timing),
            rid=req.rid,
            code="cancelled",
            lane=req.lane,
        )
    message = model_error_message(result)
    log.warning("request %s: model error: %s", req.rid, clip(message))
    return Answer(
        req.entry_id,
        req.reply_key,
        encode_reply_error(req.rid, "model_error", message, meta, timing),
        rid=req.rid,
        code="model_error",
        lane=req.lane,
    )


@dataclass(frozen=True)
class ColumnsComputed:
    """A Columns batch computed on the fast path, its replies to be filled in from ``template``."""

    cols: Columns
    template: ReplyTemplate
    outputs: np.ndarray
    infer_ms: float


#: What the computer encodes answers with: (model_meta, the general encoder) -> an encoder.
EncoderKind = Callable[[tuple[str, str], Encode], Any]


class BatchComputer:
    """Runs one consumer's batches through its current model and encodes their answers.

    It shares the consumer's result policy, cache round, counters and row
    limit; :meth:`use` switches it to another model. ``guard`` wraps the
    predict function of a batch's bisection (the consumer's cancel-mark
    recheck); ``on_computed`` is called with each batch computed on the
    general path and its results (the shadow's sample); ``encoder`` makes the
    answers' encoder for a model (a pipeline stage forwards instead).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        runtime: ModelRuntime,
        results: ResultPolicy,
        cache_round: CacheRound,
        counters: Counters,
        row_limit: RowLimit,
        *,
        guard: Callable[[Any], Any] | None = None,
        on_computed: Callable[[list[Request], list[Any]], None] | None = None,
        encoder: EncoderKind = BatchEncoder,
    ) -> None:
        self.consumer = settings.consumer
        self.empty_cache_every = settings.empty_cache_every
        self.results = results
        self.cache_round = cache_round
        self.counters = counters
        self.row_limit = row_limit
        self.guard = guard
        self.on_computed = on_computed
        self._encoder_kind = encoder
        self._batch_seq = 0  # numbers batches in the logs (record field ``batch``)
        self.use(runtime)

    def use(self, runtime: ModelRuntime) -> None:
        """Compute with ``runtime`` from the next batch on."""
        self.runtime = runtime
        self.encoder = self._encoder_kind(runtime.model_meta, encode_answer)

    def infer(self, batch: list[Request]) -> list[Answer]:
        """Compute one batch; what it logs carries the batch number and its request ids."""
        self._batch_seq += 1
        with batch_context(self._batch_seq, batch):
            return self._infer_batch(batch)

    def infer_columns(self, cols: Columns) -> ColumnsComputed | list[Answer]:
        """Compute a Columns batch in one pass, to be answered from a reply template.

        A batch that raises, looks suspicious to the result checks or has
        outputs no template fits leaves the fast path: the general one
        answers it request by request (bisecting errors), from the outputs
        already computed where there are some.
        """
        self._batch_seq += 1
        with batch_context(self._batch_seq, cols.rids):
            started = time.perf_counter()
            failed: BaseException | None
            try:
                outputs = self.runtime.predict(cols.inputs, {})
            except Exception as exc:  # noqa: BLE001 - isolated request by request below
                failed = drop_frames(exc) if is_out_of_memory(exc) else exc
            else:
                failed = None
            if failed is not None:  # out of the except block: the failed pass's frames are gone
                return self._infer_batch(cols.requests(), failed)
            template = (
                self.encoder.template(outputs.dtype, (cols.rows_each,) + outputs.shape[1:])
                if type(outputs) is np.ndarray and outputs.shape[:1] == (cols.rows,)
                else None
            )
            if template is None or self.results.batch_suspicious(outputs):
                return self._infer_batch(cols.requests(), outputs)
            infer_s = time.perf_counter() - started
            self._batch_done(cols.rows, infer_s, cols.queue_waits_s)
            return ColumnsComputed(cols, template, outputs, infer_s * 1000.0)

    def _infer_batch(self, batch: list[Request], computed: Any = None) -> list[Answer]:
        """Compute one batch and encode its answers; a batch that raises is bisected so only the
        guilty requests fail. ``computed``: what the whole batch gave already (outputs or an
        exception)."""
        rows_total = sum(r.rows for r in batch)
        started = time.perf_counter()
        suspicious = False

        def predict(part: Sequence[Request]) -> list[Any]:
            nonlocal suspicious
            whole = computed if computed is not None and part is batch else None
            outputs = self._forward(part, whole)
            suspicious = suspicious or self.results.batch_suspicious(outputs)
            if self.runtime.per_request:
                return outputs  # type: ignore[no-any-return]
            return split_outputs(outputs, [r.rows for r in part])

        answered = predict_isolated(
            batch, self.guard(predict) if self.guard is not None else predict
        )
        version = self.runtime.version
        results = [
            self.results.review(req, res, version, suspicious) for req, res in zip(batch, answered)
        ]
        infer_ms = (time.perf_counter() - started) * 1000.0
        self._batch_done(
            rows_total,
            infer_ms / 1000.0,
            lambda: [(r.picked_ms - r.enqueued_ms) / 1000.0 for r in batch],
        )
        if self.on_computed is not None:  # the shadow keeps a sample of the live batches
            self.on_computed(batch, results)
        self.cache_round.remember(batch, results, infer_ms, rows_total)
        return self.encoder.encode(batch, results, infer_ms, rows_total)

    def _forward(self, part: Sequence[Request], computed: Any) -> Any:
        """One forward pass over ``part`` (or what it already gave: outputs or an exception)."""
        try:
            if computed is not None:
                if isinstance(computed, Exception):
                    raise computed
                return computed
            # the handler decodes, collates and splits (docs/handlers.md)
            if self.runtime.per_request:
                return self.runtime.predict_requests(
                    [r.inputs for r in part], [r.rows for r in part], part[0].params
                )
            return self.runtime.predict(concat_inputs(part), part[0].params)
        except Exception as exc:
            if not is_out_of_memory(exc):
                if is_device_broken(exc):  # no retry, no reply, no ack: the process must exit
                    raise DeviceBroken(self.consumer, exc) from exc
                raise
            failed = drop_frames(exc)
        # out of memory, out of the except block: with the failed pass's frames (its device
        # tensors) gone, empty_cache() can free them before the bisection retries the halves
        self._out_of_memory(sum(r.rows for r in part))
        raise failed

    def _batch_done(
        self, rows: int, infer_s: float, queue_waits_s: Callable[[], list[float]]
    ) -> None:
        """After every forward pass: the row limit, memory hygiene, the counters, a debug line."""
        if self.row_limit.batch_computed():
            log.info("consumer %s: row limit raised to %d", self.consumer, self.row_limit.rows)
        every = self.empty_cache_every
        if every and self.counters.batches % every == every - 1:
            self.runtime.release_memory()  # the article's memory hygiene: return cached blocks
        self.counters.batch_waited(rows, infer_s, queue_waits_s)
        log.debug("consumer %s: batch of %d rows, %.2f ms", self.consumer, rows, infer_s * 1000.0)

    def _out_of_memory(self, rows: int) -> None:
        """Halve the row limit below the batch that did not fit; bisection retries the halves."""
        self.runtime.release_memory()
        before = self.row_limit.rows
        if self.row_limit.out_of_memory(rows):
            log.warning(
                "consumer %s: out of memory on %d rows; row limit %d -> %d",
                self.consumer,
                rows,
                before,
                self.row_limit.rows,
            )
