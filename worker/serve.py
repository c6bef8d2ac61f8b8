"""Run one consumer process: load and warm the model, then join the group."""

from __future__ import annotations

import logging
import threading

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from worker.config import WorkerSettings
from worker.consumer import Consumer
from worker.heartbeat import Heartbeat
from worker.logs import bind as bind_log_fields
from worker.metrics import metrics_mode, serve_worker_metrics
from worker.runtime import load_runtime

__all__ = ["connect", "serve"]

log = logging.getLogger(__name__)


def connect(redis_url: str) -> redis.Redis:
    """A client for the worker: bytes replies, keepalive, no read timeout (reads block).

    redis-py's silent command retries are off: a retried XREADGROUP whose first
    reply was lost would leave entries pending on us unseen. A connection error
    reaches the consumer loop, which backs off, reconnects and replays its own
    pending entries.
    """
    return redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_keepalive=True,
                                health_check_interval=30, retry=Retry(NoBackoff(), 0))


def serve(settings: WorkerSettings, stop: threading.Event) -> Consumer:
    """Load the model (before joining the group, so the first request is warm) and serve.

    With ``metrics_port``, /metrics is served from the start (so a scrape
    sees the worker while it loads), unless a supervisor serves it for the
    host (multiprocess mode). Every log record carries the consumer name.
    """
    bind_log_fields(consumer=settings.consumer)
    stop_metrics = None
    if metrics_mode(settings.metrics_port) == "serve":
        stop_metrics = serve_worker_metrics(settings.metrics_port)
    try:
        return _serve(settings, stop)
    finally:
        if stop_metrics is not None:
            stop_metrics()


def _serve(settings: WorkerSettings, stop: threading.Event) -> Consumer:
    runtime = load_runtime(settings)
    consumer = Consumer(settings, runtime, connect(settings.redis_url))
    if stop.is_set():
        return consumer
    heartbeat = Heartbeat(connect(settings.redis_url), consumer.keys, settings.consumer, consumer.meter,
                          {"device": str(runtime.device), "version": runtime.version},
                          interval_s=settings.heartbeat_s)
    heartbeat.state = "serving"
    heartbeat.start()
    try:
        consumer.run(stop)
    finally:
        heartbeat.state = "stopped"
        heartbeat.stop(remove=True)
    return consumer
