"""``inferfleet supervise``: run and size a fleet of workers for one queue.

The supervisor's and the scaling policy's options come after the worker options (the workers' template).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import click

from inferfleet.worker.cli.process import setup_logging
from inferfleet.worker.cli.serving import child_main, worker_options, worker_settings
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ConfigError

if TYPE_CHECKING:
    from inferfleet.worker.fleet.supervisor import Supervisor, SupervisorSettings
    from inferfleet.worker.metrics import FleetMetrics

__all__ = ["supervise"]

log = logging.getLogger("inferfleet")


@click.command()
@worker_options
@click.option("--min-workers", type=int, default=1, show_default=True, envvar="INFERFLEET_MIN_WORKERS",
              show_envvar=True, help="Fewest workers, even when idle.")
@click.option("--max-workers", type=int, default=None, envvar="INFERFLEET_MAX_WORKERS", show_envvar=True,
              help="Most workers (default: one per GPU, or the CPU count).")
@click.option("--devices", default="auto", show_default=True, envvar="INFERFLEET_DEVICES", show_envvar=True,
              help="auto, cpu, or cuda:0,cuda:1,... (workers are placed round-robin).")
@click.option("--workers-per-device", type=int, default=1, show_default=True,
              envvar="INFERFLEET_WORKERS_PER_DEVICE", show_envvar=True, help="Workers per GPU.")
@click.option("--policy", type=click.Choice(["lag", "article", "fixed"]), default="lag", show_default=True,
              envvar="INFERFLEET_POLICY", show_envvar=True,
              help="lag: drain-time target with cooldowns; article: queue>50 +1, <10 -1 every 5 s; fixed: min.")
@click.option("--target-drain-s", type=float, default=5.0, show_default=True, envvar="INFERFLEET_TARGET_DRAIN_S",
              show_envvar=True, help="Scale up when the backlog would take longer than this to drain.")
@click.option("--up-cooldown-s", type=float, default=2.0, show_default=True, envvar="INFERFLEET_UP_COOLDOWN_S",
              show_envvar=True, help="Least time between two scale-ups.")
@click.option("--down-cooldown-s", type=float, default=20.0, show_default=True,
              envvar="INFERFLEET_DOWN_COOLDOWN_S", show_envvar=True,
              help="Least time after a change before scaling down.")
@click.option("--max-step", type=int, default=2, show_default=True, envvar="INFERFLEET_MAX_STEP",
              show_envvar=True, help="Most workers added or removed at once.")
@click.option("--interval-s", type=float, default=1.0, show_default=True, envvar="INFERFLEET_INTERVAL_S",
              show_envvar=True, help="How often the supervisor observes and decides.")
@click.option("--drain-timeout-s", type=float, default=60.0, show_default=True,
              envvar="INFERFLEET_DRAIN_TIMEOUT_S", show_envvar=True, help="Kill workers still draining after this.")
@click.option("--crash-loop-deaths", type=int, default=5, show_default=True, envvar="INFERFLEET_CRASH_LOOP_DEATHS",
              show_envvar=True, help="Stop restarting a slot after this many deaths...")
@click.option("--crash-loop-window-s", type=float, default=60.0, show_default=True,
              envvar="INFERFLEET_CRASH_LOOP_WINDOW_S", show_envvar=True, help="...within this many seconds.")
def supervise(log_level: str, log_format: str, min_workers: int, max_workers: int | None, devices: str,
              workers_per_device: int, policy: str, target_drain_s: float, up_cooldown_s: float,
              down_cooldown_s: float, max_step: int, interval_s: float, drain_timeout_s: float,
              crash_loop_deaths: int, crash_loop_window_s: float, **options: Any) -> None:
    """Run and size a fleet of workers for one queue from the stream's lag."""
    setup_logging(log_level, log_format)
    os.environ["INFERFLEET_LOG_LEVEL"] = log_level  # children inherit both
    os.environ["INFERFLEET_LOG_FORMAT"] = log_format
    from inferfleet.worker.fleet.scaling import PolicySettings
    from inferfleet.worker.fleet.supervisor import SupervisorSettings, resolve_devices

    min_workers = _cover_shards(min_workers, options["shards"])
    try:
        device_list = resolve_devices(devices)
        gpus = [d for d in device_list if d != "cpu"]
        default_max = len(gpus) * workers_per_device if gpus else (os.cpu_count() or 1)
        policy_settings = PolicySettings(kind=policy, min_workers=min_workers,
                                         max_workers=max_workers or max(default_max, min_workers),
                                         target_drain_s=target_drain_s, up_cooldown_s=up_cooldown_s,
                                         down_cooldown_s=down_cooldown_s, max_step=max_step)
        settings = SupervisorSettings(worker=worker_settings(options), policy=policy_settings,
                                      devices=tuple(device_list), workers_per_device=workers_per_device,
                                      interval_s=interval_s, drain_timeout_s=drain_timeout_s,
                                      crash_loop_deaths=crash_loop_deaths,
                                      crash_loop_window_s=crash_loop_window_s)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    _run(settings)


def _run(settings: SupervisorSettings) -> None:
    """Run the fleet until a stop signal, with the host's one /metrics endpoint when asked."""
    from inferfleet.worker.fleet.supervisor import Supervisor

    stop = threading.Event()
    metrics = _fleet_metrics(settings.worker)  # before the first child: it sets PROMETHEUS_MULTIPROC_DIR
    supervisor = Supervisor(settings, child_main, metrics=metrics)
    _install_fleet_stop_handlers(stop, supervisor)
    try:
        supervisor.run(stop)
    finally:
        if metrics is not None:
            metrics.close()


def _install_fleet_stop_handlers(stop: threading.Event, supervisor: Supervisor) -> None:
    """First SIGTERM/SIGINT: drain every worker and leave. Second: kill every worker now."""

    def handle(signum: int, frame: Any) -> None:
        if stop.is_set():
            log.warning("second %s: killing every worker now", signal.Signals(signum).name)
            supervisor.kill_now.set()
            return
        log.info("%s received: draining every worker", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def _fleet_metrics(template: WorkerSettings) -> FleetMetrics | None:
    """With --metrics-port: the host's one /metrics endpoint (the children's, summed, and the fleet's)."""
    if not template.metrics_port:
        return None
    from inferfleet.worker.metrics import FleetMetrics

    metrics = FleetMetrics(template.name, template.metrics_port)
    try:
        metrics.start()
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    return metrics


def _cover_shards(min_workers: int, shards: int) -> int:
    """Every shard needs a worker: raise --min-workers to --shards, and say so."""
    if min_workers < shards:
        log.warning("--min-workers %d is fewer than --shards %d: running at least %d workers so that every "
                    "shard has one (slot i serves shard i mod %d)", min_workers, shards, shards, shards)
    return max(min_workers, shards)
