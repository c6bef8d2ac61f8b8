"""``inferfleet scaler``: the scaling policy's decision over HTTP, for KEDA on Kubernetes."""

from __future__ import annotations

import signal
import threading
from typing import Any

import click

from inferfleet.worker.cli.options import QueueConfig, pass_queue_config, setting_option
from inferfleet.worker.cli.process import log_format_option, log_level_option, setup_logging
from inferfleet.worker.cli.supervise import policy_options, policy_settings
from inferfleet.worker.errors import ConfigError
from inferfleet.worker.fleet.scaler import Scaler, serve_scaler
from inferfleet.worker.fleet.scaling import PolicySettings
from inferfleet.worker.fleet.supervisor import SupervisorSettings
from inferfleet.worker.signals import on_signals

__all__ = ["scaler"]


@click.command()
@pass_queue_config
@setting_option(PolicySettings, "min_workers", "--min-workers", type=int)
@click.option(
    "--max-workers",
    type=click.IntRange(1, 4096),
    default=16,
    show_default=True,
    show_envvar=True,
    envvar="INFERFLEET_MAX_WORKERS",
    help="Most workers (keep it KEDA's maxReplicaCount).",
)
@policy_options
@setting_option(SupervisorSettings, "interval_s", "--interval-s", type=float)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=9200,
    show_default=True,
    show_envvar=True,
    envvar="INFERFLEET_SCALER_PORT",
    help="Serve /desired, /metrics and /healthz on this port.",
)
@click.option(
    "--address",
    default="0.0.0.0",
    show_default=True,
    show_envvar=True,
    envvar="INFERFLEET_SCALER_ADDRESS",
    help="...on this address.",
)
@log_level_option
@log_format_option
def scaler(
    queue: QueueConfig,
    min_workers: int,
    max_workers: int,
    interval_s: float,
    port: int,
    address: str,
    log_level: str,
    log_format: str,
    **options: Any,
) -> None:
    """Decide a queue's worker count with the scaling policy, for KEDA's metrics-api scaler."""
    setup_logging(log_level, log_format)
    if interval_s < 0.05:
        raise click.BadParameter(
            f"must be at least 0.05, got {interval_s}", param_hint="--interval-s"
        )
    try:
        policy = policy_settings(min_workers, max(max_workers, min_workers), options)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    client, keys = queue.connect()
    stop = threading.Event()
    on_signals((signal.SIGTERM, signal.SIGINT), lambda _signum: stop.set())
    try:
        serve_scaler(Scaler(client, keys, policy), queue.name, address, port, interval_s, stop)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
