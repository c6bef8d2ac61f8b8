"""The result cache's pure parts: canonical digests, LFU eviction, duplicate split; one round's use
of it."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from inferfleet.producer.protocol import QueueKeys, decode_body, encode_body
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.metrics import WorkerMetrics
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.cache import (
    ResultCache,
    copy_outputs,
    input_digest,
    split_duplicates,
)
from inferfleet.worker.serving.quality import CacheRound, ResultPolicy


def test_digest_is_canonical_across_encodings():
    x = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((2, 1), dtype=np.int64)}
    reordered = {"b": x["b"].copy(), "a": x["a"].copy()}
    # round-trip through the wire format: new arrays, another map order
    decoded, params = decode_body(encode_body(reordered, {"k": 1, "j": [1, 2]}))
    assert input_digest(x, {"j": [1, 2], "k": 1}, "v1") == input_digest(decoded, params, "v1")


def test_digest_separates_what_changes_the_answer():
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    base = input_digest(x, {}, "v1")
    variants = [
        input_digest(x, {}, "v2"),  # another model version
        input_digest(x, {"factor": 3}, "v1"),  # other params
        input_digest(x.astype(np.float64), {}, "v1"),  # same values, other dtype
        input_digest(x.reshape(4, 2), {}, "v1"),  # same bytes, other shape
        input_digest([x], {}, "v1"),  # positional list instead of one tensor
        input_digest({"x": x}, {}, "v1"),  # keyword instead of positional
        input_digest(x + 1, {}, "v1"),  # other data
    ]
    assert len({base, *variants}) == len(variants) + 1


@given(st.lists(st.integers(0, 5), max_size=30))
def test_split_duplicates_computes_each_digest_once(values):
    digests = [bytes([v]) for v in values]
    unique, dupes = split_duplicates(digests)
    assert sorted(unique + [d for d, _ in dupes]) == list(range(len(values)))
    assert len({digests[i] for i in unique}) == len(unique) == len(set(values))
    for dup, first in dupes:
        assert digests[dup] == digests[first] and first in unique and first < dup


def test_lfu_evicts_the_least_frequently_used():
    cache = ResultCache(2, QueueKeys("q"))
    cache.store([(b"hot", np.ones(1)), (b"warm", np.zeros(1))])
    for _ in range(3):
        cache.lookup([b"hot"])
    cache.store([(b"new", np.full(1, 2.0))])  # evicts warm: used once, less than hot
    found = cache.lookup([b"hot", b"warm", b"new"])
    assert [f is not None for f in found] == [True, False, True]
    assert cache.stats.local_hits == 5 and cache.stats.misses == 1


def test_copies_do_not_keep_the_batch_alive():
    batch = np.arange(12.0).reshape(6, 2)
    part = batch[2:4]
    owned = copy_outputs({"y": part})["y"]
    assert owned.base is None and np.array_equal(owned, part)


def test_fleet_tier_shares_results_between_workers(redis_client):
    keys = QueueKeys("q")
    one = ResultCache(8, keys, redis_client, fleet_ttl_s=60)
    two = ResultCache(8, keys, redis_client, fleet_ttl_s=60)
    outputs = [np.arange(4, dtype=np.float32).reshape(1, 4), np.ones((1, 1), dtype=np.int64)]
    one.store([(b"d1", outputs)])
    (hit,) = two.lookup([b"d1"])
    assert hit is not None and hit[1] == "fleet"
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(hit[0], outputs))
    assert 55 <= redis_client.ttl(one.fleet_key(b"d1")) <= 60
    assert two.lookup([b"d1"])[0][1] == "local"  # promoted to the local tier on the fleet hit


def test_fleet_tier_ignores_garbage(redis_client):
    keys = QueueKeys("q")
    cache = ResultCache(8, keys, redis_client, fleet_ttl_s=60)
    redis_client.set(cache.fleet_key(b"d1"), b"\xc1not msgpack")
    assert cache.lookup([b"d1"]) == [None]
    assert cache.stats.misses == 1


def test_a_full_redis_drops_fleet_entries_without_failing(redis_client):
    cache = ResultCache(8, QueueKeys("q"), redis_client, fleet_ttl_s=60)
    redis_client.config_set("maxmemory", "1")  # noeviction by default: every write is refused
    try:
        cache.store([(b"d1", np.ones((1, 2)))])
    finally:
        redis_client.config_set("maxmemory", "0")
    assert cache.lookup([b"d1"])[0][1] == "local"  # still cached locally
    assert redis_client.exists(cache.fleet_key(b"d1")) == 0


def _request(i: int, value: float) -> Request:
    return Request(f"{i}-0".encode(), f"r{i}", "k", np.full((1, 4), value, np.float32), {}, 1, None)


def test_a_cache_round_answers_hits_and_computes_each_duplicate_once():
    registry = CollectorRegistry()
    results = ResultPolicy(
        WorkerSettings(name="q", model="m.pt", cache_size=8), QueueKeys("q"), None
    )
    round_ = CacheRound(results, Counters(WorkerMetrics("q", registry)))
    todo, hits = round_.start([_request(0, 1.0), _request(1, 2.0), _request(2, 1.0)], "v1")
    assert [r.rid for r in todo] == ["r0", "r1"] and hits == []  # r2 repeats r0
    computed = [
        results.review(r, np.full((1, 2), 10.0 * (i + 1)), "v1", False) for i, r in enumerate(todo)
    ]
    round_.remember(todo, computed, 1.5, 2)
    ((dup, result, infer_ms, rows),) = round_.finish()
    assert dup.rid == "r2" and result is computed[0] and (infer_ms, rows) == (1.5, 2)
    results.flush()  # into the local tier
    todo, hits = round_.start([_request(3, 2.0), _request(4, 3.0)], "v1")
    assert [r.rid for r in todo] == ["r4"] and [(r.rid, out[0, 0]) for r, out in hits] == [
        ("r3", 20.0)
    ]
    assert round_.finish() == []  # no duplicates this round, none left from the last
    todo, hits = round_.start([_request(5, 2.0)], "v2")  # another model version: no hit
    assert [r.rid for r in todo] == ["r5"] and hits == []
    sample = registry.get_sample_value
    assert sample("inferfleet_cache_hits_total", {"queue": "q", "tier": "batch"}) == 1
    assert sample("inferfleet_cache_hits_total", {"queue": "q", "tier": "local"}) == 1
    assert sample("inferfleet_cache_misses_total", {"queue": "q", "tier": "local"}) == 5
    assert (
        sample("inferfleet_cache_hits_total", {"queue": "q", "tier": "fleet"}) is None
    )  # no fleet tier


def test_a_round_without_the_cache_computes_everything():
    results = ResultPolicy(WorkerSettings(name="q", model="m.pt"), QueueKeys("q"), None)
    round_ = CacheRound(results, Counters())
    requests = [_request(0, 1.0), _request(1, 1.0)]
    todo, hits = round_.start(requests, "v1")
    assert todo is requests and hits == [] and "digest" not in requests[0].extra
    assert round_.finish() == []
