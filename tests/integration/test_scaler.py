"""``inferfleet scaler``: the scaling policy's decision served over HTTP for KEDA, on a real
redis-server and a real process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
import redis

from inferfleet.producer import Producer
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.fleet.observe import observe, tightest_budget_s
from tests.conftest import ROOT, stop_process, worker_env
from tests.helpers import wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""  # not listening yet


def start_scaler(redis_url: str, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "inferfleet", "scaler", "--address", "127.0.0.1", *args]
    return subprocess.Popen(
        cmd, env=worker_env(redis_url), cwd=ROOT, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture
def scaler(redis_url: str):
    """A scaler for queue ``kedaq`` (no workers yet), scaling 0..6 on the target policy."""
    port = free_port()
    proc = start_scaler(
        redis_url,
        *("--name", "kedaq", "--port", str(port), "--interval-s", "0.1"),
        *("--policy", "target", "--min-workers", "0", "--max-workers", "6"),
    )
    wait_until(lambda: get(port, "/healthz")[0] == 200, 30, "the scaler's first decision")
    yield port
    status = stop_process(proc)
    with proc.stderr:  # type: ignore[union-attr]
        assert status == 0, proc.stderr.read()  # type: ignore[union-attr]


def desired(port: int) -> dict:
    status, body = get(port, "/desired")
    assert status == 200
    return json.loads(body)


def test_one_waiting_request_wakes_a_fleet_scaled_to_zero(redis_url: str, scaler: int) -> None:
    first = desired(scaler)
    assert first["desired"] == 0 and first["policy"] == "target"
    with Producer(redis_url, "kedaq") as producer:
        producer.submit(np.ones((1, 4), np.float32))
    woke = wait_until(lambda: desired(scaler)["desired"] >= 1 or None, 30, "a desired worker")
    assert woke
    status, body = get(scaler, "/metrics")
    assert status == 200
    assert b'inferfleet_desired_workers{queue="kedaq"} ' in body
    gauge = [line for line in body.decode().splitlines() if line.startswith("inferfleet_desired")]
    assert float(gauge[0].rsplit(" ", 1)[1]) >= 1


def test_unknown_paths_are_refused_naming_the_known_ones(scaler: int) -> None:
    status, body = get(scaler, "/nope")
    assert status == 404 and b"/desired" in body


def test_a_bad_interval_or_a_taken_port_exits_with_one_clear_line(redis_url: str) -> None:
    bad = start_scaler(redis_url, "--name", "kedaq", "--interval-s", "0.001", "--port", "0")
    _, err = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "--interval-s" in err and "0.05" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = start_scaler(redis_url, "--name", "kedaq", "--port", port)
        _, err = busy.communicate(timeout=60)
    assert busy.returncode == 1 and f"port {port}" in err and "Traceback" not in err


def test_the_deadlines_the_newest_requests_carry_become_the_policys_budget(
    redis_url: str, redis_client
) -> None:
    keys = QueueKeys("budgets")
    x = np.ones((1, 4), np.float32)
    with Producer(redis_url, "budgets", default_deadline_s=None) as producer:
        for _ in range(10):
            producer.submit(x)
        assert tightest_budget_s(redis_client, keys) is None  # no deadline: no budget
        redis_client.xadd(keys.requests, {"id": "odd", "body": b"", "deadline": b"soon"})
        for _ in range(30):
            producer.submit(x, deadline_s=0.15)
    budget = tightest_budget_s(redis_client, keys)
    assert budget is not None and 0.05 < budget <= 0.16  # the malformed one is passed over
    assert observe(redis_client, keys, 1, 0.0).deadline_s == budget
    # a user whose ACL lacks XRANGE: no budget, and the observation goes on
    redis_client.execute_command(
        "ACL", "SETUSER", "noxrange", "on", ">pw", "~*", "+@all", "-xrange"
    )
    try:
        port = redis_client.connection_pool.connection_kwargs["port"]
        limited = redis.Redis(port=port, username="noxrange", password="pw")
        assert tightest_budget_s(limited, keys) is None
        assert observe(limited, keys, 1, 0.0).deadline_s is None
        limited.close()
    finally:
        redis_client.execute_command("ACL", "DELUSER", "noxrange")
