"""The worker's own Redis keys: every one is named here (as arq's ``constants.py``).

The wire keys a producer uses (request stream, reply lists, inboxes, the dead
stream) are the contract's and live in :mod:`inferfleet.producer.protocol`.
Everything else the fleet keeps sits under the same ``PREFIX:{NAME}:`` base
(:meth:`QueueKeys.own`), so a queue's keys share one Redis Cluster slot:

============================  ======  =======================================
key                           type    what
============================  ======  =======================================
``PREFIX:{NAME}:hb``          zset    consumer -> last heartbeat (unix ms)
``PREFIX:{NAME}:hb:CONSUMER`` hash    one worker's heartbeat, with a TTL
``PREFIX:{NAME}:model``       hash    the published model (``inferfleet swap``)
``PREFIX:{NAME}:alerts``      stream  result-check and swap alerts
``PREFIX:{NAME}:cache:HEX``   string  a fleet result-cache entry, with a TTL
``PREFIX:{NAME}:supervisor``  hash    a supervisor's last decision, with a TTL
``PREFIX:{NAME}:stage:K``     stream  pipeline stage K's inputs (K >= 1), group ``workers``
``PREFIX:{NAME}:stage:K:...`` (any)   stage K's own heartbeats and supervisor hash
``...:supervisor:lease:HOST`` hash    the lease of the one supervisor of the
                                      queue on HOST (token, pid), with a TTL
``PREFIX:{NAME}:shadow``      hash    the candidate version (``inferfleet shadow``)
``PREFIX:{NAME}:shadow:pairs`` set    the comparison hashes of every (live, candidate) pair
``PREFIX:{NAME}:shadow:L>C``  hash    the fleet's comparison of live L and candidate C
``PREFIX:{NAME}:shadow:alerted`` hash  seq -> 1 once a candidate's divergence was alerted
============================  ======  =======================================

A pipelined model (``inferfleet split``) runs stage 0 on the request stream
and stage K >= 1 on its own stream; :class:`StageKeys` are stage K's keys:
the same queue (reply lists, inboxes, dead letters, the published model and
alerts are the queue's), with its own stream, heartbeats and supervisor hash.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import QueueKeys

__all__ = [
    "HEARTBEAT_INDEX",
    "MAX_STAGES",
    "STAGE_PREFIX",
    "StageKeys",
    "alerts_key",
    "cache_key",
    "heartbeat_index",
    "heartbeat_key",
    "model_key",
    "shadow_alerted_key",
    "shadow_key",
    "shadow_pair_key",
    "shadow_pairs_key",
    "stage_keys",
    "supervisor_key",
    "supervisor_lease_key",
]

#: Pipeline stages one queue may have.
MAX_STAGES = 64
#: A stage stream is ``PREFIX:{NAME}:stage:K``.
STAGE_PREFIX = "stage:"
#: Keys every stage shares with the queue (a swap and the alerts are the whole pipeline's).
_SHARED = frozenset({"model", "alerts"})

#: Suffix of the heartbeat index; each heartbeat hash is ``HEARTBEAT_INDEX:consumer``.
HEARTBEAT_INDEX = "hb"


def heartbeat_index(keys: QueueKeys) -> str:
    """The sorted set of live consumers, scored by their last heartbeat."""
    return keys.own(HEARTBEAT_INDEX)


def heartbeat_key(keys: QueueKeys, consumer: str) -> str:
    """The hash one worker's heartbeat publishes."""
    return keys.own(f"{HEARTBEAT_INDEX}:{consumer}")


def model_key(keys: QueueKeys) -> str:
    """The hash of the published model: what ``inferfleet swap`` asks every worker to serve."""
    return keys.own("model")


def alerts_key(keys: QueueKeys) -> str:
    """The stream of alerts (result checks, failed swaps)."""
    return keys.own("alerts")


def cache_key(keys: QueueKeys, digest: bytes) -> str:
    """One entry of the fleet tier of the result cache."""
    return keys.own("cache:" + digest.hex())


def supervisor_key(keys: QueueKeys) -> str:
    """The hash where a supervisor publishes its latest scaling decision."""
    return keys.own("supervisor")


@dataclass(frozen=True)
class StageKeys(QueueKeys):
    """The keys of pipeline stage ``stage`` (>= 1) of a queue: its own stream and heartbeats.

    ``requests`` is the stage's stream ``PREFIX:{NAME}:stage:K`` (so a consumer,
    its recovery and its supervisor work on it unchanged); the reply keys,
    inboxes and dead letters are the queue's; :meth:`own` keys are the
    stage's, but for the published model and the alerts, which are the queue's.
    """

    stage: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.stage < MAX_STAGES:
            raise ProtocolError(f"stage must be from 1 to {MAX_STAGES - 1}, got {self.stage!r}")
        object.__setattr__(self, "requests", f"{self.base}{STAGE_PREFIX}{self.stage}")

    def own(self, what: str) -> str:
        """A stage's own key (``PREFIX:{NAME}:stage:K:what``); the model and alerts keys are the
        queue's."""
        return super().own(what) if what in _SHARED else f"{self.requests}:{what}"


def stage_keys(keys: QueueKeys, stage: int) -> QueueKeys:
    """The keys stage ``stage`` of the queue ``keys`` works on: the queue's own for stage 0."""
    return keys if stage == 0 else StageKeys(keys.name, keys.prefix, stage=stage)


def supervisor_lease_key(keys: QueueKeys, host: str) -> str:
    """The lease one supervisor of the queue on ``host`` holds
    (:mod:`inferfleet.worker.fleet.succession`)."""
    return keys.own(f"supervisor:lease:{host}")


def shadow_key(keys: QueueKeys) -> str:
    """The hash naming the candidate version, its sample, canary share, thresholds and state."""
    return keys.own("shadow")


def shadow_pairs_key(keys: QueueKeys) -> str:
    """The set of the comparison hashes written so far (one per (live, candidate) pair)."""
    return keys.own("shadow:pairs")


def shadow_pair_key(keys: QueueKeys, live: str, candidate: str) -> str:
    """The fleet's totals comparing ``candidate`` with ``live`` (versions never hold ``>``)."""
    return keys.own(f"shadow:{live}>{candidate}")


def shadow_alerted_key(keys: QueueKeys) -> str:
    """Which candidates' divergence was alerted (by publish sequence number): one alert per
    candidate."""
    return keys.own("shadow:alerted")
