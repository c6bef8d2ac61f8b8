"""Run one consumer process: load and warm the model, then join the group."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import redis
import torch

from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import check_server, worker_client
from inferfleet.worker.counters import Counters
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.heartbeat import Heartbeat
from inferfleet.worker.logs import bind as bind_log_fields
from inferfleet.worker.metrics import metrics_mode, serve_worker_metrics, worker_metrics
from inferfleet.worker.runtime.devices import (
    apply_tf32,
    device_label,
    peak_memory_mib,
    select_device,
)
from inferfleet.worker.runtime.loading import (
    ModelRuntime,
    apply_process_settings,
    load_runtime,
    resolve_device,
)
from inferfleet.worker.runtime.readers import load_stepwise
from inferfleet.worker.runtime.stepwise import StepwiseHandler
from inferfleet.worker.serving.alerts import Alert
from inferfleet.worker.serving.alerts import publish as publish_alerts
from inferfleet.worker.serving.compute import encode_answer
from inferfleet.worker.serving.consumer import Consumer
from inferfleet.worker.serving.generation import GenerationConsumer
from inferfleet.worker.serving.hooks import Hooks
from inferfleet.worker.serving.lifecycle import ModelWatcher, Published, mark_served, read_published
from inferfleet.worker.serving.shadow import ShadowRunner
from inferfleet.worker.serving.stages import StageConsumer, stage_label
from inferfleet.worker.serving.tracing import tracing_from_env

__all__ = ["serve"]

log = logging.getLogger(__name__)


def serve(settings: WorkerSettings, stop: threading.Event) -> Consumer | None:
    """Load the model (before joining the group, so the first request is warm) and serve.

    With ``metrics_port``, /metrics is served from the start (so a scrape
    sees the worker while it loads), unless a supervisor serves it for the
    host (multiprocess mode). Every log record carries the consumer name.
    """
    bind_log_fields(consumer=settings.consumer)
    _freeze_startup_heap()  # after the binding: its log line carries the consumer too
    stop_metrics = None
    if metrics_mode(settings.metrics_port) == "serve":
        stop_metrics = serve_worker_metrics(settings.metrics_port, settings.metrics_address)
    try:
        return _serve(settings, stop)
    finally:
        if stop_metrics is not None:
            stop_metrics()


def _freeze_startup_heap() -> None:
    """Move every object alive now (torch's, numpy's and the modules') out of the cyclic GC's sight.

    A worker allocates a few container objects per request, so Python's
    collector runs often, and each full collection walked the hundreds of
    thousands of objects that importing torch leaves, none of which will
    ever be garbage: 0.3-0.6 us of worker CPU a request draining one-row
    requests (docs/benchmarks.md). Called before the model loads, so a model
    dropped by a hot swap is still collected.
    """
    gc.collect()
    gc.freeze()
    log.debug(
        "%d start-up objects frozen out of the garbage collector's walks", gc.get_freeze_count()
    )


def _serve(settings: WorkerSettings, stop: threading.Event) -> Consumer | None:
    client = worker_client(
        settings.redis_url, settings.cluster, block_s=settings.idle_block_ms / 1000.0
    )
    check_server(client)  # before the model loads: without Functions nothing would work
    label = settings.name if settings.stage is None else stage_label(settings)
    counters = Counters(worker_metrics(label, settings.metrics_port))  # a stage's are its own
    stepwise = _load_stepwise(settings)
    if stepwise is not None:  # a generative model: continuous batching, streamed replies
        _serve_generation(settings, client, counters, stepwise, stop)
        return None
    loaded = _load_current(settings, client, counters, stop)
    if loaded is None:
        return None  # stopped while no version it can load was published
    runtime, seen_seq, source = loaded
    watcher = ModelWatcher(client, settings.queue_keys, settings, load_runtime, seen_seq)
    kind = Consumer if settings.stage is None else StageConsumer  # one stage of a split model
    consumer = kind(
        settings,
        runtime,
        client,
        counters=counters,
        watcher=watcher,
        model_source=source,
        hooks=lambda c: Hooks(_shadow_runner(c, client), tracing_from_env(settings.name)),
    )
    hooks = consumer.hooks
    assert hooks is not None
    if stop.is_set():
        return consumer

    def fields() -> dict[str, Any]:
        return {**consumer.heartbeat_fields(), **hooks.heartbeat_fields()}

    try:
        with _serving_heartbeat(settings, consumer.counters, runtime.device, fields):
            consumer.run(stop)
    finally:
        hooks.close()
    _log_peak_memory(consumer)
    return consumer


@contextmanager
def _serving_heartbeat(
    settings: WorkerSettings,
    counters: Counters,
    device: torch.device,
    extra: Callable[[], dict[str, Any]],
) -> Iterator[None]:
    """The worker's heartbeat, ``serving`` while the block runs (``extra``: its own fields),
    ``stopped`` and removed after."""
    heartbeat = Heartbeat(
        worker_client(settings.redis_url, settings.cluster),
        settings.queue_keys,
        settings.consumer,
        counters,
        {"device": device_label(device)},
        interval_s=settings.heartbeat_s,
        extra=extra,
        file=settings.heartbeat_file or None,
    )
    heartbeat.state = "serving"
    heartbeat.start()
    try:
        yield
    finally:
        heartbeat.state = "stopped"
        heartbeat.stop(remove=True)


def _load_stepwise(settings: WorkerSettings) -> StepwiseHandler | None:
    """The step-wise model ``settings`` names, set up under the worker's process settings (torch
    threads, the allocator's thresholds, the current CUDA device and TF32: ``load_runtime``
    applies them to any other model), or None: the model is not step-wise."""
    apply_process_settings(settings)
    device = resolve_device(settings.device)
    select_device(device)  # cuda:N: the loop's current device, as for any other model
    apply_tf32(settings.tf32)
    return load_stepwise(settings.model, device)


def _serve_generation(
    settings: WorkerSettings,
    client: redis.Redis,
    counters: Counters,
    model: StepwiseHandler,
    stop: threading.Event,
) -> None:
    """Serve a step-wise model (generation.py) with its heartbeat, until ``stop``."""
    version = settings.model_version or model.version or "1"
    consumer = GenerationConsumer(settings, model, client, counters, (settings.name, version))
    counters.model_version(version)
    log.info(
        "model %s version %s on %s: step-wise, %d slots",
        settings.name,
        version,
        model.device,
        model.max_slots,
    )

    def fields() -> dict[str, Any]:
        return {
            "version": version,
            "model": settings.model,
            "loop_ms": int(consumer.loop_at_s * 1000),
            "max_rows": model.max_slots,
            "live": len(consumer.seqs),
        }

    with _serving_heartbeat(settings, counters, model.device, fields):
        consumer.run(stop)


def _log_peak_memory(consumer: Consumer) -> None:
    """On a GPU, what torch's allocator held at most (benchmarks/gpu_bench.py reads this line)."""
    peak = peak_memory_mib(consumer.runtime.device)
    if peak is not None:
        log.info(
            "consumer %s: peak GPU memory %.0f MiB allocated, %.0f MiB reserved on %s",
            consumer.settings.consumer,
            peak[0],
            peak[1],
            consumer.runtime.device,
        )


