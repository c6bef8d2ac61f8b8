"""Sharing a fleet through the CLI and a raw Redis client, against a real ``inferfleet worker``
process.

The raw side uses only ``redis`` and ``msgpack``, with the keys, functions and
arguments docs/protocol.md gives (section "Version 1.1").
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import msgpack
import numpy as np
import redis

from tests.conftest import ROOT, worker_env
from tests.e2e.test_raw_protocol import DOC_EXAMPLE_BODY

NAME = "affine"
BASE = "inferfleet:{affine}:"
LANES = [BASE + "requests:high", BASE + "requests", BASE + "requests:low"]


def cli(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferfleet", *args],
        env=worker_env(redis_url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def reply(client: redis.Redis, rid: str) -> dict:
    popped = client.blpop([BASE + "reply:" + rid], timeout=30)
    assert popped is not None, f"no reply to {rid}"
    return msgpack.unpackb(popped[1], raw=False)


def test_limits_lanes_and_status_through_the_cli_and_a_raw_client(
    spawn_worker, redis_url, redis_client, models_dir, tmp_path
):
    spawn_worker(NAME, str(models_dir / "affine.pt"))
    done = cli(
        redis_url,
        "limit",
        "--name",
        NAME,
        "--max-backlog",
        "1000",
        "--tenant",
        "nightly",
        "--rate",
        "100",
        "--burst",
        "200",
    )
    assert done.returncode == 0, done.stderr
    ids = redis_client.fcall(
        "inferfleet_enqueue",
        7,
        LANES[0],
        BASE + "limits",
        BASE + "bucket:nightly",
        BASE + "tenants",
        *LANES,
        "nightly",
        0,
        "raw-high",
        DOC_EXAMPLE_BODY,
    )
    assert len(ids) == 1
    redis_client.xadd(LANES[2], {"id": "raw-low", "body": DOC_EXAMPLE_BODY})
    assert reply(redis_client, "raw-high")["ok"] and reply(redis_client, "raw-low")["ok"]
    shown = json.loads(cli(redis_url, "limit", "--name", NAME, "--show").stdout)
    assert shown[0]["max_backlog"] == 1000 and shown[0]["counts"]["nightly"] == {
        "accepted": 1,
        "refused": 0,
    }
    status = cli(redis_url, "status", "--name", NAME)
    assert status.returncode == 0 and "lanes" in status.stdout and "nightly" in status.stdout
    np.save(tmp_path / "x.npy", np.ones((1, 16), np.float32))
    bad = cli(
        redis_url,
        "enqueue",
        "--name",
        NAME,
        "--input",
        str(tmp_path / "x.npy"),
        "--priority",
        "urgent",
    )
    assert bad.returncode == 2 and "urgent" in bad.stderr
    high = cli(
        redis_url,
        "enqueue",
        "--name",
        NAME,
        "--input",
        str(tmp_path / "x.npy"),
        "--priority",
        "high",
        "--tenant",
        "nightly",
        "--wait",
    )
    assert high.returncode == 0 and json.loads(high.stdout)["ok"], high.stderr


def test_a_raw_client_cancels_a_request_waiting_in_the_queue(
    spawn_worker, redis_url, redis_client, models_dir
):
    worker = spawn_worker(NAME, str(models_dir / "affine.pt"))
    worker.send_signal(signal.SIGSTOP)  # the request waits in the queue
    try:
        redis_client.xadd(LANES[1], {"id": "raw-c", "body": DOC_EXAMPLE_BODY})
        statuses = redis_client.fcall(
            "inferfleet_cancel",
            6,
            BASE + "cancels",
            *LANES,
            BASE + "reply:raw-c",
            BASE + "reply:nope",
            3_600_000,
            "raw-c",
            "nope",
        )
        assert statuses == [b"cancelled", b"unknown"]
    finally:
        worker.send_signal(signal.SIGCONT)
    got = reply(redis_client, "raw-c")
    assert not got["ok"] and got["error"]["code"] == "cancelled"
