"""Model hot swap: the fleet's published model version, and each worker's watcher.

``inferfleet swap`` writes the queue's current model and version to the hash
``PREFIX:{NAME}:model`` (with the one before it, for ``--rollback``, and a
sequence number that only grows). Every worker polls that hash between
batches. When it names another version, the worker loads and warms the new
copy in a background thread while it keeps serving the old one, then:

1. checks the published version again (the article's double-checked version
   number): if it moved on while loading (a newer swap, a rollback), the new
   copy is stale and is dropped, and the current one is loaded instead;
2. otherwise switches between two rounds, so every batch in flight finishes on
   the copy it started on, and each reply names the version that computed it.

A load that fails keeps the old model; the worker reports why in its
heartbeat (``swap_error``), in the alerts stream and in its metrics.

The hash also remembers which published versions the fleet actually
*served* (``served_*``: the last one a worker switched to or started on,
``served_before_*``: the one served before it; :func:`mark_served`).
``--rollback`` returns to the last version served other than the current
one, so a broken version that never served (published with ``--no-check``)
is never a rollback target: after v2 (served), v3 (broken), a rollback
publishes v2, not v3.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import lua_source, script
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.keys import model_key

__all__ = [
    "ModelWatcher",
    "NoPreviousVersion",
    "Published",
    "mark_served",
    "model_key",
    "publish",
    "read_published",
    "rollback",
]

log = logging.getLogger(__name__)


class NoPreviousVersion(Exception):
    """``rollback`` with nothing to roll back to."""


@dataclass(frozen=True)
class Published:
    """The fleet's current model as ``inferfleet swap`` last published it."""

    model: str
    version: str
    seq: int
    previous_model: str = ""
    previous_version: str = ""
    updated_ms: int = 0
    served_version: str = ""  # the last published version a worker served (the rollback target)

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> Published | None:
        """Parse the model hash; None if it names no model and version."""
        d = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}
        if not d.get("model") or not d.get("version"):
            return None
        try:
            seq, updated = int(d.get("seq", "0")), int(d.get("updated_ms", "0"))
        except ValueError:
            return None
        return cls(
            d["model"],
            d["version"],
            seq,
            d.get("previous_model", ""),
            d.get("previous_version", ""),
            updated,
            d.get("served_version", ""),
        )


def read_published(client: redis.Redis, keys: QueueKeys) -> Published | None:
    """The published model, or None if nothing was ever published (or it is corrupt)."""
    return Published.from_hash(client.hgetall(model_key(keys)))


def _run(client: redis.Redis, keys: QueueKeys, *args: str) -> Published:
    try:
        client.eval(lua_source("publish"), 1, model_key(keys), *args)
    except redis.exceptions.ResponseError as exc:
        if "NOPREVIOUS" in str(exc):
            raise NoPreviousVersion("no earlier version was published for this queue") from exc
        raise
    published = read_published(client, keys)
    assert published is not None
    return published


def publish(
    client: redis.Redis,
    keys: QueueKeys,
    model: str,
    version: str,
    serving: tuple[str, str] = ("", ""),
) -> Published:
    """Make (model, version) the fleet's current one. ``serving`` is the pair the live
    workers run, recorded as the previous one on a first publish (for rollback)."""
    return _run(client, keys, "publish", model, version, str(int(time.time() * 1000)), *serving)


def rollback(client: redis.Redis, keys: QueueKeys) -> Published:
    """Make the last version the fleet served (other than the current one) current again."""
    return _run(client, keys, "rollback", "", "", str(int(time.time() * 1000)), "", "")


def mark_served(client: redis.Redis, keys: QueueKeys, published: Published) -> bool:
    """Record that a worker serves ``published`` (if it is still the published version)."""
    return bool(
        script(client, "served")(keys=[model_key(keys)], args=[published.model, published.version])
    )


Loader = Callable[[WorkerSettings], object]


class ModelWatcher:
    """One worker's side of a swap: notice, load in the background, hand over when current."""

    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        settings: WorkerSettings,
        load: Loader,
        seen_seq: int = 0,
    ) -> None:
        self.client = client
        self.keys = keys
        self.settings = settings
        self.load = load
        self.seen_seq = seen_seq  # the highest sequence number acted on
        self.error = ""  # why the last load failed, for the heartbeat
        self._loading: Published | None = None
        self._done: tuple[Published, object] | None = None
        self._lock = threading.Lock()

    def poll(self, serving_version: str) -> Published | None:
        """First check: start loading a newly published version. Returns what it started."""
        if self._loading is not None:
            return None
        published = read_published(self.client, self.keys)
        if published is None or published.seq <= self.seen_seq:
            return None
        self.seen_seq = published.seq
        if published.version == serving_version:
            return None
        self._loading = published
        log.info(
            "model %s version %s published (seq %d): loading it in the background",
            self.keys.name,
            published.version,
            published.seq,
        )
        threading.Thread(
            target=self._load, args=(published,), name=f"swap-{published.version}", daemon=True
        ).start()
        return published

    def _load(self, published: Published) -> None:
        settings = replace(self.settings, model=published.model, model_version=published.version)
        try:
            outcome: object = self.load(settings)
        except ModelLoadError as exc:
            outcome = exc
        except Exception as exc:  # noqa: BLE001 - any load failure keeps the old model
            outcome = ModelLoadError(f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._done = (published, outcome)

    def take(self) -> tuple[str, Published, object]:
        """Second check, between rounds: ("none"|"failed"|"stale"|"ok", published,
        runtime-or-error)."""
        with self._lock:
            done, self._done = self._done, None
        if done is None:
            return "none", Published("", "", 0), None
        self._loading = None
        published, outcome = done
        if isinstance(outcome, Exception):
            self.error = f"version {published.version}: {outcome}"
            log.error(
                "model %s: loading version %s failed, still serving the old one: %s",
                self.keys.name,
                published.version,
                outcome,
            )
            return "failed", published, outcome
        current = read_published(self.client, self.keys)
        if current is None or current.version != published.version:
            log.info(
                "model %s: version %s is no longer current (now %s): dropped",
                self.keys.name,
                published.version,
                current.version if current else "none",
            )
            self.seen_seq = min(self.seen_seq, (current.seq - 1) if current else self.seen_seq)
            return "stale", published, outcome
        self.error = ""
        try:
            mark_served(self.client, self.keys, published)
        except (
            redis.exceptions.RedisError
        ) as exc:  # the switch goes ahead; only the rollback target is late
            log.warning(
                "model %s: cannot record version %s as served: %s",
                self.keys.name,
                published.version,
                exc,
            )
        return "ok", published, outcome
