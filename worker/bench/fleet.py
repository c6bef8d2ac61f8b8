"""What a benchmark run starts and stops: a private Redis, ``--spawn`` workers, the naive server.

:class:`BenchFleet` starts them, waits until every consumer has joined group
``workers``, and stops all of them on success, error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import redis

from inferfleet.producer import errors
from inferfleet.producer.connections import DEFAULT_REDIS_URL
from inferfleet.producer.protocol import DEFAULT_PREFIX, GROUP, QueueKeys
from inferfleet.worker.connections import admin_client
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.errors import WorkerError

__all__ = [
    "BASELINES",
    "BenchError",
    "BenchFleet",
    "DEFAULT_NAME",
    "FleetSetup",
    "FleetStartError",
    "NAIVE_SUFFIX",
]

log = logging.getLogger(__name__)

BASELINES = ("none", "naive")
NAIVE_SUFFIX = "-naive"  # the naive server's queue is NAME-naive
DEFAULT_NAME = "bench"
_JOIN_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 10.0


class BenchError(ValueError):
    """The benchmark was asked for something it cannot do (bad or contradictory options)."""


class FleetStartError(WorkerError):
    """Something the benchmark started (Redis, a worker, the naive server) did not come up."""


@dataclass(frozen=True)
class FleetSetup:
    """Which fleet to measure and what to start for it. Validated on construction."""

    name: str | None
    model: str | None = None
    spawn: int = 0
    worker_args: tuple[str, ...] = ()
    baseline: str = "none"
    redis_url: str | None = None
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if self.spawn < 0:
            raise BenchError(f"--spawn must be at least 0, got {self.spawn}")
        if self.spawn and not self.model:
            raise BenchError("--spawn needs --model: the model the spawned workers serve")
        if self.worker_args and not self.spawn:
            raise BenchError("--worker-arg is passed to spawned workers: it needs --spawn")
        if self.baseline not in BASELINES:
            raise BenchError(
                f"--baseline must be one of {', '.join(BASELINES)}, got {self.baseline!r}"
            )
        if self.baseline == "naive" and not self.model:
            raise BenchError("--baseline naive needs --model: the model the naive server loads")
        if self.name is None and not self.spawn:
            raise BenchError(
                "--name is required to measure running workers (or use --spawn N --model PATH)"
            )
        try:
            QueueKeys(self.naive_queue if self.baseline == "naive" else self.queue, self.prefix)
        except errors.ProtocolError as exc:
            raise BenchError(str(exc)) from exc

    @property
    def queue(self) -> str:
        """The fleet's queue name."""
        return self.name or DEFAULT_NAME

    @property
    def naive_queue(self) -> str:
        """The naive server's queue name: the fleet's plus ``-naive``."""
        return self.queue + NAIVE_SUFFIX

    def targets(self) -> list[tuple[str, str]]:
        """(target label, queue name) of everything to measure: the fleet, then the baseline."""
        found = [("fleet", self.queue)]
        return found + [("naive", self.naive_queue)] if self.baseline == "naive" else found

    def describe(self) -> str:
        """One line on what was measured, for report headings."""
        fleet = (
            f"{self.spawn} spawned worker{'s' if self.spawn != 1 else ''}"
            if self.spawn
            else "running workers"
        )
        if self.worker_args:
            fleet += f" ({' '.join(self.worker_args)})"
        baseline = (
            "; baseline: naive (one request at a time, model loaded on the first)"
            if self.baseline == "naive"
            else ""
        )
        return f"queue `{self.queue}`, fleet: {fleet}, model: `{self.model or '-'}`{baseline}"


