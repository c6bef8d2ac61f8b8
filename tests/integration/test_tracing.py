"""Traces: the producer's trace id carried through the worker's spans (OpenTelemetry SDK
exporters)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import redis
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferfleet.producer import Producer
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.consumer import Consumer
from inferfleet.worker.serving.hooks import Hooks
from inferfleet.worker.serving.tracing import tracing_from_env
from tests.conftest import ROOT, stop_process, wait_for_consumer, worker_env
from tests.helpers import drain

CHILDREN = {
    "inferfleet.queue_wait",
    "inferfleet.batch_formation",
    "inferfleet.forward",
    "inferfleet.reply",
}


@pytest.fixture
def traced(redis_url, redis_client, models_dir):
    """An in-process consumer of the affine model whose spans go to an in-memory exporter."""
    settings = WorkerSettings(
        name="q",
        model=str(models_dir / "affine.pt"),
        redis_url=redis_url,
        device="cpu",
        max_wait_ms=20,
    )
    exporter = InMemorySpanExporter()
    tracing = tracing_from_env("q", env={}, exporter=exporter)
    assert tracing is not None
    consumer = Consumer(
        settings,
        load_runtime(settings),
        redis.Redis.from_url(redis_url),
        hooks=lambda _: Hooks(tracing=tracing),
    )
    consumer.prepare()
    yield consumer, exporter
    tracing.shutdown()


def test_each_request_span_continues_the_producers_trace_and_links_its_batch(traced, redis_url):
    consumer, exporter = traced
    client_tracer = TracerProvider().get_tracer("client")
    x = np.ones((1, 16), dtype=np.float32)
    with Producer(redis_url, "q") as producer:
        with client_tracer.start_as_current_span("checkout") as parent:
            ids = [producer.submit(x) for _ in range(3)]
        untraced = producer.submit(x)
        drain(consumer, count=4, rounds=100)
        assert all(producer.result(rid, 10).ok for rid in [*ids, untraced])
    consumer.hooks.tracing.flush()
    spans = exporter.get_finished_spans()
    want = parent.get_span_context()
    requests = {
        s.attributes["inferfleet.request.id"]: s for s in spans if s.name == "inferfleet.request"
    }
    assert set(requests) == {*ids, untraced}
    for rid in ids:
        span = requests[rid]
        assert span.context.trace_id == want.trace_id and span.parent.span_id == want.span_id
    assert (
        requests[untraced].context.trace_id != want.trace_id and requests[untraced].parent is None
    )
    batches = {s.context.span_id: s for s in spans if s.name == "inferfleet.batch"}
    for rid in ids:
        children = [
            s
            for s in spans
            if s.parent is not None and s.parent.span_id == requests[rid].context.span_id
        ]
        assert {s.name for s in children} == CHILDREN
        assert all(s.context.trace_id == want.trace_id for s in children)
        forward = next(s for s in children if s.name == "inferfleet.forward")
        assert forward.attributes["inferfleet.model.version"] == consumer.runtime.version
        assert forward.attributes["inferfleet.batch.rows"] >= 1
        batch = batches[forward.links[0].context.span_id]  # the batch it shared
        assert requests[rid].context.span_id in {link.context.span_id for link in batch.links}
        wait = next(s for s in children if s.name == "inferfleet.queue_wait")
        assert wait.start_time <= wait.end_time <= forward.start_time <= forward.end_time


def test_a_bulk_call_carries_the_trace_and_a_bad_traceparent_is_ignored(
    traced, redis_url, redis_client
):
    consumer, exporter = traced
    client_tracer = TracerProvider().get_tracer("client")
    xs = [np.full((1, 16), i, dtype=np.float32) for i in range(5)]
    redis_client.xadd(
        "inferfleet:{q}:requests", {"id": "raw-1", "body": _body(xs[0]), "traceparent": "junk"}
    )
    with Producer(redis_url, "q") as producer:
        with client_tracer.start_as_current_span("batch-job") as parent:
            ids = producer.submit_many(xs)
        drain(consumer, count=6, rounds=100)
        assert all(producer.result(rid, 10).ok for rid in [*ids, "raw-1"])
    consumer.hooks.tracing.flush()
    requests = {
        s.attributes["inferfleet.request.id"]: s
        for s in exporter.get_finished_spans()
        if s.name == "inferfleet.request"
    }
    assert {requests[rid].context.trace_id for rid in ids} == {parent.get_span_context().trace_id}
    assert requests["raw-1"].parent is None  # answered, in a trace of its own


def _body(x: np.ndarray) -> bytes:
    from inferfleet.producer.protocol import encode_body

    return encode_body(x)


def test_a_worker_process_exports_spans_of_the_producers_trace(redis_url, redis_client, models_dir):
    env = {
        **worker_env(redis_url),
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "w-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferfleet",
            "worker",
            "--name",
            "q",
            "--model",
            str(models_dir / "affine.pt"),
            "--consumer",
            "traced",
            "--device",
            "cpu",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_consumer(redis_client, "inferfleet:{q}:requests", "traced", proc)
        client_tracer = TracerProvider().get_tracer("client")
        with Producer(redis_url, "q") as producer:
            with client_tracer.start_as_current_span("checkout") as parent:
                assert producer.infer(np.ones((1, 16), dtype=np.float32)) is not None
    finally:
        stop_process(proc)
    out = proc.stdout.read().decode()
    proc.stdout.close()
    spans = _console_spans(out)
    trace_hex = f"0x{parent.get_span_context().trace_id:032x}"
    assert {s["name"] for s in spans} == CHILDREN | {"inferfleet.request", "inferfleet.batch"}
    in_trace = [s for s in spans if s["context"]["trace_id"] == trace_hex]
    assert sorted(s["name"] for s in in_trace) == sorted(CHILDREN | {"inferfleet.request"})
    assert all(s["resource"]["attributes"]["service.name"] == "w-test" for s in spans)


def _console_spans(out: str) -> list[dict]:
    """The JSON objects ConsoleSpanExporter printed, one after another."""
    decoder, spans, at = json.JSONDecoder(), [], 0
    while True:
        start = out.find("{", at)
        if start < 0:
            return spans
        span, at = decoder.raw_decode(out, start)
        spans.append(span)
