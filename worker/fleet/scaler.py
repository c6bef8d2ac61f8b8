"""The scaling policy for a fleet that something else runs: KEDA on Kubernetes reads its number.

On one machine the supervisor decides and starts the processes itself. On
Kubernetes the pods are the workers and KEDA sets their count, so
``inferfleet scaler`` runs the same decision
(:func:`~inferfleet.worker.fleet.scaling.desired_workers`, on the same
:func:`~inferfleet.worker.fleet.observe.observe`) every ``interval_s`` and
publishes it over HTTP:

* ``GET /desired``: ``{"desired": N, "reason": ..., "policy": ..., "updated_ms": ...}``, what
  KEDA's ``metrics-api`` scaler reads (``valueLocation: desired``, ``targetValue: "1"``: one pod
  per desired worker);
* ``GET /metrics``: the gauge ``inferfleet_desired_workers`` for Prometheus;
* ``GET /healthz``: 200 while the last decision is recent, 503 otherwise (a liveness probe).

The fleet the policy sees is the count it asked for last (KEDA applies it);
the workers serving are the heartbeats, so pods still warming up are not
asked for twice. While Redis cannot be read the last decision stands.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.errors import ConfigError
from inferfleet.worker.fleet.observe import observe
from inferfleet.worker.fleet.scaling import PolicySettings, PolicyState, desired_workers
from inferfleet.worker.heartbeat import read_heartbeats
from inferfleet.worker.metrics import DESIRED_WORKERS, DESIRED_WORKERS_HELP

__all__ = ["Scaler", "serve_scaler"]

log = logging.getLogger(__name__)


class Scaler:
    """Decides the worker count of one queue (all its shards) each time :meth:`tick` runs."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Sequence[QueueKeys],
        policy: PolicySettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.keys = list(keys)
        self.policy = policy
        self.clock = clock
        self.state = PolicyState()
        self.desired: int | None = None
        self.reason = "not decided yet"
        self.decided_at: float | None = None
        self.lock = threading.Lock()

    def tick(self) -> None:
        """Observe, decide, keep the decision (a Redis error keeps the previous one)."""
        now_s = self.clock()
        try:
            workers = self.desired
            if workers is None:  # first decision: the fleet is what is serving now
                workers = sum(len(read_heartbeats(self.client, k)) for k in self.keys)
            obs = observe(self.client, self.keys, workers, now_s)
        except redis.exceptions.RedisError as exc:
            log.warning("cannot observe the queue (%s): keeping %s workers", exc, self.desired)
            return
        decision = desired_workers(obs, self.policy, self.state)
        with self.lock:
            if decision.workers != obs.workers:
                log.info("desired %d -> %d: %s", obs.workers, decision.workers, decision.reason)
            self.state, self.desired, self.reason = (
                decision.state,
                decision.workers,
                decision.reason,
            )
            self.decided_at = now_s

    def report(self) -> dict[str, Any]:
        """What ``/desired`` answers."""
        with self.lock:
            return {
                "desired": self.desired if self.desired is not None else self.policy.min_workers,
                "reason": self.reason,
                "policy": self.policy.kind,
                "updated_ms": int(time.time() * 1000),
            }

    def fresh(self, interval_s: float) -> bool:
        """Whether the last decision is at most a few intervals old."""
        with self.lock:
            at = self.decided_at
        return at is not None and self.clock() - at <= max(5 * interval_s, 5.0)

    def metrics_text(self, queue: str) -> bytes:
        """The Prometheus exposition of the desired count."""
        desired = self.report()["desired"]
        return (
            f"# HELP {DESIRED_WORKERS} {DESIRED_WORKERS_HELP}\n"
            f"# TYPE {DESIRED_WORKERS} gauge\n"
            f'{DESIRED_WORKERS}{{queue="{queue}"}} {desired}\n'
        ).encode()


def serve_scaler(
    scaler: Scaler, queue: str, address: str, port: int, interval_s: float, stop: threading.Event
) -> None:
    """Serve /desired, /metrics and /healthz while deciding every ``interval_s``, until ``stop``."""
    handler = _handler(scaler, queue, interval_s)
    try:
        server = ThreadingHTTPServer((address, port), handler)
    except OSError as exc:
        raise ConfigError(f"cannot serve on {address} port {port}: {exc.strerror or exc}") from exc
    thread = threading.Thread(target=server.serve_forever, name="scaler-http", daemon=True)
    thread.start()
    log.info("scaler for %s on http://%s:%d/desired", queue, address, server.server_port)
    try:
        while not stop.is_set():
            scaler.tick()
            stop.wait(interval_s)
    finally:
        server.shutdown()
        server.server_close()


def _handler(scaler: Scaler, queue: str, interval_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/desired":
                self._send(200, "application/json", json.dumps(scaler.report()).encode())
            elif path == "/metrics":
                self._send(200, "text/plain; version=0.0.4", scaler.metrics_text(queue))
            elif path == "/healthz":
                ok = scaler.fresh(interval_s)
                self._send(200 if ok else 503, "text/plain", b"ok\n" if ok else b"stale\n")
            else:
                self._send(404, "text/plain", b"not found: /desired, /metrics or /healthz\n")

        def _send(self, status: int, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("scaler http: " + format, *args)

    return Handler