@dataclass
class _Child:
    """A process bench started, the consumer it should join as, and its captured stderr."""

    what: str
    queue: str
    consumer: str
    proc: subprocess.Popen
    log: IO[bytes]

    def log_tail(self, chars: int = 2000) -> str:
        """The end of what the process wrote to stderr."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:].strip()

    def check_alive(self) -> None:
        """Raise FleetStartError (with its stderr) if the process has exited."""
        if self.proc.poll() is not None:
            raise FleetStartError(
                f"{self.what} exited with status {self.proc.returncode} before joining "
                f"group {GROUP}:\n{self.log_tail()}"
            )


def _child_env(url: str) -> dict[str, str]:
    env = dict(os.environ, REDIS_URL=url)
    root = str(
        Path(__file__).resolve().parents[2]
    )  # the checkout: module:Handler specs import from it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _consumers(client: redis.Redis, stream: str) -> set[str]:
    """Names of the consumers in group ``workers`` of ``stream`` (none yet: empty)."""
    try:
        found = client.xinfo_consumers(stream, GROUP)
    except redis.exceptions.ResponseError:
        return set()  # no stream or no group yet
    return {c["name"].decode() if isinstance(c["name"], bytes) else c["name"] for c in found}


def _connect(url: str) -> redis.Redis:
    try:
        return admin_client(url)
    except ValueError as exc:
        raise BenchError(f"--redis-url: {exc}") from exc


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class BenchFleet:
    """``with BenchFleet(setup) as fleet:`` everything ``setup`` asks to start, stopped on the way
    out.

    Resolves the Redis URL (a private :class:`EmbeddedRedis` when workers
    are spawned and no URL is given), starts ``setup.spawn`` ``inferfleet
    worker`` processes and the naive server, and waits until each joined
    group ``workers``. Leaving the block, normally, on an error, on Ctrl-C
    or on SIGTERM, stops what it started: SIGTERM, wait, SIGKILL.
    """

    def __init__(self, setup: FleetSetup) -> None:
        self.setup = setup
        self.url = ""
        self._redis: EmbeddedRedis | None = None
        self._children: list[_Child] = []
        self._old_sigterm: Any = None

    def __enter__(self) -> BenchFleet:
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        self.url = self._resolve_url()
        if not self.setup.spawn:
            self._check_workers_running()
        for i in range(self.setup.spawn):
            consumer = f"bench-{os.getpid()}-{i}"
            self._launch(f"worker {i}", self.setup.queue, consumer, self._worker_command(consumer))
        if self.setup.baseline == "naive":
            consumer = f"naive-{os.getpid()}"
            self._launch(
                "the naive server", self.setup.naive_queue, consumer, self._naive_command(consumer)
            )
        self._wait_joined()

    def _resolve_url(self) -> str:
        if self.setup.redis_url:
            return self.setup.redis_url
        if not self.setup.spawn:
            return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
        try:
            self._redis = EmbeddedRedis().start()
        except RuntimeError as exc:
            raise FleetStartError(
                f"cannot start a private Redis: {exc} (or pass --redis-url)"
            ) from exc
        return self._redis.url

    def _check_workers_running(self) -> None:
        stream = QueueKeys(self.setup.queue, self.setup.prefix).requests
        client = _connect(self.url)
        try:
            if not _consumers(client, stream):
                raise FleetStartError(
                    f"no worker serves queue {self.setup.queue!r} (no consumer in group "
                    f"{GROUP} of {stream}): start workers, or use --spawn N --model PATH"
                )
        except redis.exceptions.RedisError as exc:
            raise FleetStartError(f"cannot reach Redis: {exc}") from exc
        finally:
            client.close()

    def _worker_command(self, consumer: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "inferfleet",
            "worker",
            "--name",
            self.setup.queue,
            "--model",
            self.setup.model or "",
            "--prefix",
            self.setup.prefix,
            "--consumer",
            consumer,
            "--log-level",
            "warning",
            *self.setup.worker_args,
        ]

    def _naive_command(self, consumer: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "inferfleet.worker.bench.naive",
            "--name",
            self.setup.naive_queue,
            "--model",
            self.setup.model or "",
            "--redis-url",
            self.url,
            "--prefix",
            self.setup.prefix,
            "--consumer",
            consumer,
        ]

    def _launch(self, what: str, queue: str, consumer: str, command: list[str]) -> None:
        err = tempfile.TemporaryFile()  # noqa: SIM115 - open while the child runs; stop() closes it
        proc = subprocess.Popen(
            command, env=_child_env(self.url), stdout=subprocess.DEVNULL, stderr=err
        )
        self._children.append(_Child(what, queue, consumer, proc, err))

    def _wait_joined(self) -> None:
        if not self._children:
            return
        client = _connect(self.url)
        waiting = list(self._children)
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        try:
            while waiting:
                for child in list(waiting):
                    child.check_alive()
                    if child.consumer in _consumers(
                        client, QueueKeys(child.queue, self.setup.prefix).requests
                    ):
                        waiting.remove(child)
                if waiting and time.monotonic() > deadline:
                    raise FleetStartError(
                        f"{waiting[0].what} did not join within {_JOIN_TIMEOUT_S:.0f} s"
                    )
                time.sleep(0.05)
        except redis.exceptions.RedisError as exc:
            raise FleetStartError(
                f"Redis error while waiting for the workers to join: {exc}"
            ) from exc
        finally:
            client.close()

    def stop(self) -> None:
        """Stop every process started (SIGTERM, wait, SIGKILL) and the private Redis."""
        for child in self._children:
            if child.proc.poll() is None:
                child.proc.terminate()
        for child in self._children:
            try:
                child.proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            child.log.close()
        if self.setup.baseline == "naive" and self._children and self._redis is None:
            self._drop_naive_queue()
        self._children = []
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _drop_naive_queue(self) -> None:
        """The naive server never trims its stream: delete it on a shared Redis."""
        try:
            client = _connect(self.url)
            client.delete(QueueKeys(self.setup.naive_queue, self.setup.prefix).requests)
            client.close()
        except redis.exceptions.RedisError as exc:
            log.warning("could not delete the naive server's stream: %s", exc)