def _shadow_runner(consumer: Consumer, client: redis.Redis) -> ShadowRunner:
    """The consumer's side of ``inferfleet shadow``; its alerts are counted and published like the
    consumer's."""

    def alert(alerts: list[Alert]) -> None:
        for each in alerts:
            consumer.counters.alert(each.kind)
        publish_alerts(client, consumer.keys, alerts)

    return ShadowRunner(
        client,
        consumer.keys,
        consumer.settings,
        load_runtime,
        consumer.counters,
        alert,
        encode_answer,
        canary_allowed=not consumer.results.keyed,
    )


def _read_published(settings: WorkerSettings, client: redis.Redis) -> Published | None:
    try:
        return read_published(client, settings.queue_keys)
    except redis.exceptions.RedisError as exc:
        log.warning(
            "cannot read the published model version (%s): loading --model %s", exc, settings.model
        )
        return None


def _load_current(
    settings: WorkerSettings, client: redis.Redis, counters: Counters, stop: threading.Event
) -> tuple[ModelRuntime, int, str] | None:
    """Load the fleet's published model if ``inferfleet swap`` set one, else ``--model``.

    So a worker started after a swap never serves another version than the
    fleet. If the published model cannot be loaded here, the worker does not
    fall back to its ``--model`` (the fleet would silently serve two
    versions): it stays out of the group, says why (log, alert, heartbeat,
    metric) and waits for a version it can load to be published. None if
    ``stop`` is set meanwhile.
    """
    published = _read_published(settings, client)
    while True:
        if published is None or (published.model, published.version) == (
            settings.model,
            settings.model_version,
        ):
            return load_runtime(settings), published.seq if published else 0, settings.model
        log.info(
            "queue %s: the fleet serves version %s (%s), not --model %s: loading that",
            settings.name,
            published.version,
            published.model,
            settings.model,
        )
        try:
            runtime = load_runtime(
                replace(settings, model=published.model, model_version=published.version)
            )
        except ModelLoadError as exc:
            published = _wait_for_loadable(settings, client, counters, published, exc, stop)
            if stop.is_set():
                return None
            continue
        try:
            mark_served(client, settings.queue_keys, published)
        except redis.exceptions.RedisError as exc:
            log.warning("cannot record version %s as served: %s", published.version, exc)
        return runtime, published.seq, published.model


