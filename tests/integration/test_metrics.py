"""Metrics and JSON logs of real worker processes: scraped over HTTP, read from stderr."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inferfleet.producer import Producer
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.heartbeat import read_heartbeats
from tests.conftest import ROOT, stop_process, worker_env
from tests.helpers import wait_until

#: What a wait here polls through: the endpoint not up yet, or a check's assertion not true yet
#: (replies are written just before they are counted).
NOT_YET = (OSError, AssertionError)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def send(redis_url: str, name: str, good: int, prefix: str = "r") -> tuple[list, object]:
    """``good`` one-row requests and one of the wrong shape; returns (good replies, the bad
    reply)."""
    with Producer(redis_url, name) as producer:
        rng = np.random.default_rng(0)
        rids = [
            producer.submit(
                rng.standard_normal((1, 16), dtype=np.float32), request_id=f"{prefix}-{i}"
            )
            for i in range(good)
        ]
        bad = producer.submit(np.zeros((1, 3), np.float32), request_id=f"{prefix}-bad")
        replies = producer.results(rids, timeout_s=60)
        bad_reply = producer.result(bad, timeout_s=30, raise_errors=False)
    assert all(r.ok for r in replies), [r.error_message for r in replies if not r.ok][:3]
    assert bad_reply.error_code == "bad_request"
    return replies, bad_reply


def test_a_worker_serves_its_metrics(spawn_worker, redis_url, models_dir):
    port = free_port()
    spawn_worker("m", str(models_dir / "affine.pt"), "--metrics-port", str(port))
    replies, _ = send(redis_url, "m", 50)

    def counted():
        samples = scrape(port)
        return (
            samples
            if sample(samples, "inferfleet_requests_total", queue="m", code="ok") == 50
            else None
        )

    samples = wait_until(counted, 10, "50 ok replies counted", every_s=0.1, retry_on=NOT_YET)
    assert sample(samples, "inferfleet_requests_total", queue="m", code="bad_request") == 1
    assert sample(samples, "inferfleet_requests_total", queue="m", code="model_error") == 0
    assert (
        sample(samples, "inferfleet_batch_rows_sum", queue="m") == 50
    )  # the bad request is never computed
    batches = sample(samples, "inferfleet_batch_rows_count", queue="m")
    assert 1 <= batches <= 50
    assert sample(samples, "inferfleet_inference_seconds_count", queue="m") == batches
    assert sample(samples, "inferfleet_queue_wait_seconds_count", queue="m") == 50
    assert sample(samples, "inferfleet_queue_wait_seconds_bucket", queue="m", le="+Inf") == 50
    assert (
        sample(samples, "inferfleet_model_info", queue="m", version=replies[0].model_version) == 1
    )
    # housekeeping (every second) reports the group's depth: all delivered, answered and
    # acknowledged
    wait_until(
        lambda: (
            lambda s: (
                sample(s, "inferfleet_queue_pending", queue="m") == 0
                and sample(s, "inferfleet_queue_lag", queue="m") == 0
            )
        )(scrape(port)),
        10,
        "the queue depth",
        every_s=0.1,
        retry_on=NOT_YET,
    )


def test_the_metrics_address_binds_that_address_only(spawn_worker, models_dir):
    """--metrics-address 127.0.0.2: /metrics answers there and not on 127.0.0.1 (both loopback on
    Linux), so the port is bound to the one address asked for, not to every interface."""
    port = free_port()
    spawn_worker(
        "addr",
        str(models_dir / "affine.pt"),
        "--metrics-port",
        str(port),
        "--metrics-address",
        "127.0.0.2",
    )

    def answers(host: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
                return b"inferfleet_model_info{" in response.read()
        except OSError:
            return False

    wait_until(
        lambda: answers("127.0.0.2"), 30, "/metrics on 127.0.0.2", every_s=0.1, retry_on=NOT_YET
    )
    assert not answers("127.0.0.1")


def test_a_worker_writes_its_heartbeat_file_with_the_loop_s_age(spawn_worker, models_dir, tmp_path):
    """--heartbeat-file: each beat rewrites it with the beat's time and the consumer loop's last
    round, which an idle worker still goes round (its blocking read returns every idle_block_ms)."""
    path = tmp_path / "hb.json"
    spawn_worker(
        "hbfile",
        str(models_dir / "affine.pt"),
        "--heartbeat-file",
        str(path),
        "--heartbeat-s",
        "0.2",
        consumer="hbfile-0",
    )
    first = wait_until(
        lambda: path.exists() and json.loads(path.read_text()),
        30,
        "the heartbeat file",
        every_s=0.1,
        retry_on=NOT_YET,
    )
    assert first["consumer"] == "hbfile-0" and first["state"] == "serving"
    later = wait_until(
        lambda: (lambda b: b if b["loop_ms"] > first["loop_ms"] + 1000 else None)(
            json.loads(path.read_text())
        ),
        30,
        "the consumer loop's time to move on",
        every_s=0.1,
        retry_on=NOT_YET,
    )
    assert later["last_seen_ms"] > first["last_seen_ms"]
    assert (
        abs(later["last_seen_ms"] - later["loop_ms"]) < 10_000
    )  # both recent: an idle loop goes round


def test_a_taken_metrics_port_is_a_one_line_error(redis_url, models_dir):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "inferfleet",
                "worker",
                "--name",
                "m",
                "--model",
                str(models_dir / "affine.pt"),
                "--metrics-port",
                str(port),
            ],
            env=worker_env(redis_url),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 1
    assert f"Error: cannot serve metrics on 0.0.0.0 port {port}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def supervise(redis_url, tmp_path):
    """Start ``inferfleet supervise`` (stderr to a file); SIGTERM it at the end."""
    procs: list[tuple[subprocess.Popen, Path]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        log_path = tmp_path / f"supervise-{len(procs)}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "inferfleet", "supervise", *args],
                env={**worker_env(redis_url), **(env or {})},
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=log_file,
            )
        procs.append((proc, log_path))
        return proc, log_path

    yield start
    for proc, _ in procs:
        stop_process(proc, timeout_s=30)


def model_info_pids(samples: dict) -> set[str]:
    return {
        dict(labels)["pid"]
        for (name, labels), v in samples.items()
        if name == "inferfleet_model_info" and v == 1
    }


def test_a_supervised_fleet_has_one_endpoint_summing_its_workers(
    supervise, redis_url, redis_client
):
    port = free_port()
    proc, log_path = supervise(
        "--name",
        "s",
        "--model",
        "tests.handlers:Slow",
        "--metrics-port",
        str(port),
        "--policy",
        "fixed",
        "--min-workers",
        "2",
        "--max-workers",
        "2",
        "--interval-s",
        "0.2",
        "--max-batch-rows",
        "8",
        "--devices",
        "cpu",
        "--log-format",
        "json",
        env={"SLOW_BATCH_S": "0.01"},
    )
    keys = QueueKeys("s")
    wait_until(
        lambda: len(read_heartbeats(redis_client, keys)) == 2,
        90,
        "two warm workers",
        every_s=0.1,
        retry_on=NOT_YET,
    )
    samples = wait_until(
        lambda: (lambda s: s if sample(s, "inferfleet_workers", queue="s") == 2 else None)(
            scrape(port)
        ),
        10,
        "inferfleet_workers 2",
        every_s=0.1,
        retry_on=NOT_YET,
    )
    assert len(model_info_pids(samples)) == 2  # one info series per live child
    with Producer(redis_url, "s") as producer:
        rids = producer.submit_many([np.full((1, 4), i, np.float32) for i in range(400)])
        assert all(r.ok for r in producer.results(rids, timeout_s=60))
        bad = producer.submit(np.zeros((1, 3), np.float32))
        assert producer.result(bad, raise_errors=False).error_code == "bad_request"
    # both children served part of the load (their own heartbeats say so)...
    served = wait_until(
        lambda: (lambda b: b if sum(h.requests for h in b) == 401 else None)(
            read_heartbeats(redis_client, keys)
        ),
        10,
        "heartbeats counting 401 requests",
        every_s=0.1,
        retry_on=NOT_YET,
    )
    assert all(h.requests > 0 for h in served), [(h.consumer, h.requests) for h in served]
    # ...and the one endpoint shows their sum
    samples = wait_until(
        lambda: (
            lambda s: (
                s if sample(s, "inferfleet_requests_total", queue="s", code="ok") == 400 else None
            )
        )(scrape(port)),
        10,
        "400 ok replies summed",
        every_s=0.1,
        retry_on=NOT_YET,
    )
    assert sample(samples, "inferfleet_requests_total", queue="s", code="bad_request") == 1
    assert sample(samples, "inferfleet_batch_rows_sum", queue="s") == 400
    assert sample(samples, "inferfleet_worker_restarts_total", queue="s") == 0
    assert (
        sample(samples, "inferfleet_queue_lag", queue="s") is not None
    )  # the supervisor's reading, once

    # a child killed outright: restarted, its live gauges gone, its counts kept in the sums
    victim = served[0].pid
    os.kill(victim, signal.SIGKILL)

    def restarted():
        s = scrape(port)
        pids = model_info_pids(s)
        return (
            s
            if (
                sample(s, "inferfleet_worker_restarts_total", queue="s") == 1
                and len(pids) == 2
                and str(victim) not in pids
            )
            else None
        )

    samples = wait_until(
        restarted,
        90,
        "the killed worker restarted and its info series gone",
        every_s=0.1,
        retry_on=NOT_YET,
    )
    assert sample(samples, "inferfleet_requests_total", queue="s", code="ok") == 400

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    records = [
        json.loads(line) for line in log_path.read_text().splitlines()
    ]  # children log JSON too
    consumers = {r.get("consumer") for r in records}
    assert {"s-s0", "s-s1"} <= {c.rsplit("-", 1)[0] for c in consumers if c and c.startswith("s-s")}
    metrics_dir = next(
        re.search(r"children write to (\S+)\)", r["message"])
        for r in records
        if "children write to" in r["message"]
    )
    assert metrics_dir is not None
    assert not os.path.exists(metrics_dir.group(1))  # the private directory is removed at exit


def test_json_logs_carry_the_consumer_and_request_ids(spawn_worker, redis_url, models_dir):
    proc = spawn_worker(
        "j", str(models_dir / "affine.pt"), "--log-format", "json", "--log-level", "debug"
    )
    send(redis_url, "j", 3, prefix="trace")
    assert stop_process(proc) == 0
    lines = proc.stderr.read().decode().splitlines()
    records = [json.loads(line) for line in lines]  # every line of stderr is one JSON object
    assert records and all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    ours = [r for r in records if r["logger"].startswith("inferfleet.worker.")]
    assert ours and all(r.get("consumer") == "test-j-0" for r in ours)
    batches = [r for r in records if "trace-0" in r.get("request_ids", [])]
    assert batches and isinstance(batches[0]["batch"], int), records[-5:]
    assert any(
        r.get("request_ids") == ["trace-bad"] and "bad_request" in r["message"] for r in records
    )
