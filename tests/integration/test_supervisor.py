"""The supervisor with real worker processes on a real redis-server.

Each wait is bounded only against a hang (tests/helpers.py ``wait_until``); a test whose bounds
add up past the suite's 120 s default says so with its own timeout and the ``slow`` mark. A check
that something did not happen (no restart, no exit) is made once the thing is shown to be
possible in the same test and the supervisor is seen working through the window.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

from inferfleet.producer import Producer
from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.worker.cli import child_main
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.fleet.scaling import PolicySettings
from inferfleet.worker.fleet.supervisor import Supervisor, SupervisorSettings
from inferfleet.worker.heartbeat import read_heartbeats
from inferfleet.worker.keys import supervisor_key
from tests.handlers import STALL
from tests.helpers import wait_until


@pytest.fixture
def run_supervisor(redis_url, redis_client, monkeypatch):
    """Start a Supervisor in a thread; stop and drain it at the end of the test."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("INFERFLEET_LOG_LEVEL", "warning")
    started = []

    def run(model: str, policy: PolicySettings, **overrides) -> Supervisor:
        worker = WorkerSettings(
            name="q",
            model=model,
            redis_url=redis_url,
            warmup_iters=1,
            max_batch_rows=overrides.pop("max_batch_rows", 8),
            idle_block_ms=100,
            heartbeat_s=0.2,
            **overrides.pop("worker", {}),
        )
        settings = SupervisorSettings(
            worker=worker,
            policy=policy,
            interval_s=0.2,
            restart_backoff_s=0.2,
            drain_timeout_s=30,
            **overrides,
        )
        supervisor = Supervisor(settings, child_main)
        stop = threading.Event()
        thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
        thread.start()
        started.append((supervisor, stop, thread))
        return supervisor

    yield run
    for _, stop, thread in started:
        stop.set()
        thread.join(60)
        assert not thread.is_alive(), "the supervisor did not stop"


def alive_workers(supervisor: Supervisor) -> int:
    return sum(1 for s in supervisor.slots if s.alive)


@pytest.mark.slow
@pytest.mark.timeout(300)  # waits of up to 60 + 90 + 10 + 30 s, and the fixture's 60 s stop
def test_burst_scales_up_drains_and_scales_back_down(
    run_supervisor, redis_url, redis_client, monkeypatch
):
    monkeypatch.setenv("SLOW_BATCH_S", "0.02")  # about 400 requests/s per worker at 8 rows
    policy = PolicySettings(
        kind="lag",
        min_workers=1,
        max_workers=4,
        target_drain_s=1.0,
        up_cooldown_s=0.4,
        down_cooldown_s=3.0,
        max_step=2,
    )
    supervisor = run_supervisor("tests.handlers:Slow", policy)
    wait_until(
        lambda: len(read_heartbeats(redis_client, QueueKeys("q"))) == 1, 60, "the first worker"
    )
    producer = Producer(redis_url, "q")
    inputs = [np.full((1, 4), i, np.float32) for i in range(4000)]
    rids = producer.submit_many(inputs)
    peak = 0
    keys = QueueKeys("q")

    def drained() -> bool:
        nonlocal peak
        peak = max(peak, alive_workers(supervisor))
        group = redis_client.xinfo_groups(keys.requests)[0]
        return group["lag"] == 0 and group["pending"] == 0

    wait_until(drained, 90, "the burst to drain")
    assert peak >= 3, f"peak workers {peak}"
    for rid in rids:  # exactly one reply each, before anything is collected
        assert redis_client.llen(keys.reply(rid)) == 1
    replies = producer.results(rids, timeout_s=10)
    for x, reply in zip(inputs, replies):
        np.testing.assert_array_equal(reply.outputs, x * 2)
    wait_until(lambda: alive_workers(supervisor) == 1, 30, "scale-down to one worker")
    names = {c["name"] for c in redis_client.xinfo_consumers(keys.requests, GROUP)}
    assert len(names) <= 2  # drained workers left the group (one may be mid-exit)


@pytest.mark.slow
@pytest.mark.timeout(480)  # waits of up to 3 x 120 s, and the fixture's 60 s stop
def test_the_target_policy_scales_an_idle_fleet_to_zero_and_wakes_it_for_one_request(
    run_supervisor, redis_url, redis_client, monkeypatch
):
    monkeypatch.setenv("SLOW_BATCH_S", "0.02")
    policy = PolicySettings(
        kind="target", min_workers=0, max_workers=2, down_cooldown_s=2.0, target_p99_ms=500
    )
    supervisor = run_supervisor("tests.handlers:Slow", policy)
    keys = QueueKeys("q")
    producer = Producer(redis_url, "q")
    first = producer.submit(np.full((1, 4), 1.0, np.float32))  # wakes the fleet from nothing
    np.testing.assert_array_equal(producer.result(first, timeout_s=120).outputs, 2.0)
    wait_until(lambda: alive_workers(supervisor) == 0, 120, "the idle fleet to reach zero")
    assert read_heartbeats(redis_client, keys) == []  # drained, not just forgotten
    rid = producer.submit(np.full((1, 4), 3.0, np.float32))
    np.testing.assert_array_equal(producer.result(rid, timeout_s=120).outputs, 6.0)
    assert alive_workers(supervisor) >= 1


