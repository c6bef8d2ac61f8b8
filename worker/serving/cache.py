"""The result cache: identical inputs answered without recomputing.

Three tiers, cheapest first:

* **batch**: duplicates inside one round are computed once (:func:`split_duplicates`);
* **local**: a bounded per-worker LFU cache (cachetools' O(1) ``LFUCache``);
* **fleet** (optional): ``PREFIX:{NAME}:cache:DIGEST`` string keys with a TTL,
  shared by every worker of the queue, read with one MGET per round and
  written with one pipeline per round.

A cache key is :func:`input_digest`: a hash of the canonical input bytes
(form, names, dtypes, shapes and data), the params and the model version, so a
hot swap never serves the old model's answers. The digest, the LFU and the
duplicate split are pure; only :class:`ResultCache`'s fleet tier talks to Redis.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
from cachetools import LFUCache

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import QueueKeys, decode_outputs, encode_outputs
from inferfleet.worker.keys import cache_key

__all__ = ["CacheStats", "ResultCache", "copy_outputs", "input_digest", "split_duplicates"]

log = logging.getLogger(__name__)


def _update_tensor(h: Any, arr: np.ndarray) -> None:
    h.update(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(np.ascontiguousarray(arr).data)


def input_digest(inputs: Any, params: dict, version: str) -> bytes:
    """16-byte BLAKE2b of the canonical inputs, params and model version.

    Canonical: the same tensors give the same digest whatever the msgpack
    encoding (map order, bin vs str) of the request that carried them.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(version.encode())
    if isinstance(inputs, np.ndarray):
        h.update(b"T")
        _update_tensor(h, inputs)
    elif isinstance(inputs, dict):
        h.update(b"M")
        for key in sorted(inputs):
            h.update(key.encode() + b"\0")
            _update_tensor(h, inputs[key])
    elif isinstance(inputs, (str, bytes)):  # a raw input (protocol 1.2)
        h.update(b"S" if isinstance(inputs, str) else b"B")
        h.update(inputs.encode() if isinstance(inputs, str) else inputs)
    else:
        h.update(b"L")
        for arr in inputs:
            _update_tensor(h, arr)
    if params:
        h.update(json.dumps(params, sort_keys=True, default=repr).encode())
    return h.digest()


def copy_outputs(outputs: Any) -> Any:
    """Own copies of one request's outputs (they are views into the batch's arrays,
    which a cache entry must not keep alive)."""
    if isinstance(outputs, np.ndarray):
        return outputs.copy()
    if isinstance(outputs, (str, bytes)):
        return outputs  # immutable
    if isinstance(outputs, dict):
        return {k: copy_outputs(v) for k, v in outputs.items()}
    return [copy_outputs(v) for v in outputs]


def split_duplicates(digests: Sequence[bytes]) -> tuple[list[int], list[tuple[int, int]]]:
    """Indexes to compute, and (duplicate, first occurrence) pairs answered from it."""
    first: dict[bytes, int] = {}
    unique: list[int] = []
    dupes: list[tuple[int, int]] = []
    for i, digest in enumerate(digests):
        j = first.setdefault(digest, i)
        if j == i:
            unique.append(i)
        else:
            dupes.append((i, j))
    return unique, dupes


@dataclass
class CacheStats:
    """Hits and misses per tier since start (for status and metrics)."""

    local_hits: int = 0
    fleet_hits: int = 0
    batch_hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits of any tier over lookups, 0 before the first."""
        hits = self.local_hits + self.fleet_hits + self.batch_hits
        total = hits + self.misses
        return hits / total if total else 0.0


class ResultCache:
    """The local LFU tier and the optional fleet tier of one worker."""

    def __init__(
        self, size: int, keys: QueueKeys, client: redis.Redis | None = None, fleet_ttl_s: int = 0
    ) -> None:
        self.local: LFUCache = LFUCache(maxsize=size)
        self.keys = keys
        self.client = client if fleet_ttl_s > 0 else None
        self.fleet_ttl_s = fleet_ttl_s
        self.stats = CacheStats()

    def fleet_key(self, digest: bytes) -> str:
        """The fleet tier's key for ``digest`` (:func:`inferfleet.worker.keys.cache_key`)."""
        return cache_key(self.keys, digest)

    def clear(self) -> None:
        """Forget the local tier (after a model swap: the digests change anyway,
        but LFU would keep the old model's hot entries for a long time)."""
        self.local.clear()

    def lookup(self, digests: Sequence[bytes]) -> list[tuple[Any, str] | None]:
        """(outputs, tier) per digest, or None for a miss. One MGET for the fleet tier."""
        found: list[tuple[Any, str] | None] = [None] * len(digests)
        remote: list[int] = []
        for i, digest in enumerate(digests):
            value = self.local.get(digest)
            if value is not None:
                found[i] = (value, "local")
                self.stats.local_hits += 1
            else:
                remote.append(i)
        if remote and self.client is not None:
            for i, raw in zip(
                remote, self.client.mget([self.fleet_key(digests[i]) for i in remote])
            ):
                value = self._decode(raw)
                if value is not None:
                    found[i] = (value, "fleet")
                    self.local[digests[i]] = value
                    self.stats.fleet_hits += 1
        self.stats.misses += sum(1 for f in found if f is None)
        return found

    def _decode(self, raw: bytes | None) -> Any:
        if raw is None:
            return None
        try:
            return decode_outputs(raw)
        except ProtocolError as exc:  # someone else wrote the key: ignore it, recompute
            log.warning("ignoring an unreadable fleet cache entry: %s", exc)
            return None

    def store(self, entries: Sequence[tuple[bytes, Any]]) -> None:
        """Remember freshly computed outputs (already own copies) in both tiers."""
        for digest, outputs in entries:
            self.local[digest] = outputs
        if self.client is None or not entries:
            return
        pipe = self.client.pipeline(transaction=False)
        for digest, outputs in entries:
            pipe.set(self.fleet_key(digest), encode_outputs(outputs), ex=self.fleet_ttl_s)
        try:
            pipe.execute()
        except (
            redis.exceptions.OutOfMemoryError
        ) as exc:  # Redis full: the cache is optional, replies are not
            log.warning("fleet cache entries dropped: %s", exc)
