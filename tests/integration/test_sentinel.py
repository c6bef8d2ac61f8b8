"""Redis Sentinel, with real servers on loopback: a primary, a replica and three Sentinels
(the finder's server binary in ``--sentinel`` mode). Every part that takes a Redis URL takes a
Sentinel URL, and a worker and a producer follow a failover without a restart."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from inferfleet.producer import AsyncProducer, Producer
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.embedded import EmbeddedRedis, find_redis_server, free_port
from inferfleet.worker.heartbeat import read_heartbeats
from tests.conftest import ROOT, stop_process, worker_env
from tests.fixtures.sentinels import SERVICE, SentinelSet, sentinel_process
from tests.helpers import wait_until


@pytest.fixture
def sentinels() -> Iterator[SentinelSet]:
    with SentinelSet() as found:
        yield found


def test_a_worker_and_a_producer_follow_a_killed_primary_without_a_restart(
    sentinels: SentinelSet,
) -> None:
    consumer = "sentinel-worker"
    env = worker_env(sentinels.url)
    worker = subprocess.Popen(
        [sys.executable, "-m", "inferfleet", "worker", "--name", "fo", "--model",
         "tests.handlers:Scale", "--consumer", consumer, "--idle-block-ms", "200"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with Producer(sentinels.url, "fo") as producer:
            before = [
                producer.infer(np.full((1, 4), i, np.float32), timeout_s=60) for i in range(20)
            ]
            assert [float(r[0, 0]) for r in before] == [2.0 * i for i in range(20)]
            killed_ms = time.time() * 1000
            os.kill(sentinels.primary.pid, signal.SIGKILL)  # type: ignore[arg-type]
            sentinels.wait_promoted()
            (after,) = wait_until(lambda: _answered(producer), 60, "an answer from the new primary")
            assert float(after[0, 0]) == 200.0
            more = [producer.infer(np.full((1, 4), i, np.float32), timeout_s=60) for i in range(20)]
            assert [float(r[0, 0]) for r in more] == [2.0 * i for i in range(20)]
        assert worker.poll() is None, "the worker exited instead of following the failover"
        assert sentinels.replica is not None
        promoted = redis.Redis(port=sentinels.replica.port)
        groups = promoted.xinfo_consumers("inferfleet:{fo}:requests", "workers")
        assert consumer in {g["name"].decode() for g in groups}
        wait_until(  # its heartbeat beats on the new primary: status and the supervisor see it
            lambda: any(
                b.consumer == consumer and b.last_seen_ms > killed_ms
                for b in read_heartbeats(promoted, QueueKeys("fo"))
            ),
            30,
            "a heartbeat of the worker's written to the new primary",
        )
    finally:
        stop_process(worker)
        assert worker.stderr is not None
        worker.stderr.close()


def _answered(producer: Producer):
    """One request's reply, or None while the failover still shows as a connection error."""
    from inferfleet.producer.errors import ConnectionError as SdkConnectionError

    try:
        return (producer.infer(np.full((1, 4), 100.0, np.float32), timeout_s=10),)
    except SdkConnectionError:
        return None


def test_the_supervisor_the_cli_and_the_async_sdk_take_a_sentinel_url(
    sentinels: SentinelSet,
) -> None:
    env = worker_env(sentinels.url)
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "inferfleet", "supervise", "--name", "sv", "--model",
         "tests.handlers:Scale", "--policy", "fixed", "--min-workers", "1", "--devices", "cpu"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        async def one() -> float:
            async with AsyncProducer(sentinels.url, "sv") as producer:
                out = await producer.infer(np.full((1, 4), 4.0, np.float32), timeout_s=120)
                return float(out[0, 0])

        assert asyncio.run(one()) == 8.0
        status = subprocess.run(
            [sys.executable, "-m", "inferfleet", "status", "--name", "sv", "--json"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert len(json.loads(status.stdout)["queues"][0]["workers"]) == 1
    finally:
        assert stop_process(supervisor, 60) == 0
        assert supervisor.stderr is not None
        supervisor.stderr.close()


#: The Sentinels' ACL that docs/operations.md gives the fleet's users: SENTINEL MASTERS alone.
SENTINEL_ACL = "user default off\nuser fleet on >sentinel-pw -@all +sentinel|masters\n"


def test_the_documented_sentinel_acl_is_all_a_client_needs(tmp_path: Path) -> None:
    binary = find_redis_server()
    assert binary, "no Redis 7+ server: ./scripts/setup installs one"
    port = free_port()
    with EmbeddedRedis() as primary:
        proc = sentinel_process(binary, port, primary.port, tmp_path, SENTINEL_ACL)
        try:
            url = f"redis+sentinel://127.0.0.1:{port}/{SERVICE}/0"
            auth = "?sentinel_username=fleet&sentinel_password=sentinel-pw"
            with Producer(url + auth, "acl") as producer:
                wait_until(lambda: _reaches(producer), 30, "the primary through the Sentinel")
            with pytest.raises(Exception, match="No master found"):  # the Sentinel said NOAUTH
                with Producer(url, "acl") as refused:
                    refused.submit(np.ones((1, 4), np.float32))
        finally:
            stop_process(proc)


def _reaches(producer: Producer) -> bool:
    try:
        return bool(producer.submit(np.ones((1, 4), np.float32)))
    except Exception:  # noqa: BLE001 - the Sentinel still starting
        return False