@pytest.mark.slow
@pytest.mark.timeout(300)  # waits of up to 60 + 30 + 60 + 30 s, and the fixture's 60 s stop
def test_killed_worker_is_replaced(run_supervisor, redis_url, redis_client, models_dir):
    policy = PolicySettings(kind="fixed", min_workers=2, max_workers=2)
    supervisor = run_supervisor(str(models_dir / "affine.pt"), policy)
    keys = QueueKeys("q")
    wait_until(lambda: len(read_heartbeats(redis_client, keys)) == 2, 60, "two workers")
    victim = supervisor.slots[0]
    old_pid = victim.process.pid
    os.kill(old_pid, signal.SIGKILL)
    wait_until(
        lambda: victim.process is not None and victim.process.pid != old_pid and victim.alive,
        30,
        "a replacement process",
    )
    wait_until(
        lambda: {h.pid for h in read_heartbeats(redis_client, keys)} >= {victim.process.pid},
        60,
        "the replacement's heartbeat",
    )
    assert (
        victim.consumer == f"q-s0-{supervisor.token}"
    )  # same slot name: it replays its own pending entries
    replies = Producer(redis_url, "q").map([np.ones((1, 16), np.float32)] * 300, timeout_s=30)
    assert all(r.ok for r in replies)


def published_ticks(client, keys: QueueKeys) -> int | None:
    """When the supervisor last published its view (ms; it does once a tick), or None."""
    updated = client.hget(supervisor_key(keys), "updated_ms")
    return int(updated) if updated is not None else None


@pytest.mark.slow
@pytest.mark.timeout(240)  # waits of up to 90 + 30 s, and the fixture's 60 s stop
def test_crash_loop_stops_restarting_and_says_why(run_supervisor, redis_client, tmp_path, caplog):
    policy = PolicySettings(kind="fixed", min_workers=1, max_workers=1)
    supervisor = run_supervisor(
        str(tmp_path / "missing.pt"), policy, crash_loop_deaths=3, crash_loop_window_s=120
    )
    pids: set[int] = set()  # every process the slot ran: the supervisor does restart it

    def disabled() -> bool:
        if supervisor.slots and supervisor.slots[0].process is not None:
            pids.add(supervisor.slots[0].process.pid)
        return bool(supervisor.slots) and supervisor.slots[0].disabled is not None

    wait_until(disabled, 90, "the crash loop to be detected")
    assert "died 3 times" in supervisor.slots[0].disabled
    assert any("CRASH LOOP" in r.getMessage() for r in caplog.records)
    # the positive control: it did restart the failing worker (a process for each death counted)
    assert len(pids) >= 3, pids
    last = supervisor.slots[0].process
    # then five more ticks of the loop, seen in what it publishes, and no fourth process
    keys = QueueKeys("q")
    ticks: set[int] = set()
    wait_until(
        lambda: ticks.add(published_ticks(redis_client, keys) or 0) or len(ticks) > 5,
        30,
        "five more supervisor ticks",
    )
    assert len(supervisor.slots) == 1 and supervisor.slots[0].process is last
    assert not supervisor.slots[0].alive  # no new copies of the failure
    published = redis_client.hget(supervisor_key(keys), "disabled")  # what status shows
    assert published == supervisor.slots[0].disabled.encode()


@pytest.mark.slow
@pytest.mark.timeout(240)  # waits of up to 60 + 30 s, and a 60 s stop
def test_stopping_drains_every_worker_without_loss(
    redis_url, redis_client, models_dir, monkeypatch
):
    monkeypatch.setenv("SLOW_BATCH_S", "0.01")
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    worker = WorkerSettings(
        name="q",
        model="tests.handlers:Slow",
        redis_url=redis_url,
        warmup_iters=1,
        max_batch_rows=8,
        idle_block_ms=100,
        heartbeat_s=0.2,
    )
    settings = SupervisorSettings(
        worker=worker,
        policy=PolicySettings(kind="fixed", min_workers=2, max_workers=2),
        interval_s=0.2,
        drain_timeout_s=30,
    )
    supervisor = Supervisor(settings, child_main)
    stop = threading.Event()
    thread = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    thread.start()
    keys = QueueKeys("q")
    wait_until(lambda: len(read_heartbeats(redis_client, keys)) == 2, 60, "two workers")
    producer = Producer(redis_url, "q")
    rids = producer.submit_many([np.full((1, 4), i, np.float32) for i in range(2000)])
    wait_until(
        lambda: sum(redis_client.exists(keys.reply(r)) for r in rids[:100]) >= 10,
        30,
        "the fleet to answer its first requests",
    )
    stop.set()  # mid-flow
    thread.join(60)
    assert not any(s.alive for s in supervisor.slots)
    group = redis_client.xinfo_groups(keys.requests)[0]
    assert group["pending"] == 0  # every delivered entry was answered before the workers left
    assert redis_client.xinfo_consumers(keys.requests, GROUP) == []  # and they left the group
    answered = sum(redis_client.llen(keys.reply(r)) for r in rids)
    assert answered + group["lag"] == 2000  # answered once each, or still queued for the next fleet
    assert group["lag"] > 0, "the fleet answered everything before the stop: nothing was mid-flow"
    assert all(redis_client.llen(keys.reply(r)) <= 1 for r in rids)


