"""``inferfleet supervise``: run and size a fleet of workers for one queue.

The supervisor's and the scaling policy's options come after the worker options (the workers'
template).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import click

from inferfleet.worker.cli.options import setting_option, settings_field
from inferfleet.worker.cli.process import setup_logging
from inferfleet.worker.cli.serving import child_main, worker_options, worker_settings
from inferfleet.worker.config import WorkerSettings, env_var
from inferfleet.worker.connections import check_server
from inferfleet.worker.errors import ConfigError, ServerTooOld
from inferfleet.worker.fleet.placement import resolve_devices
from inferfleet.worker.fleet.scaling import POLICY_KINDS, PolicySettings
from inferfleet.worker.fleet.succession import LeaseHeld
from inferfleet.worker.fleet.supervisor import Supervisor, SupervisorSettings
from inferfleet.worker.signals import on_signals

if TYPE_CHECKING:
    from inferfleet.worker.metrics import FleetMetrics

__all__ = ["supervise", "policy_options", "policy_settings"]

log = logging.getLogger("inferfleet")


def policy_options(command: Any) -> Any:
    """The scaling policy's options (``supervise`` and ``scaler`` share them)."""
    for option in reversed(_POLICY_DECORATORS):
        command = option(command)
    return command


_POLICY_DECORATORS = (
    setting_option(PolicySettings, "kind", "--policy", type=click.Choice(POLICY_KINDS)),
    setting_option(PolicySettings, "target_p99_ms", "--target-p99-ms", type=float),
    setting_option(PolicySettings, "target_drain_s", "--target-drain-s", type=float),
    setting_option(PolicySettings, "target_high_wait_s", "--target-high-wait-s", type=float),
    setting_option(PolicySettings, "up_cooldown_s", "--up-cooldown-s", type=float),
    setting_option(PolicySettings, "down_cooldown_s", "--down-cooldown-s", type=float),
    setting_option(PolicySettings, "max_step", "--max-step", type=int),
    setting_option(PolicySettings, "target_utilization", "--target-utilization", type=float),
    setting_option(PolicySettings, "down_utilization", "--down-utilization", type=float),
    setting_option(PolicySettings, "article_up_queue", "--article-up-queue", type=float),
    setting_option(PolicySettings, "article_down_queue", "--article-down-queue", type=float),
    setting_option(PolicySettings, "article_interval_s", "--article-interval-s", type=float),
    setting_option(PolicySettings, "keda_lag_count", "--keda-lag-count", type=float),
)


def policy_settings(min_workers: int, max_workers: int, options: dict[str, Any]) -> PolicySettings:
    """The PolicySettings the policy options give (popped from ``options``); ConfigError if bad."""
    return PolicySettings(
        kind=options.pop("policy"),
        min_workers=min_workers,
        max_workers=max_workers,
        **{name: options.pop(name) for name in _POLICY_OPTIONS},
    )