def _announce_cannot_load(
    settings: WorkerSettings,
    client: redis.Redis,
    counters: Counters,
    published: Published,
    error: ModelLoadError,
) -> str:
    """Say loudly, in the log, the counters and the alerts, that ``published`` does not load."""
    detail = f"version {published.version}: {error}"
    log.error(
        "CANNOT SERVE: the fleet's published version %s (%s) does not load here: %s. This "
        "worker stays out of the group (it does not serve another version) until a version "
        "it can load is published "
        "(inferfleet swap --rollback, or --model)",
        published.version,
        published.model,
        error,
    )
    counters.swap("failed")
    counters.alert("swap_failed")
    try:
        alert = Alert("swap_failed", detail, settings.consumer, "none")
        publish_alerts(client, settings.queue_keys, [alert])
    except redis.exceptions.RedisError as exc:
        log.warning("cannot publish the swap_failed alert: %s", exc)
    return detail


def _wait_for_loadable(
    settings: WorkerSettings,
    client: redis.Redis,
    counters: Counters,
    published: Published,
    error: ModelLoadError,
    stop: threading.Event,
) -> Published | None:
    """Out of the group, loudly, until another version is published (returned; None if the hash was
    deleted: then ``--model`` is the fleet's version again) or ``stop`` is set."""
    detail = _announce_cannot_load(settings, client, counters, published, error)
    heartbeat = Heartbeat(
        worker_client(settings.redis_url, settings.cluster),
        settings.queue_keys,
        settings.consumer,
        counters,
        {"device": settings.device},
        interval_s=settings.heartbeat_s,
        extra=lambda: {"version": "none", "model": published.model, "swap_error": detail},
    )
    heartbeat.state = "cannot-load"
    heartbeat.start()
    try:
        while not stop.wait(max(settings.housekeeping_s, 0.5)):
            try:
                current = read_published(client, settings.queue_keys)
            # keep waiting: never fall back on a Redis error
            except redis.exceptions.RedisError as exc:
                log.warning("cannot read the published model version (%s): still waiting", exc)
                continue
            if current is None or current.seq != published.seq:
                return current
        return None
    finally:
        heartbeat.stop(remove=True)