@pytest.mark.slow
@pytest.mark.timeout(240)  # waits of up to 60 + 10 + 30 + 60 s
def test_a_second_signal_kills_the_draining_workers(redis_url, redis_client, monkeypatch, tmp_path):
    import subprocess
    import sys

    from tests.conftest import worker_env

    env = {**worker_env(redis_url), "STALL_S": "30"}  # a batch that would take 30 s to drain
    log_path = tmp_path / "supervise.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferfleet",
                "supervise",
                "--name",
                "q",
                "--model",
                "tests.handlers:Stall",
                "--devices",
                "cpu",
                "--policy",
                "fixed",
                "--min-workers",
                "1",
                "--max-workers",
                "1",
                "--interval-s",
                "0.2",
                "--log-level",
                "info",  # the first signal's line is an info line
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        keys = QueueKeys("q")
        wait_until(lambda: len(read_heartbeats(redis_client, keys)) == 1, 60, "the worker")
        child = read_heartbeats(redis_client, keys)[0].pid
        Producer(redis_url, "q").submit(np.full((1, 4), STALL, np.float32))
        wait_until(
            lambda: redis_client.xpending(keys.requests, GROUP)["pending"] == 1,
            10,
            "the batch to start",
        )
        proc.send_signal(signal.SIGTERM)  # drain: would wait for the 30 s batch
        wait_until(
            lambda: "SIGTERM received: draining every worker" in log_path.read_text(),
            30,
            "the supervisor to take the first signal",
        )
        # the signal was taken, and still the supervisor and its worker run: they drain
        assert proc.poll() is None, log_path.read_text()
        os.kill(child, 0)
        proc.send_signal(signal.SIGTERM)  # second signal: kill now
        proc.wait(60)
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
        # killed, not drained: the 30 s batch never finished (a drain would have answered and
        # acknowledged it before exiting), and the request was not lost: it stays pending for
        # the next fleet to take over
        assert redis_client.xpending(keys.requests, GROUP)["pending"] == 1
        assert not redis_client.keys("inferfleet:{q}:reply:*")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_reply(producer: Producer, rid: str, timeout_s: float):
    """The reply to ``rid``, waited for in short polls (each within the client's socket timeout)."""
    from inferfleet.producer.errors import ReplyTimeout

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return producer.result(rid, timeout_s=2, raise_errors=False)
        except ReplyTimeout:
            if time.monotonic() > deadline:
                raise


@pytest.mark.slow
@pytest.mark.timeout(480)  # up to 4 x 90 s for the replies, and the fixture's 60 s stop
def test_a_worker_whose_device_broke_is_restarted_and_the_culprit_dead_lettered(
    run_supervisor, redis_url, redis_client, caplog
):
    """A device-side assert (simulated): the worker exits with status 4 instead of answering
    model_error to everything; each restart replays its entries one at a time, so the batch-mates
    are answered and the request that breaks the device is dead-lettered at the delivery limit."""
    from tests.handlers import POISON

    producer = Producer(
        redis_url, "q", default_deadline_s=None
    )  # three worker starts may take a while
    inputs = [np.full((1, 4), POISON if i == 1 else i, np.float32) for i in range(4)]
    rids = producer.submit_many(
        inputs
    )  # queued before the worker starts: one batch with the culprit
    policy = PolicySettings(kind="fixed", min_workers=1, max_workers=1)
    with caplog.at_level(logging.WARNING, logger="inferfleet.worker.fleet.supervisor"):
        supervisor = run_supervisor(
            "tests.handlers:BreaksDevice", policy, worker={"max_deliveries": 2}
        )
        replies = [_wait_reply(producer, rid, 90) for rid in rids]
    for i, reply in enumerate(replies):
        if i == 1:
            assert not reply.ok and reply.error_code == "dead_letter"
        else:
            assert reply.ok, reply.error_message
            np.testing.assert_array_equal(reply.outputs, inputs[i] * 2)
    assert redis_client.xlen(QueueKeys("q").dead) == 1
    assert (
        "exit status 4: its GPU broke" in caplog.text
    )  # it exited as a broken device, and was restarted
    assert not supervisor.slots[0].disabled
