"""The supervisor lease, the pruning of dead consumers and the choice of a predecessor's workers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.worker.fleet.succession import (
    LeaseHeld,
    SupervisorLease,
    is_slot_of,
    predecessor_workers,
    prune_consumers,
    slot_consumer,
)
from inferfleet.worker.heartbeat import HeartbeatInfo
from inferfleet.worker.keys import supervisor_lease_key

KEYS = QueueKeys("q")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_one_live_supervisor_per_queue_and_host(redis_client):
    first = SupervisorLease(redis_client, KEYS, "aaaaaa", ttl_s=5, host="h1")
    first.acquire()
    with pytest.raises(LeaseHeld, match=f"pid {os.getpid()}.*queue q on host h1"):
        SupervisorLease(redis_client, KEYS, "bbbbbb", ttl_s=5, host="h1").acquire()
    SupervisorLease(
        redis_client, KEYS, "cccccc", ttl_s=5, host="h2"
    ).acquire()  # another host: its own lease
    assert first.renew()
    assert 0 < redis_client.pttl(supervisor_lease_key(KEYS, "h1")) <= 5000
    first.release()
    assert not redis_client.exists(supervisor_lease_key(KEYS, "h1"))


def test_a_dead_holders_lease_is_taken_over_at_once(redis_client, caplog):
    caplog.set_level(logging.WARNING, logger="inferfleet.worker.fleet.succession")
    key = supervisor_lease_key(KEYS, "h1")
    redis_client.hset(key, mapping={"token": "dead00", "pid": dead_pid(), "host": "h1"})
    redis_client.pexpire(key, 60_000)
    lease = SupervisorLease(redis_client, KEYS, "e0e000", ttl_s=5, host="h1")
    lease.acquire()
    assert redis_client.hget(key, "token") == b"e0e000"
    assert any("is gone: taking over its lease" in r.getMessage() for r in caplog.records)
    stale = SupervisorLease(redis_client, KEYS, "dead00", ttl_s=5, host="h1")
    assert not stale.renew()  # the old holder, were it only hung, learns it lost the lease
    stale.release()
    assert redis_client.hget(key, "token") == b"e0e000"  # and cannot release the new holder's


def test_a_lease_lost_with_redis_is_taken_again_on_renewal(redis_client):
    lease = SupervisorLease(redis_client, KEYS, "aaaaaa", ttl_s=5, host="h1")
    lease.acquire()
    redis_client.flushall()
    assert (
        lease.renew() and redis_client.hget(supervisor_lease_key(KEYS, "h1"), "token") == b"aaaaaa"
    )


def test_prune_deletes_only_idle_dead_slot_consumers_holding_nothing(redis_client):
    redis_client.xgroup_create(KEYS.requests, GROUP, id="0", mkstream=True)
    redis_client.xadd(KEYS.requests, {"id": "r1", "body": b""})
    names = {
        "dead": slot_consumer("q", 0, "aaaaaa"),
        "holds": slot_consumer("q", 1, "aaaaaa"),
        "live": slot_consumer("q", 0, "bbbbbb"),
        "manual": "host-1234",
    }
    for name in names.values():
        redis_client.xgroup_createconsumer(KEYS.requests, GROUP, name)
    redis_client.xreadgroup(GROUP, names["holds"], {KEYS.requests: ">"}, count=1)
    gone = prune_consumers(redis_client, KEYS, "q", {names["live"]}, min_idle_ms=0)
    assert gone == [names["dead"]]
    left = {c["name"].decode() for c in redis_client.xinfo_consumers(KEYS.requests, GROUP)}
    assert left == {names["holds"], names["live"], names["manual"]}
    assert (
        prune_consumers(redis_client, KEYS, "q", set(), min_idle_ms=3_600_000) == []
    )  # not idle long enough


def test_slot_names_and_a_predecessors_workers():
    assert slot_consumer("q", 3, "0a1b2c") == "q-s3-0a1b2c"
    assert is_slot_of("q-s3-0a1b2c", "q") and is_slot_of(
        "q-s3", "q"
    )  # an older, token-less slot too
    assert not is_slot_of("q.0-s3-0a1b2c", "q") and not is_slot_of("host-99", "q")

    def beat(consumer: str, pid: int, host: str = "h1") -> HeartbeatInfo:
        return HeartbeatInfo(consumer, pid, host, "cpu", "v1", "serving", 0, 0, 0, 0.0, 0.0, 0, 0)

    beats = [
        beat("q-s0-0dd000", 11),
        beat("q-s0-e0e000", 12),
        beat("q-s1-0dd000", 13, host="h2"),
        beat("other-s0-0dd000", 14),
        beat("q-s1-0dd000", 15),
    ]
    assert [p.pid for p in predecessor_workers(beats, "q", "h1", "e0e000")] == [11, 15]
