"""Worker heartbeats: who is serving a queue, where, and how fast.

Each worker publishes, every ``interval_s`` from a thread of its own (so a
long batch never silences it), a hash ``PREFIX:{NAME}:hb:CONSUMER`` with a
TTL of a few intervals, and its last-seen time in the sorted set
``PREFIX:{NAME}:hb``. A worker whose hash expired is gone.

Fields (all strings, as Redis stores them): ``consumer pid host device
version state requests batches rows rate_rps busy started_ms last_seen_ms``.
``rate_rps`` is requests per second over the last interval; ``busy`` is the
fraction of that interval spent computing and replying (not waiting), so
``rate_rps / busy`` estimates what the worker could do flat out. ``rss_mb``
is the process's resident memory (the soak benchmark plots it). ``shadow`` is
the candidate version of ``inferfleet shadow`` as this worker has it
(``VERSION loaded``, ``loading``, ``failed`` or ``off``; empty without one) and
``shadow_error`` why it failed to load or was stopped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.keys import HEARTBEAT_INDEX, heartbeat_index, heartbeat_key

if TYPE_CHECKING:  # only annotations: the heartbeat readers (supervisor, status) need no metrics
    from inferfleet.worker.counters import Counters, Tally

__all__ = ["Heartbeat", "HeartbeatInfo", "read_heartbeats", "heartbeat_key", "HEARTBEAT_INDEX"]

log = logging.getLogger(__name__)


def rss_mb() -> float:
    """This process's resident set size in MiB (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), None where that cannot be read.

    Read when the first heartbeat is built, after the model loaded and warmed up, it is the
    worker's warm-up time as the scaling policy sees it: interpreter start, imports, load, warm-up.
    """
    try:
        with open("/proc/self/stat") as fh:
            started_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime_s = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"))


def _optional(text: str | None) -> float | None:
    """A non-negative finite number, or None when absent or corrupt."""
    try:
        value = float(text) if text else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _int(text: str | None) -> int:
    try:
        return max(0, int(text or 0))
    except ValueError:
        return 0


def _rate(text: str | None) -> float:
    try:
        value = float(text or 0.0)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


@dataclass
class HeartbeatInfo:
    """One worker's last heartbeat, as read back by the supervisor and ``status``."""

    consumer: str
    pid: int
    host: str
    device: str
    version: str
    state: str
    requests: int
    batches: int
    rows: int
    rate_rps: float
    busy: float
    started_ms: int
    last_seen_ms: int
    rss_mb: float = 0.0
    swap_error: str = ""
    cache_hit_rate: float | None = None  # None: this worker has no result cache
    # the candidate as this worker has it: "VERSION loaded" (loading, failed, off); "" for none
    shadow: str = ""
    shadow_error: str = ""  # why its candidate failed to load or was stopped
    warm_s: float | None = None  # process start to first heartbeat: load and warm-up
    batch_ms: float | None = None  # one batch's time over the last interval (None: no batch)
    batch_rows: float | None = None  # rows a batch over the last interval (None: no batch)
    max_rows: int | None = None  # the most rows a batch may have

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> HeartbeatInfo:
        """Parse a heartbeat hash; a corrupt number reads as 0, never raises."""
        d = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}
        return cls(
            d.get("consumer", "?"),
            _int(d.get("pid")),
            d.get("host", "?"),
            d.get("device", "?"),
            d.get("version", "?"),
            d.get("state", "?"),
            _int(d.get("requests")),
            _int(d.get("batches")),
            _int(d.get("rows")),
            _rate(d.get("rate_rps")),
            min(_rate(d.get("busy")), 1.0),
            _int(d.get("started_ms")),
            _int(d.get("last_seen_ms")),
            _rate(d.get("rss_mb")),
            d.get("swap_error", ""),
            _rate(d["cache_hit_rate"]) if "cache_hit_rate" in d else None,
            d.get("shadow", ""),
            d.get("shadow_error", ""),
            _optional(d.get("warm_s")),
            _optional(d.get("batch_ms")),
            _optional(d.get("batch_rows")),
            int(rows) if (rows := _optional(d.get("max_rows"))) else None,
        )

    @property
    def capacity_rps(self) -> float | None:
        """Requests per second this worker could serve flat out, if measurable."""
        return self.rate_rps / self.busy if self.busy >= 0.05 and self.rate_rps > 0 else None


