"""Run one consumer process: load and warm the model, then join the group."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import redis

from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import worker_client
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.heartbeat import Heartbeat
from inferfleet.worker.logs import bind as bind_log_fields
from inferfleet.worker.metrics import metrics_mode, serve_worker_metrics
from inferfleet.worker.runtime.devices import peak_memory_mib
from inferfleet.worker.runtime.loading import ModelRuntime, load_runtime
from inferfleet.worker.serving.consumer import Consumer
from inferfleet.worker.serving.lifecycle import ModelWatcher, read_published

__all__ = ["serve"]

log = logging.getLogger(__name__)


def serve(settings: WorkerSettings, stop: threading.Event) -> Consumer:
    """Load the model (before joining the group, so the first request is warm) and serve.

    With ``metrics_port``, /metrics is served from the start (so a scrape
    sees the worker while it loads), unless a supervisor serves it for the
    host (multiprocess mode). Every log record carries the consumer name.
    """
    bind_log_fields(consumer=settings.consumer)
    stop_metrics = None
    if metrics_mode(settings.metrics_port) == "serve":
        stop_metrics = serve_worker_metrics(settings.metrics_port, settings.metrics_address)
    try:
        return _serve(settings, stop)
    finally:
        if stop_metrics is not None:
            stop_metrics()


def _serve(settings: WorkerSettings, stop: threading.Event) -> Consumer:
    client = worker_client(settings.redis_url, settings.cluster)
    runtime, seen_seq, source = _load_current(settings, client)
    watcher = ModelWatcher(client, settings.queue_keys, settings, load_runtime, seen_seq)
    consumer = Consumer(settings, runtime, client, watcher=watcher, model_source=source)
    if stop.is_set():
        return consumer
    heartbeat = Heartbeat(worker_client(settings.redis_url, settings.cluster), consumer.keys, settings.consumer,
                          consumer.counters, {"device": str(runtime.device)},
                          interval_s=settings.heartbeat_s, extra=consumer.heartbeat_fields,
                          file=settings.heartbeat_file or None)
    heartbeat.state = "serving"
    heartbeat.start()
    try:
        consumer.run(stop)
    finally:
        heartbeat.state = "stopped"
        heartbeat.stop(remove=True)
    _log_peak_memory(consumer)
    return consumer


def _log_peak_memory(consumer: Consumer) -> None:
    """On a GPU, what torch's allocator held at most (scripts/gpu_bench.py reads this line)."""
    peak = peak_memory_mib(consumer.runtime.device)
    if peak is not None:
        log.info("consumer %s: peak GPU memory %.0f MiB allocated, %.0f MiB reserved on %s",
                 consumer.settings.consumer, peak[0], peak[1], consumer.runtime.device)


def _load_current(settings: WorkerSettings, client: redis.Redis) -> tuple[ModelRuntime, int, str]:
    """Load the fleet's published model if ``inferfleet swap`` set one, else ``--model``.

    So a worker started after a swap never serves an older version than the
    fleet. If the published model cannot be loaded here, the worker says why
    and falls back to its own ``--model`` rather than not serving at all.
    """
    try:
        published = read_published(client, settings.queue_keys)
    except redis.exceptions.RedisError as exc:
        log.warning("cannot read the published model version (%s): loading --model %s", exc, settings.model)
        published = None
    if published is None or (published.model, published.version) == (settings.model, settings.model_version):
        return load_runtime(settings), published.seq if published else 0, settings.model
    log.info("queue %s: the fleet serves version %s (%s), not --model %s: loading that",
             settings.name, published.version, published.model, settings.model)
    try:
        runtime = load_runtime(replace(settings, model=published.model, model_version=published.version))
        return runtime, published.seq, published.model
    except ModelLoadError as exc:
        log.error("cannot load the published version %s (%s): serving --model %s instead",
                  published.version, exc, settings.model)
        return load_runtime(settings), published.seq, settings.model
