"""A tiny TCP proxy for tests that can stall: a silent partition between a client and Redis.

``with StallProxy(upstream_port) as proxy``: connect to ``proxy.url`` instead
of Redis. ``proxy.stall()`` keeps every connection open but forwards nothing
(bytes sent meanwhile are held, as a partitioned network would); ``resume()``
forwards again, held bytes first. New connections are accepted while stalled,
so a client that reconnects meets the same silence.
"""

from __future__ import annotations

import select
import socket
import threading
from types import TracebackType

__all__ = ["StallProxy"]


class StallProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``; can stall."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self.connections = 0  # accepted so far

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def __enter__(self) -> StallProxy:
        self._spawn(self._accept)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closed.set()
        self._flowing.set()
        self._listener.close()
        for sock in list(self._sockets):
            try:
                sock.close()
            except OSError:
                pass
        for thread in self._threads:
            thread.join(5)

    def _spawn(self, target, *args) -> None:  # type: ignore[no-untyped-def]
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            self.connections += 1
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([source], [], [], 0.1)
                if not ready:
                    continue
                self._flowing.wait()  # stalled: hold the bytes, keep the connection open
                data = source.recv(65536)
                if not data:
                    target.shutdown(socket.SHUT_WR)
                    return
                target.sendall(data)
            except OSError:
                return