class Heartbeat:
    """Publishes one worker's heartbeat from a daemon thread until stopped."""

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        consumer: str,
        counters: Counters,
        fields: dict[str, Any],
        interval_s: float = 1.0,
        extra: Callable[[], dict[str, Any]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        file: str | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.counters = counters
        self.interval_s = interval_s
        self.ttl_ms = int(max(3 * interval_s, 2.0) * 1000)
        self.state = "starting"
        #: Called on every beat for fields that change (model version, swap error, cache use).
        self.extra = extra
        self.clock = clock
        self.file = file  # each beat is written here too, Redis or not (a liveness probe reads it)
        self._last = (clock(), counters.snapshot())  # the rates of the next beat are since then
        self.batch_ms: float | None = None  # the last sample's time per batch
        self.batch_rows: float | None = None  # and rows per batch
        self._fields = {
            "consumer": consumer,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_ms": int(time.time() * 1000),
            **({"warm_s": round(age, 2)} if (age := process_age_s()) is not None else {}),
            **fields,
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, name=f"heartbeat-{consumer}", daemon=True
        )

    def start(self) -> Heartbeat:
        """Publish once now (so the worker is alive before its first read), then every interval."""
        try:
            self.beat()
        except redis.exceptions.RedisError as exc:
            log.warning("first heartbeat of %s failed: %s", self.consumer, exc)
        self._thread.start()
        return self

    def beat(self) -> None:
        """Publish once now (also called by the thread)."""
        totals, rate, busy = self.sample()
        now_ms = int(time.time() * 1000)
        key = heartbeat_key(self.keys, self.consumer)
        changing = self.extra() if self.extra is not None else {}
        mapping = {
            **self._fields,
            **changing,
            "state": self.state,
            "rss_mb": round(rss_mb(), 1),
            "requests": totals.requests,
            "batches": totals.batches,
            "rows": totals.rows,
            "rate_rps": round(rate, 2),
            "busy": round(busy, 4),
            "batch_ms": round(self.batch_ms, 2) if self.batch_ms is not None else "",
            "batch_rows": round(self.batch_rows, 2) if self.batch_rows is not None else "",
            "last_seen_ms": now_ms,
        }
        if self.file:
            _write_file(self.file, mapping)
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(key, mapping=mapping)
        pipe.pexpire(key, self.ttl_ms)
        pipe.zadd(heartbeat_index(self.keys), {self.consumer: now_ms})
        pipe.execute()

    def sample(self) -> tuple[Tally, float, float]:
        """(the totals, requests per second, busy fraction) since the previous sample."""
        now, totals = self.clock(), self.counters.snapshot()
        then, before = self._last
        self._last = (now, totals)
        span = max(now - then, 1e-6)
        batches = totals.batches - before.batches
        self.batch_ms = (totals.busy_s - before.busy_s) / batches * 1000 if batches > 0 else None
        self.batch_rows = (totals.rows - before.rows) / batches if batches > 0 else None
        return (
            totals,
            (totals.requests - before.requests) / span,
            min(1.0, (totals.busy_s - before.busy_s) / span),
        )

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except redis.exceptions.RedisError as exc:  # keep beating once Redis is back
                log.warning("heartbeat of %s failed: %s", self.consumer, exc)
                if isinstance(
                    exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
                ):
                    self._find_nodes_again()

    def _find_nodes_again(self) -> None:
        """On a Redis Cluster, read the slots' masters again: after a master died, the
        transaction pipeline a beat uses keeps going to it (redis-py refreshes only every few
        errors, and its retries are off here), while its replica already serves the slot."""
        nodes = getattr(self.client, "nodes_manager", None)
        if nodes is None:
            return
        try:
            nodes.initialize()
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            log.debug("cluster topology not read again yet: %s", exc)

    def stop(self, remove: bool = True) -> None:
        """Stop beating; with ``remove`` delete the heartbeat (a clean exit)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval_s + 1)
        if remove:
            try:
                pipe = self.client.pipeline(transaction=True)
                pipe.delete(heartbeat_key(self.keys, self.consumer))
                pipe.zrem(heartbeat_index(self.keys), self.consumer)
                pipe.execute()
            except redis.exceptions.RedisError as exc:
                log.warning("could not remove the heartbeat of %s: %s", self.consumer, exc)


def _write_file(path: str, mapping: dict[str, Any]) -> None:
    """Replace ``path`` with the beat as JSON (write and rename: a reader never sees half of it)."""
    record = {k: mapping.get(k) for k in ("consumer", "pid", "state", "last_seen_ms", "loop_ms")}
    try:
        with open(f"{path}.tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(f"{path}.tmp", path)
    except OSError as exc:
        log.warning("cannot write the heartbeat file %s: %s", path, exc)


def read_heartbeats(client: redis.Redis, keys: QueueKeys) -> list[HeartbeatInfo]:
    """Every live worker's heartbeat; forgets index entries whose hash expired."""
    index = heartbeat_index(keys)
    names = [n.decode() for n in client.zrange(index, 0, -1)]
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(heartbeat_key(keys, name))
    infos, gone = [], []
    for name, raw in zip(names, pipe.execute()):
        if raw:
            infos.append(HeartbeatInfo.from_hash(raw))
        else:
            gone.append(name)
    if gone:
        client.zrem(index, *gone)
    return infos
