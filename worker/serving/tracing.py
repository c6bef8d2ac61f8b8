"""The worker's OpenTelemetry spans: a request's way through queue, batch, forward pass, reply.

Tracing is on when the ``otel`` extra (``opentelemetry-sdk``) is installed and
the standard variables configure an exporter: ``OTEL_TRACES_EXPORTER``
(``otlp`` or ``console``) or an ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` turns it
off. The SDK reads the rest itself (``OTEL_SERVICE_NAME``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``). Off, the consumer holds no
:class:`Tracing` and pays one ``is None`` test per read, batch and round.

Per request, in the trace its entry's ``traceparent`` names (a new trace without one):

* ``inferfleet.request`` (from the entry id's time to the reply written), with children
* ``inferfleet.queue_wait`` (entry id's time to the worker's read),
* ``inferfleet.batch_formation`` (read to its forward pass),
* ``inferfleet.forward`` (``inferfleet.batch.rows``, ``inferfleet.batch.requests``,
  ``inferfleet.model.version``), linked to the batch's own span, and
* ``inferfleet.reply`` (from its forward pass to the round's replies written: encoding, the
  other batches of the round, the reply script call);

and per batch, ``inferfleet.batch`` (its own trace), linked to every request
span it served. Spans are made after the round's replies are written, from
timestamps taken during the round, so a reply never waits for its spans.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from inferfleet.producer.tracing import TRACEPARENT_RE
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.intake import fields_of

__all__ = ["Tracing", "parse_traceparent", "tracing_from_env"]

log = logging.getLogger(__name__)

_MS = 1_000_000  # ns per ms


def parse_traceparent(raw: Any) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a valid version-00 ``traceparent``.

    None otherwise: the field is then ignored, as W3C says.
    """
    if not isinstance(raw, bytes):
        raw = raw.encode() if isinstance(raw, str) else b""
    match = TRACEPARENT_RE.match(raw)
    if match is None:
        return None
    trace_id, span_id = int(match.group(1), 16), int(match.group(2), 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(match.group(3), 16)


class Tracing:
    """Collects one round's timestamps and turns them into spans after its replies."""

    def __init__(self, tracer: Any, name: str, provider: Any = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, TraceFlags

        self._trace, self._Link, self._Span, self._Context = (
            trace,
            Link,
            NonRecordingSpan,
            SpanContext,
        )
        self._Flags, self._consumer_kind = TraceFlags, SpanKind.CONSUMER
        self.tracer, self.name, self.provider = tracer, name, provider
        self._batches: list[
            tuple[list[Request], int, int, str]
        ] = []  # (batch, start ns, end ns, version)

    def flush(self) -> None:
        """Export every span made so far (the SDK's processors batch them)."""
        if self.provider is not None:
            self.provider.force_flush()

    def shutdown(self) -> None:
        """Flush and stop the exporter (the worker is stopping)."""
        if self.provider is not None:
            self.provider.shutdown()

    def read(self, entries: Sequence[tuple[bytes, Any]], items: Sequence[Any]) -> None:
        """Keep each request's ``traceparent`` (in ``request.extra``) from its entry's fields."""
        for (_, fields), item in zip(entries, items):
            if isinstance(item, Request) and fields:
                raw = (fields if isinstance(fields, dict) else fields_of(fields) or {}).get(
                    b"traceparent"
                )
                if raw is not None:
                    item.extra["traceparent"] = raw

    @staticmethod
    def now() -> int:
        """Wall-clock nanoseconds (span times)."""
        return time.time_ns()

    def forward(self, batch: list[Request], version: str, started_ns: int) -> None:
        """``batch`` was computed (by ``version``) from ``started_ns`` until now."""
        self._batches.append((batch, started_ns, time.time_ns(), version))

    def replied(self) -> None:
        """The round's replies are written: make its spans (never raises into the loop)."""
        end, batches, self._batches = time.time_ns(), self._batches, []
        try:
            for batch, start, stop, version in batches:
                self._spans(batch, start, stop, version, end)
        except Exception as exc:  # noqa: BLE001 - a tracing bug must not stop serving
            log.warning("tracing: spans of a round were dropped: %s: %s", type(exc).__name__, exc)

    def _parent(self, req: Request) -> Any:
        parsed = parse_traceparent(req.extra.get("traceparent"))
        if parsed is None:
            return None
        ctx = self._Context(
            parsed[0], parsed[1], is_remote=True, trace_flags=self._Flags(parsed[2])
        )
        return self._trace.set_span_in_context(self._Span(ctx))

    def _spans(
        self, batch: list[Request], start: int, stop: int, version: str, replied: int
    ) -> None:
        attrs = {
            "inferfleet.queue": self.name,
            "inferfleet.batch.rows": sum(r.rows for r in batch),
            "inferfleet.batch.requests": len(batch),
            "inferfleet.model.version": version,
        }
        batch_span = self.tracer.start_span("inferfleet.batch", start_time=start, attributes=attrs)
        links = []
        for req in batch:
            request_ctx = self._request_spans(
                req, batch_span.get_span_context(), attrs, (start, stop, replied)
            )
            links.append(self._Link(request_ctx))
        for link in links:
            batch_span.add_link(link.context)
        batch_span.end(end_time=stop)

    def _request_spans(
        self, req: Request, batch_ctx: Any, attrs: dict, times: tuple[int, int, int]
    ) -> Any:
        start, stop, replied = times
        picked, enqueued = int(req.picked_ms * _MS), int(req.enqueued_ms) * _MS
        span = self.tracer.start_span(
            "inferfleet.request",
            context=self._parent(req),
            kind=self._consumer_kind,
            start_time=min(enqueued, picked),
            attributes={
                "inferfleet.queue": self.name,
                "inferfleet.request.id": req.rid,
                "inferfleet.model.version": attrs["inferfleet.model.version"],
            },
        )
        if not span.is_recording():  # not sampled: its children would not be either
            span.end(end_time=replied)
            return span.get_span_context()
        inside = self._trace.set_span_in_context(span)
        for name, begin, end, extra, links in (
            ("inferfleet.queue_wait", enqueued, picked, {}, None),
            ("inferfleet.batch_formation", picked, start, {}, None),
            ("inferfleet.forward", start, stop, attrs, [self._Link(batch_ctx)]),
            ("inferfleet.reply", stop, replied, {}, None),
        ):
            child = self.tracer.start_span(
                name, context=inside, start_time=min(begin, end), attributes=extra, links=links
            )
            child.end(end_time=end)
        span.end(end_time=replied)
        return span.get_span_context()


def _enabled(env: dict[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _exporter(kind: str) -> Any:
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r}: this worker exports to otlp or console")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def tracing_from_env(
    queue: str, env: dict[str, str] | None = None, exporter: Any = None
) -> Tracing | None:
    """A :class:`Tracing` when the environment asks for one (or ``exporter`` is given), else None.

    A missing package or a bad setting is logged once and leaves tracing off.
    """
    env = dict(os.environ) if env is None else env
    if exporter is None and not _enabled(env):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        kind = env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower().split(",")[0]
        provider = TracerProvider(
            resource=Resource.create(
                {"service.name": env.get("OTEL_SERVICE_NAME") or "inferfleet-worker"}
            )
        )
        provider.add_span_processor(
            BatchSpanProcessor(exporter if exporter is not None else _exporter(kind))
        )
    except (ImportError, ValueError) as exc:
        log.error("tracing is configured but off: %s (install inferfleet[otel])", exc)
        return None
    log.info("tracing on: exporting spans (%s)", "given exporter" if exporter is not None else kind)
    return Tracing(provider.get_tracer("inferfleet.worker"), queue, provider)
