"""``inferfleet worker``, the entry point of a supervised worker, and the options of one worker.

The worker options are shared with ``inferfleet supervise``: they are its workers' template.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any, Callable

import click

from inferfleet.worker.cli.options import cluster_option, name_option, prefix_option, redis_url_option, shards_option
from inferfleet.worker.cli.process import install_stop_handlers, log_format_option, log_level_option, setup_logging
from inferfleet.worker.config import DEVICE_CHOICES, ENV_VARS, PRECISIONS, WorkerSettings
from inferfleet.worker.errors import ConfigError, ModelLoadError

__all__ = ["child_main", "worker", "worker_options", "worker_settings"]

log = logging.getLogger("inferfleet")


def _env(name: str) -> dict:
    return {"envvar": ENV_VARS[name], "show_envvar": True, "show_default": True}


def _options(*decorators: Callable) -> Callable:
    """Apply a list of click option decorators (shared by worker and supervise)."""

    def apply(func: Callable) -> Callable:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


worker_options = _options(
    name_option,
    click.option("--model", required=True,
                 help="TorchScript file, torch.export .pt2 file, ONNX .onnx file, or module:Handler.",
                 envvar=ENV_VARS["model"], show_envvar=True),
    redis_url_option,
    prefix_option,
    click.option("--max-batch-rows", type=int, default=64, help="Most rows in one forward pass.",
                 **_env("max_batch_rows")),
    click.option("--max-wait-ms", type=float, default=5.0, help="Longest wait for a batch to fill.",
                 **_env("max_wait_ms")),
    click.option("--model-version", default=None, help="Version reported in replies (default: file hash).",
                 envvar=ENV_VARS["model_version"], show_envvar=True),
    click.option("--warmup-input", default=None,
                 help=".npy/.npz inputs to warm up with (default: the model's example).",
                 envvar=ENV_VARS["warmup_input"], show_envvar=True),
    click.option("--torch-threads", type=int, default=1, help="Intra-op threads of each worker process.",
                 **_env("torch_threads")),
    click.option("--precision", type=click.Choice(list(PRECISIONS)), default="fp32",
                 help="fp16/bf16 run the model under torch.autocast; int8 quantizes its linear layers "
                      "dynamically (CPU; .pt2, .onnx, handlers); outputs stay float32.",
                 **_env("precision")),
    click.option("--compile/--no-compile", default=False,
                 help="torch.compile the model (torch.export .pt2 models).", **_env("compile")),
    click.option("--prefetch", type=click.Choice(["auto", "on", "off"]), default="auto",
                 help="Read and decode the next batch while one computes (auto: on GPUs).", **_env("prefetch")),
    click.option("--tune-malloc/--no-tune-malloc", default=True,
                 help="Fix glibc's mmap/trim thresholds so batch buffers are reused, not re-mapped.",
                 **_env("tune_malloc")),
    click.option("--empty-cache-every", type=int, default=0,
                 help="Return cached GPU memory every N batches (0: never).", **_env("empty_cache_every")),
    click.option("--reply-ttl-s", type=int, default=300, help="TTL of each reply list.", **_env("reply_ttl_s")),
    click.option("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                 help="Larger bodies are answered too_large.", **_env("max_body_bytes")),
    click.option("--claim-idle-s", type=float, default=2.0,
                 help="Take over entries of a consumer with no heartbeat once idle this long.",
                 **_env("claim_idle_s")),
    click.option("--max-deliveries", type=int, default=3,
                 help="Dead-letter an entry delivered more often than this.", **_env("max_deliveries")),
    click.option("--cache-size", type=int, default=0,
                 help="Entries of the per-worker LFU result cache (0: off).", **_env("cache_size")),
    click.option("--fleet-cache-ttl-s", type=int, default=0,
                 help="Also share results fleet-wide in Redis for this long (0: off; needs --cache-size).",
                 **_env("fleet_cache_ttl_s")),
    click.option("--min-confidence", type=float, default=0.0,
                 help="Alert when a reply's top score is below this (0: off).", **_env("min_confidence")),
    click.option("--consistency-tol", type=float, default=0.0,
                 help="Alert when identical inputs on one version differ by more than this (0: off).",
                 **_env("consistency_tol")),
    click.option("--nan-guard/--no-nan-guard", default=True,
                 help="Answer model_error (and alert) for outputs holding NaN or Inf.", **_env("nan_guard")),
    click.option("--metrics-port", type=int, default=0,
                 help="Serve Prometheus metrics on this port (0: off).", **_env("metrics_port")),
    shards_option,
    cluster_option,
    log_level_option,
    log_format_option,
)


def worker_settings(options: dict[str, Any]) -> WorkerSettings:
    """The settings the worker options give (an unset option takes the field's default); bad ones exit 2."""
    try:
        return WorkerSettings(**{k: v for k, v in options.items() if v is not None})
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


@click.command()
@worker_options
@click.option("--device", default="auto", help=f"One of {DEVICE_CHOICES}.", **_env("device"))
@click.option("--consumer", default=None, help="Consumer name in the group (default host-pid).",
              envvar=ENV_VARS["consumer"], show_envvar=True)
@click.option("--shard", type=int, default=0, help="With --shards: the shard this worker serves (0 to shards-1).",
              **_env("shard"))
def worker(log_level: str, log_format: str, **options: Any) -> None:
    """Serve one queue: load and warm the model, then batch requests from the stream."""
    setup_logging(log_level, log_format)
    from inferfleet.worker.serving.serve import serve  # torch is imported only by commands that need it

    settings = worker_settings(options)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        serve(settings, stop)
    except (ModelLoadError, ConfigError) as exc:  # ConfigError: the metrics port is taken
        raise click.ClickException(str(exc)) from exc


def child_main(settings: WorkerSettings, visible_device: str | None) -> None:
    """Entry point of a supervised worker process (spawn start method)."""
    if visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device  # before torch touches CUDA
    setup_logging(os.environ.get("INFERFLEET_LOG_LEVEL", "info"), os.environ.get("INFERFLEET_LOG_FORMAT", "text"))
    from inferfleet.worker.serving.serve import serve

    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        serve(settings, stop)
    except ModelLoadError as exc:
        log.error("worker %s cannot start: %s", settings.consumer, exc)
        sys.exit(3)
