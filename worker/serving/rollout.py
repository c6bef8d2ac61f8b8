"""The fleet's candidate version in Redis: what ``inferfleet shadow`` publishes and workers read.

The hash ``PREFIX:{NAME}:shadow`` names the candidate (model, version), the
share of batches each worker shadows (``sample``), the share of requests it
answers as a canary (``canary``, percent), the :class:`Thresholds`, a sequence
number that grows with every publish, and a ``state``:

======================  ==========================================================
``shadow``              every worker loads it and runs it after sampled batches
``canary``              it also answers ``canary`` percent of requests
``promoted``            ``--promote`` made it the live version (``inferfleet swap``)
``stopped``             ``--stop`` unloaded it
``rolled_back``         a worker rolled the canary back (``reason`` says why)
======================  ==========================================================

Each worker adds its comparison totals to the hash of its (live, candidate)
pair (:func:`flush_stats`, one script call per housekeeping tick) and gets
the fleet's totals back, on which it decides alerts and canary rollbacks.

Both scripts (``worker/lua/rollout_*.lua``) run by EVALSHA, registered once
a client by :func:`~inferfleet.worker.connections.script` and loaded again
on ``NOSCRIPT``, as the reply script is: the worker's ACL user has
``evalsha`` and ``script|load``, not ``eval`` (docs/security.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.connections import script
from inferfleet.worker.keys import shadow_key, shadow_pair_key, shadow_pairs_key
from inferfleet.worker.serving.comparison import PairStats, Thresholds

__all__ = [
    "ACTIVE",
    "Candidate",
    "end_candidate",
    "flush_stats",
    "publish_candidate",
    "read_candidate",
    "read_pairs",
    "set_canary",
    "shadow_key",
]

#: States in which workers keep the candidate loaded.
ACTIVE = ("shadow", "canary")


def _text(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}


@dataclass(frozen=True)
class Candidate:
    """The published candidate, as read back from the shadow hash."""

    model: str
    version: str
    seq: int
    state: str
    sample: float = 0.1
    canary: float = 0.0  # percent of requests it answers
    thresholds: Thresholds = field(default_factory=Thresholds)
    reason: str = ""
    updated_ms: int = 0

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> Candidate | None:
        """Parse the shadow hash; None if it names no model and version or is corrupt."""
        d = _text(raw)
        if not d.get("model") or not d.get("version"):
            return None
        try:
            return cls(
                d["model"],
                d["version"],
                int(d.get("seq", "0")),
                d.get("state", "stopped"),
                min(max(float(d.get("sample", "0.1")), 0.0), 1.0),
                min(max(float(d.get("canary", "0")), 0.0), 100.0),
                Thresholds.from_fields(d),
                d.get("reason", ""),
                int(d.get("updated_ms", "0")),
            )
        except ValueError:
            return None


def read_candidate(client: redis.Redis, keys: QueueKeys) -> Candidate | None:
    """The published candidate, or None if there never was one."""
    return Candidate.from_hash(client.hgetall(shadow_key(keys)))


def publish_candidate(
    client: redis.Redis,
    keys: QueueKeys,
    model: str,
    version: str,
    sample: float,
    canary: float,
    thresholds: Thresholds,
) -> Candidate:
    """Publish a candidate (replacing any other); its earlier comparisons are cleared."""
    stale = [
        k
        for k in client.smembers(shadow_pairs_key(keys))
        if k.decode(errors="replace").endswith(f">{version}")
    ]
    pipe = client.pipeline(transaction=True)
    if stale:
        pipe.delete(*stale)
        pipe.srem(shadow_pairs_key(keys), *stale)
    pipe.delete(shadow_key(keys))
    pipe.execute()
    fields = {
        "model": model,
        "version": version,
        "sample": repr(float(sample)),
        "canary": repr(float(canary)),
        "state": "canary" if canary > 0 else "shadow",
        "reason": "",
        "updated_ms": str(_now_ms()),
        **thresholds.fields(),
    }
    seq = int(time.time() * 1000)  # grows across publishes, also after the hash was deleted
    client.hset(shadow_key(keys), mapping={**fields, "seq": str(seq)})
    found = read_candidate(client, keys)
    assert found is not None
    return found


def set_canary(client: redis.Redis, keys: QueueKeys, percent: float) -> Candidate | None:
    """Change the active candidate's canary share (0: back to shadow only); None if none is
    active."""
    current = read_candidate(client, keys)
    if current is None or not current.active:
        return None
    client.hset(
        shadow_key(keys),
        mapping={
            "canary": repr(float(percent)),
            "updated_ms": str(_now_ms()),
            "state": "canary" if percent > 0 else "shadow",
        },
    )
    return read_candidate(client, keys)


def end_candidate(
    client: redis.Redis, keys: QueueKeys, state: str, reason: str, seq: int | None = None
) -> bool:
    """Move an active candidate to ``state`` (promoted, stopped, rolled_back); False if none was
    active."""
    ended = script(client, "rollout_end")(
        keys=[shadow_key(keys)],
        args=[state, reason, str(_now_ms()), "" if seq is None else str(seq)],
    )
    return bool(ended)


def flush_stats(
    client: redis.Redis, keys: QueueKeys, live: str, candidate: str, stats: PairStats
) -> PairStats:
    """Add a worker's totals to the fleet's for (live, candidate); return the fleet's."""
    args: list[str] = []
    for name, value in stats.fields().items():
        args += [name, repr(float(value)), "max" if name in PairStats.MAXIMA else "sum"]
    flat = script(client, "rollout_flush")(
        keys=[shadow_pair_key(keys, live, candidate), shadow_pairs_key(keys)], args=args
    )
    return PairStats.from_fields(_text(dict(zip(flat[::2], flat[1::2]))))


def read_pairs(
    client: redis.Redis, keys: QueueKeys, candidate: str | None = None
) -> list[tuple[str, str, PairStats]]:
    """(live, candidate, fleet totals) of every pair compared (of ``candidate`` only, if given)."""
    base = shadow_pair_key(keys, "", "")[:-1]  # PREFIX:{NAME}:shadow:
    found = []
    for raw in sorted(client.smembers(shadow_pairs_key(keys))):
        live, _, cand = raw.decode(errors="replace")[len(base) :].partition(">")
        if candidate is None or cand == candidate:
            found.append((live, cand, PairStats.from_fields(_text(client.hgetall(raw)))))
    return found


def _now_ms() -> int:
    return int(time.time() * 1000)
