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
``PREFIX:{NAME}:shadow``      hash    the candidate version (``inferfleet shadow``)
``PREFIX:{NAME}:shadow:pairs`` set    the comparison hashes of every (live, candidate) pair
``PREFIX:{NAME}:shadow:L>C``  hash    the fleet's comparison of live L and candidate C
``PREFIX:{NAME}:shadow:alerted`` hash  seq -> 1 once a candidate's divergence was alerted
============================  ======  =======================================
"""

from __future__ import annotations

from inferfleet.producer.protocol import QueueKeys

__all__ = ["HEARTBEAT_INDEX", "alerts_key", "cache_key", "heartbeat_index", "heartbeat_key", "model_key",
           "shadow_alerted_key", "shadow_key", "shadow_pair_key", "shadow_pairs_key", "supervisor_key"]

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
    """Which candidates' divergence was alerted (by publish sequence number): one alert per candidate."""
    return keys.own("shadow:alerted")
