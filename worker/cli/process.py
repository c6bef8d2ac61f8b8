"""What the commands that run a long-lived process share: the log options and set-up, the stop
signals.

The command line is the only part of inferfleet that configures logging.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import click

from inferfleet.worker.errors import DeviceBroken
from inferfleet.worker.signals import on_signals

__all__ = [
    "EXIT_DEVICE_BROKEN",
    "exit_device_broken",
    "install_stop_handlers",
    "log_format_option",
    "log_level_option",
    "setup_logging",
]

log = logging.getLogger("inferfleet")

#: Exit status of a worker whose device broke (a sticky CUDA error): restart it.
EXIT_DEVICE_BROKEN = DeviceBroken.exit_status

log_level_option = click.option(
    "--log-level",
    default="info",
    envvar="INFERFLEET_LOG_LEVEL",
    show_envvar=True,
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
)
log_format_option = click.option(
    "--log-format",
    default="text",
    envvar="INFERFLEET_LOG_FORMAT",
    show_envvar=True,
    show_default=True,
    type=click.Choice(["text", "json"]),
    help="json: one JSON object a line, with consumer, batch and request ids.",
)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger: ``level``, as text lines or one JSON object a line."""
    from inferfleet.worker.logs import setup_logging as setup

    setup(level, fmt)


def install_stop_handlers(stop: threading.Event) -> None:
    """First SIGTERM/SIGINT: finish the current batch and leave. Second: exit now."""

    def handle(signum: int) -> None:  # on the relay thread (worker/signals.py): it may take locks
        if stop.is_set():
            log.warning("second %s: exiting without draining", signal.Signals(signum).name)
            logging.shutdown()
            os._exit(128 + signum)
        log.info(
            "%s received: finishing the current batch, then stopping", signal.Signals(signum).name
        )
        stop.set()

    on_signals((signal.SIGTERM, signal.SIGINT), handle)


def exit_device_broken(exc: BaseException) -> None:
    """Exit at once, without acknowledging anything: the device is unusable (a sticky CUDA error).

    ``os._exit``: no exit handler may touch the lost CUDA context and hang. The
    entries this worker held stay pending; its restart (the supervisor's, or
    the container's restart policy) replays them one at a time, and the
    delivery limit dead-letters the one that breaks the device.
    """
    log.critical(
        "%s; exiting with status %d so the worker is restarted on a fresh device context",
        exc,
        EXIT_DEVICE_BROKEN,
    )
    logging.shutdown()
    os._exit(EXIT_DEVICE_BROKEN)
