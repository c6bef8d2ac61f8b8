"""One consumer's Recovery against fakeredis: own-pending replay, orphans, the housekeeping
schedule."""

from __future__ import annotations

import fakeredis
import pytest
from prometheus_client import CollectorRegistry

from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.metrics import WorkerMetrics
from inferfleet.worker.serving.recovery import Recovery

KEYS = QueueKeys("q")


@pytest.fixture
def client() -> fakeredis.FakeRedis:
    client = fakeredis.FakeRedis()
    client.xgroup_create(KEYS.requests, GROUP, id="0", mkstream=True)
    return client


def recovery(client: fakeredis.FakeRedis, **settings: object) -> Recovery:
    return Recovery(
        client, KEYS, WorkerSettings(name="q", model="m.pt", consumer="c1", **settings), Counters()
    )


def held(client: fakeredis.FakeRedis, count: int) -> list[bytes]:
    """``count`` entries read by c1 and never answered."""
    ids = [client.xadd(KEYS.requests, {"id": f"r{i}"}) for i in range(count)]
    client.xreadgroup(GROUP, "c1", {KEYS.requests: ">"}, count=count)
    return ids


def test_own_pending_entries_become_suspects_oldest_first(client):
    ids = held(client, 3)
    rec = recovery(client)
    assert rec.replay_own  # first thing after a start
    rec.replay_own_pending()
    assert not rec.replay_own
    assert [rec.next_suspect()[0] for _ in ids] == ids
    assert rec.next_suspect() is None


def test_entries_pending_on_us_that_we_do_not_hold_are_orphans(client):
    held(client, 3)
    rec = recovery(client)
    rec.replay_own = False
    rec._check_orphans(read_ahead=3)  # all three held read ahead: none lost
    assert not rec.replay_own
    rec._check_orphans(read_ahead=2)  # one lost in transit: replay
    assert rec.replay_own


def test_housekeeping_runs_once_per_interval():
    rec = recovery(fakeredis.FakeRedis(), housekeeping_s=2.0)
    assert rec.housekeeping_due(100.0)  # at once after a start
    assert not rec.housekeeping_due(101.9)
    assert rec.housekeeping_due(102.0)
    assert not rec.housekeeping_due(103.0)


def test_trim_keeps_what_is_pending_and_reports_the_depth(client):
    ids = held(client, 2)
    client.xack(KEYS.requests, GROUP, ids[0])
    undelivered = client.xadd(KEYS.requests, {"id": "undelivered"})
    registry = CollectorRegistry()
    rec = recovery(client)
    rec.metrics = Counters(WorkerMetrics("q", registry))
    rec._trim()
    assert [entry_id for entry_id, _ in client.xrange(KEYS.requests)] == [ids[1], undelivered]
    assert registry.get_sample_value("inferfleet_queue_lag", {"queue": "q"}) == 1
    assert registry.get_sample_value("inferfleet_queue_pending", {"queue": "q"}) == 1


def delivered(client: fakeredis.FakeRedis, entry_id: bytes) -> int:
    (row,) = client.xpending_range(KEYS.requests, GROUP, min=entry_id, max=entry_id, count=1)
    return int(row["times_delivered"])


def test_only_the_first_replay_after_a_start_counts_deliveries(client):
    """A later replay is the worker's own retry (a reply it could not write): no delivery counted,
    however many times it happens, so a full Redis cannot push an innocent request to dead
    letter."""
    (entry,) = held(client, 1)
    rec = recovery(client)
    rec.replay_own_pending()  # after a start: whoever held it under this name is gone
    assert rec.next_suspect()[0] == entry
    assert rec.start_attempt(entry, 1) == 2 and delivered(client, entry) == 2
    for _ in range(10):  # ten failed reply writes, ten replays
        rec.replay_own = True
        rec.replay_own_pending()
        assert rec.next_suspect()[0] == entry
        assert rec.start_attempt(entry, 2) == 2
    assert delivered(client, entry) == 2


def test_an_entry_taken_over_but_not_started_still_counts_after_a_replay(client):
    rec = recovery(client)
    rec.replay_own_pending()
    entry = client.xadd(KEYS.requests, {"id": "r9"})
    client.xreadgroup(GROUP, "ghost", {KEYS.requests: ">"}, count=1)
    client.xclaim(
        KEYS.requests, GROUP, "c1", 0, [entry], justid=True
    )  # taken over from a dead consumer
    rec.suspects = [(entry, {b"id": b"r9"}, 1)]
    rec.replay_own = True
    rec.replay_own_pending()  # a connection lost before it was started
    assert rec.next_suspect()[0] == entry
    assert rec.start_attempt(entry, 1) == 2 and delivered(client, entry) == 2