@click.command()
@worker_options
@setting_option(PolicySettings, "min_workers", "--min-workers", type=int)
@click.option(
    "--max-workers",
    type=int,
    default=None,
    show_envvar=True,  # its default depends on --devices
    envvar=env_var(settings_field(PolicySettings, "max_workers")),
    help="Most workers (default: one per GPU, or the CPU count).",
)
@click.option(
    "--devices",
    default="auto",
    show_default=True,
    show_envvar=True,  # resolved into the field
    envvar=env_var(settings_field(SupervisorSettings, "devices")),
    help="auto, cpu, or cuda:0,cuda:1,... (workers are placed round-robin).",
)
@setting_option(SupervisorSettings, "workers_per_device", "--workers-per-device", type=int)
@policy_options
@setting_option(SupervisorSettings, "interval_s", "--interval-s", type=float)
@setting_option(SupervisorSettings, "drain_timeout_s", "--drain-timeout-s", type=float)
@setting_option(SupervisorSettings, "crash_loop_deaths", "--crash-loop-deaths", type=int)
@setting_option(SupervisorSettings, "crash_loop_window_s", "--crash-loop-window-s", type=float)
def supervise(
    log_level: str,
    log_format: str,
    min_workers: int,
    max_workers: int | None,
    devices: str,
    workers_per_device: int,
    **options: Any,
) -> None:
    """Run and size a fleet of workers for one queue from the stream's lag."""
    setup_logging(log_level, log_format)
    os.environ["INFERFLEET_LOG_LEVEL"] = log_level  # children inherit both
    os.environ["INFERFLEET_LOG_FORMAT"] = log_format
    min_workers = _cover_shards(min_workers, options["shards"])
    try:
        device_list = resolve_devices(devices)
        gpus = [d for d in device_list if d != "cpu"]
        default_max = len(gpus) * workers_per_device if gpus else (os.cpu_count() or 1)
        policy = policy_settings(min_workers, max_workers or max(default_max, min_workers), options)
        settings = SupervisorSettings(
            policy=policy,
            devices=tuple(device_list),
            workers_per_device=workers_per_device,
            **{name: options.pop(name) for name in _SUPERVISOR_OPTIONS},
            worker=worker_settings(options),
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    _run(settings)


#: The options that are fields of PolicySettings / SupervisorSettings under their own names.
_POLICY_OPTIONS = (
    "target_p99_ms",
    "target_drain_s",
    "target_high_wait_s",
    "up_cooldown_s",
    "down_cooldown_s",
    "max_step",
    "target_utilization",
    "down_utilization",
    "article_up_queue",
    "article_down_queue",
    "article_interval_s",
    "keda_lag_count",
)
_SUPERVISOR_OPTIONS = ("interval_s", "drain_timeout_s", "crash_loop_deaths", "crash_loop_window_s")


def _run(settings: SupervisorSettings) -> None:
    """Run the fleet until a stop signal, with the host's one /metrics endpoint when asked."""
    stop = threading.Event()
    metrics = _fleet_metrics(
        settings.worker
    )  # before the first child: it sets PROMETHEUS_MULTIPROC_DIR
    try:
        supervisor = Supervisor(settings, child_main, metrics=metrics)
    except ConfigError as exc:  # a device the supervisor's CUDA_VISIBLE_DEVICES hides
        if metrics is not None:
            metrics.close()
        raise click.UsageError(str(exc)) from exc
    try:
        check_server(supervisor.redis)  # once, here: not a crash loop of workers that cannot run
    except ServerTooOld as exc:
        if metrics is not None:
            metrics.close()
        raise click.ClickException(str(exc)) from exc
    _install_fleet_stop_handlers(stop, supervisor)
    try:
        supervisor.run(stop)
    except LeaseHeld as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        if metrics is not None:
            metrics.close()


def _install_fleet_stop_handlers(stop: threading.Event, supervisor: Supervisor) -> None:
    """First SIGTERM/SIGINT: drain every worker and leave. Second: kill every worker now."""

    def handle(signum: int) -> None:  # on the relay thread (worker/signals.py): it may take locks
        if stop.is_set():
            log.warning("second %s: killing every worker now", signal.Signals(signum).name)
            supervisor.kill_now.set()
            return
        log.info("%s received: draining every worker", signal.Signals(signum).name)
        stop.set()

    on_signals((signal.SIGTERM, signal.SIGINT), handle)


def _fleet_metrics(template: WorkerSettings) -> FleetMetrics | None:
    """With --metrics-port: the host's one /metrics endpoint (the children's, summed, and the
    fleet's)."""
    if not template.metrics_port:
        return None
    from inferfleet.worker.metrics import FleetMetrics

    metrics = FleetMetrics(template.name, template.metrics_port, template.metrics_address)
    try:
        metrics.start()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    return metrics


def _cover_shards(min_workers: int, shards: int) -> int:
    """Every shard needs a worker: raise --min-workers to --shards, and say so (0 stays 0: a fleet
    scaled to zero, which starts a worker for every shard when one is needed)."""
    if 0 < min_workers < shards:
        log.warning(
            "--min-workers %d is fewer than --shards %d: running at least %d workers so that every "
            "shard has one (slot i serves shard i mod %d)",
            min_workers,
            shards,
            shards,
            shards,
        )
    return max(min_workers, shards) if min_workers else 0
