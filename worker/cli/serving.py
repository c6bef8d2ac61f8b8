"""``inferfleet worker``, the entry point of a supervised worker, and the options of one worker.

The worker options are shared with ``inferfleet supervise``: they are its workers' template.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import click

from inferfleet.worker.cli.options import (
    Decorator,
    cluster_option,
    name_option,
    prefix_option,
    redis_url_option,
    setting_option,
    shards_option,
)
from inferfleet.worker.cli.process import (
    exit_device_broken,
    install_stop_handlers,
    log_format_option,
    log_level_option,
    setup_logging,
)
from inferfleet.worker.config import PRECISIONS, TF32_CHOICES, WorkerSettings
from inferfleet.worker.errors import ConfigError, DeviceBroken, ModelLoadError, ServerTooOld
from inferfleet.worker.fleet.succession import watch_parent
from inferfleet.worker.keys import MAX_STAGES

__all__ = ["child_main", "worker", "worker_options", "worker_settings"]

log = logging.getLogger("inferfleet")


def _options(*decorators: Decorator) -> Decorator:
    """Apply a list of click option decorators, the first one outermost (first in --help)."""

    def apply(func: Callable[..., Any]) -> Callable[..., Any]:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def _setting(name: str, *decls: str, **attrs: Any) -> Decorator:
    return setting_option(WorkerSettings, name, *decls, **attrs)


#: The options of one worker, shared by ``worker`` and ``supervise`` (its workers' template).
worker_options = _options(
    name_option,
    _setting("model", "--model", "--pipeline"),
    _setting("stage", "--stage", type=click.IntRange(0, MAX_STAGES - 1)),
    redis_url_option,
    prefix_option,
    _setting("max_batch_rows", "--max-batch-rows", type=int),
    _setting("max_wait_ms", "--max-wait-ms", type=float),
    _setting("model_version", "--model-version"),
    _setting("warmup_input", "--warmup-input"),
    _setting("input_spec", "--input-spec"),
    _setting("warmup_iters", "--warmup-iters", type=click.IntRange(0, 1000)),
    _setting("torch_threads", "--torch-threads", type=int),
    _setting("precision", "--precision", type=click.Choice(list(PRECISIONS))),
    _setting("tf32", "--tf32", type=click.Choice(list(TF32_CHOICES))),
    _setting("compile", "--compile/--no-compile"),
    _setting("prefetch", "--prefetch", type=click.Choice(["auto", "on", "off"])),
    _setting("tune_malloc", "--tune-malloc/--no-tune-malloc"),
    _setting("empty_cache_every", "--empty-cache-every", type=int),
    _setting("reply_ttl_s", "--reply-ttl-s", type=int),
    _setting("max_body_bytes", "--max-body-bytes", type=int),
    _setting("wait_replicas", "--wait-replicas", type=click.IntRange(0, 64)),
    _setting("wait_timeout_ms", "--wait-timeout-ms", type=click.IntRange(1, 60_000)),
    _setting("idle_block_ms", "--idle-block-ms", type=click.IntRange(1, 60_000)),
    _setting("chunk_ms", "--chunk-ms", type=click.FloatRange(0, 10_000)),
    _setting("claim_idle_s", "--claim-idle-s", type=float),
    _setting("max_deliveries", "--max-deliveries", type=int),
    _setting("housekeeping_s", "--housekeeping-s", type=click.FloatRange(0.01, 3600)),
    _setting("heartbeat_s", "--heartbeat-s", type=click.FloatRange(0.05, 600)),
    _setting("cache_size", "--cache-size", type=int),
    _setting("fleet_cache_ttl_s", "--fleet-cache-ttl-s", type=int),
    _setting("min_confidence", "--min-confidence", type=float),
    _setting("consistency_tol", "--consistency-tol", type=float),
    _setting("nan_guard", "--nan-guard/--no-nan-guard"),
    _setting("metrics_port", "--metrics-port", type=int),
    _setting("metrics_address", "--metrics-address"),
    _setting("heartbeat_file", "--heartbeat-file"),
    shards_option,
    cluster_option,
    log_level_option,
    log_format_option,
)


def worker_settings(options: dict[str, Any]) -> WorkerSettings:
    """The settings the worker options give (an unset option takes the field's default); bad ones
    exit 2."""
    try:
        return WorkerSettings(**{k: v for k, v in options.items() if v is not None})
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


@click.command(
    epilog="""\b
Examples:
  inferfleet worker --name ctr --model models/ctr.pt
  inferfleet worker --name affine --model models/affine.pt2   # torch.export: spec in the file
  inferfleet worker --name affine --model models/affine.pt --input-spec 'float32[N,16]'
  inferfleet worker --name scale --model tests.handlers:Scale   # a handler, from ./tests"""
)
@worker_options
@_setting("device", "--device")
@_setting("consumer", "--consumer")
@_setting("shard", "--shard", type=int)
def worker(log_level: str, log_format: str, **options: Any) -> None:
    """Serve one queue: load and warm the model, then batch requests from the stream."""
    setup_logging(log_level, log_format)
    from inferfleet.worker.serving.serve import (
        serve,
    )  # torch is imported only by commands that need it

    settings = worker_settings(options)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        serve(settings, stop)
    except (ModelLoadError, ConfigError, ServerTooOld) as exc:  # Config: the metrics port is taken
        raise click.ClickException(str(exc)) from exc
    except DeviceBroken as exc:
        exit_device_broken(exc)


def child_main(settings: WorkerSettings, visible_device: str | None) -> None:
    """Entry point of a supervised worker process (spawn start method)."""
    if visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device  # before torch touches CUDA
    setup_logging(
        os.environ.get("INFERFLEET_LOG_LEVEL", "info"),
        os.environ.get("INFERFLEET_LOG_FORMAT", "text"),
    )
    from inferfleet.worker.serving.serve import serve

    stop = threading.Event()
    install_stop_handlers(stop)
    watch_parent(stop)  # the supervisor dies: drain and exit, never serve on as an orphan
    try:
        serve(settings, stop)
    except ModelLoadError as exc:
        log.error("worker %s cannot start: %s", settings.consumer, exc)
        sys.exit(3)
    except ServerTooOld as exc:  # the supervisor does not restart this one
        log.error("worker %s cannot start: %s", settings.consumer, exc)
        sys.exit(ServerTooOld.exit_status)
    except DeviceBroken as exc:
        exit_device_broken(exc)
