"""Tracing switches: off unless configured, off without the package; traceparent in and out."""

from __future__ import annotations

import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider

from inferfleet.producer import tracing as producer_tracing
from inferfleet.producer.tracing import current_traceparent, traceparent_fields
from inferfleet.worker.serving.tracing import parse_traceparent, tracing_from_env

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_is_parsed_and_anything_else_ignored() -> None:
    assert parse_traceparent(VALID.encode()) == (
        0x4BF92F3577B34DA6A3CE929D0E0E4736,
        0x00F067AA0BA902B7,
        1,
    )
    assert parse_traceparent(VALID) is not None
    for bad in (
        b"junk",
        b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01",
        VALID.upper().encode(),
        VALID.encode() + b"-x",
        None,
        17,
    ):
        assert parse_traceparent(bad) is None


def test_tracing_is_off_unless_an_exporter_is_configured() -> None:
    assert tracing_from_env("q", env={}) is None
    assert tracing_from_env("q", env={"OTEL_TRACES_EXPORTER": "none"}) is None
    assert (
        tracing_from_env("q", env={"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"})
        is None
    )
    on = tracing_from_env("q", env={"OTEL_TRACES_EXPORTER": "console"})
    assert on is not None
    on.shutdown()


def test_an_unknown_exporter_or_a_missing_sdk_leaves_tracing_off(monkeypatch, caplog) -> None:
    assert tracing_from_env("q", env={"OTEL_TRACES_EXPORTER": "zipkin"}) is None
    assert "zipkin" in caplog.text
    monkeypatch.setitem(
        sys.modules, "opentelemetry.sdk.trace", None
    )  # as if the otel extra were missing
    assert tracing_from_env("q", env={"OTEL_TRACES_EXPORTER": "console"}) is None
    assert "inferfleet[otel]" in caplog.text


def test_the_sdk_sends_the_current_spans_context_and_nothing_without_one(monkeypatch) -> None:
    assert current_traceparent() is None and traceparent_fields() == []
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("s") as span:
        ctx = span.get_span_context()
        value = current_traceparent()
        assert value == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        assert parse_traceparent(value) == (ctx.trace_id, ctx.span_id, int(ctx.trace_flags))
        monkeypatch.setattr(producer_tracing, "_api", False)  # opentelemetry-api not installed
        assert current_traceparent() is None


@pytest.mark.parametrize("deadline_s", [None, 5.0])
def test_the_bulk_calls_add_the_traceparent_once_per_round(deadline_s) -> None:
    from inferfleet.producer.sync import Producer

    producer = Producer("redis://127.0.0.1:1/0", "q", default_deadline_s=deadline_s)
    with TracerProvider().get_tracer("t").start_as_current_span("s"):
        fields = dict(producer.deadline_fields(None))
    producer.close()
    assert parse_traceparent(fields["traceparent"]) is not None
    assert ("deadline" in fields) == (deadline_s is not None)
