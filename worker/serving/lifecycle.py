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

#: KEYS = [model hash]; ARGV = [mode, model, version, now_ms, fallback_model, fallback_version].
#: publish: the current pair becomes the previous one (or the fallback, the pair
#: live workers serve, on the first publish, which also counts as served);
#: rollback: the last served pair other than the current one becomes current.
#: Either way the sequence number grows. Returns the new seq, or an error reply NOPREVIOUS.
PUBLISH_SCRIPT = """
local key, mode = KEYS[1], ARGV[1]
local h = {}
local raw = redis.call('HGETALL', key)
for i = 1, #raw, 2 do h[raw[i]] = raw[i + 1] end
local cur_model, cur_version = h['model'], h['version']
if mode == 'rollback' then
  local to_model, to_version = h['served_model'], h['served_version']
  if not to_version or to_version == '' or to_version == cur_version then
    to_model, to_version = h['served_before_model'], h['served_before_version']
  end
  if not to_version or to_version == '' or to_version == cur_version then
    return redis.error_reply('NOPREVIOUS no earlier version the fleet served to roll back to')
  end
  redis.call('HSET', key, 'model', to_model, 'version', to_version,
             'previous_model', cur_model, 'previous_version', cur_version, 'updated_ms', ARGV[4])
else
  if not cur_model then
    cur_model, cur_version = ARGV[5], ARGV[6]
    if not h['served_version'] and ARGV[6] ~= '' then
      redis.call('HSET', key, 'served_model', ARGV[5], 'served_version', ARGV[6])
    end
  end
  redis.call('HSET', key, 'model', ARGV[2], 'version', ARGV[3],
             'previous_model', cur_model, 'previous_version', cur_version, 'updated_ms', ARGV[4])
end
return redis.call('HINCRBY', key, 'seq', 1)
"""

#: KEYS = [model hash]; ARGV = [model, version]. If (model, version) is the published pair and not
#: already the last served one, it becomes the last served (the one before moves to served_before).
#: HGETALL and HSET only: commands the ``worker`` ACL user has. Returns 1 if it changed anything.
SERVED_SCRIPT = """
local h = {}
local raw = redis.call('HGETALL', KEYS[1])
for i = 1, #raw, 2 do h[raw[i]] = raw[i + 1] end
if h['model'] ~= ARGV[1] or h['version'] ~= ARGV[2] or h['served_version'] == ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'served_before_model', h['served_model'] or '',
           'served_before_version', h['served_version'] or '', 'served_model', ARGV[1], 'served_version', ARGV[2])
return 1
"""


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
        client.eval(PUBLISH_SCRIPT, 1, model_key(keys), *args)
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
        client.register_script(SERVED_SCRIPT)(
            keys=[model_key(keys)], args=[published.model, published.version]
        )
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
        """Second check, between rounds: ("none"|"failed"|"stale"|"ok", published, runtime-or-error)."""
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
