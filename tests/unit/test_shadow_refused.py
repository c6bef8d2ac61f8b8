"""A shadow command Redis refuses stops the shadow on that worker (one shadow_failed alert), never
the loop.

The real refusal (an ACL user without HINCRBYFLOAT) is in tests/integration/test_security.py;
here a fake client refuses, to pin down the cases that test cannot reach cheaply: no
candidate yet, and the same candidate refused again.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.serving.alerts import Alert
from inferfleet.worker.serving.comparison import PairStats
from inferfleet.worker.serving.rollout import Candidate
from inferfleet.worker.serving.shadow import ShadowRunner

KEYS = QueueKeys("q")
LIVE = SimpleNamespace(version="scale-1", device="cpu")
SHADOW_HASH = {
    b"model": b"tests.handlers:Scale",
    b"version": b"scale-2",
    b"seq": b"7",
    b"state": b"shadow",
    b"sample": b"1.0",
    b"canary": b"0.0",
}


class RefusingRedis:
    """Reads the shadow hash (unless ``refuse_reads``); every script is refused, as an ACL without
    its commands."""

    def __init__(self, refuse_reads: bool = False) -> None:
        self.refuse_reads = refuse_reads

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        if self.refuse_reads:
            raise redis.exceptions.NoPermissionError(
                "this user has no permissions to run the 'hgetall' command"
            )
        return dict(SHADOW_HASH)

    def register_script(self, script: str) -> Any:
        def refused(**_: Any) -> None:
            raise redis.exceptions.ResponseError(
                "The user executing the script can't run this command"
            )

        return refused


def runner(client: RefusingRedis, alerts: list[Alert]) -> ShadowRunner:
    settings = WorkerSettings(name="q", model="tests.handlers:Scale", consumer="c1")
    return ShadowRunner(
        client, KEYS, settings, lambda s: None, Counters(), alerts.extend, lambda *a: None
    )


def loaded(shadow: ShadowRunner) -> ShadowRunner:
    """As if the candidate of SHADOW_HASH had loaded and compared a request."""
    spec = Candidate.from_hash(SHADOW_HASH)
    assert spec is not None
    shadow.spec, shadow.runtime, shadow.ready = spec, object(), True
    shadow._stats = {"scale-1": PairStats(compared=1, rows=1, agree_rows=1, batches=1)}
    return shadow


def test_a_refused_flush_stops_the_shadow_and_alerts_once() -> None:
    alerts: list[Alert] = []
    shadow = loaded(runner(RefusingRedis(), alerts))
    shadow.poll(LIVE)  # the flush script is refused: must not raise
    assert not shadow.ready and shadow.runtime is None
    assert [(a.kind, a.version) for a in alerts] == [("shadow_failed", "scale-2")]
    assert "refused a shadow command" in alerts[0].detail
    assert shadow.heartbeat_fields()["shadow"] == "scale-2 failed"
    shadow.poll(LIVE)  # the same candidate: not loaded again, not alerted again
    assert len(alerts) == 1 and not shadow.ready


def test_a_refused_read_without_a_candidate_is_logged_once_and_alerts_nothing(caplog) -> None:
    alerts: list[Alert] = []
    shadow = runner(RefusingRedis(refuse_reads=True), alerts)
    with caplog.at_level(logging.WARNING, logger="inferfleet.worker.serving.shadow"):
        for _ in range(3):
            shadow.poll(LIVE)
    assert alerts == [] and shadow.spec is None
    assert sum("refused a shadow command" in r.getMessage() for r in caplog.records) == 1


def test_an_outage_still_reaches_the_loop() -> None:
    """A connection error is not a refusal: the consumer loop waits it out with backoff."""

    class Down(RefusingRedis):
        def hgetall(self, key: str) -> dict[bytes, bytes]:
            raise redis.exceptions.ConnectionError("Redis is down")

    with pytest.raises(redis.exceptions.ConnectionError):
        runner(Down(), []).poll(LIVE)
