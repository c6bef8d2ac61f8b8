"""A supervisor SIGKILLed (not its group) and started again does not double the fleet.

Its workers notice their supervisor's death and drain; the new supervisor
names its workers afresh and starts no more than ``--max-workers``; a third
supervisor of the same queue on the same host is refused while the second
lives; nothing is left running once the second stops, and every request
accepted meanwhile is answered exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from inferfleet.producer import Producer, errors
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.fleet.succession import pid_alive
from inferfleet.worker.heartbeat import read_heartbeats
from tests.conftest import ROOT, stop_process, worker_env
from tests.helpers import wait_until

KEYS = QueueKeys("q")
MAX_WORKERS = 2


def supervise(redis_url: str, models_dir: Path, log_path: Path) -> subprocess.Popen:
    """The supervisor as docs/operations.md starts one (``--devices auto --policy lag``), held at
    MAX_WORKERS by ``--min-workers`` = ``--max-workers``: the lag policy's answer is clamped to
    them, so the fleet's size is the test's to know whatever the load (a GPU-less machine's auto
    is the CPU)."""
    cmd = [
        sys.executable,
        "-m",
        "inferfleet",
        "supervise",
        "--name",
        "q",
        "--model",
        str(models_dir / "affine.pt"),
        "--policy",
        "lag",
        "--min-workers",
        str(MAX_WORKERS),
        "--max-workers",
        str(MAX_WORKERS),
        "--devices",
        "auto",
        "--interval-s",
        "0.2",
        "--heartbeat-s",
        "0.2",
        "--idle-block-ms",
        "100",
        "--warmup-iters",
        "1",
    ]
    with open(log_path, "ab") as stderr:
        return subprocess.Popen(
            cmd, env=worker_env(redis_url), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr
        )


class FleetWatch:
    """Samples the live heartbeats whose process is alive: the workers that serve the queue."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.most = 0
        self.pids: set[int] = set()
        self.consumers: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def serving(self) -> dict[str, int]:
        return {b.consumer: b.pid for b in read_heartbeats(self.client, KEYS) if pid_alive(b.pid)}

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            now = self.serving()
            self.most = max(self.most, len(set(now.values())))
            self.pids |= set(now.values())
            self.consumers |= set(now)

    def __enter__(self) -> FleetWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.slow
def test_a_restarted_supervisor_does_not_double_the_fleet(
    redis_url, redis_client, models_dir, tmp_path
):
    log_path = tmp_path / "supervisors.log"
    producer = Producer(redis_url, "q")
    accepted: list[str] = []
    stop_load = threading.Event()

    def load() -> None:  # about 100 requests a second throughout
        while not stop_load.wait(0.01):
            try:
                accepted.append(producer.submit(np.ones((1, 16), np.float32)))
            except errors.InferfleetError:
                pass

    first = supervise(redis_url, models_dir, log_path)
    second = third = None
    loader = threading.Thread(target=load, daemon=True)
    try:
        with FleetWatch(redis_client) as watch:
            wait_until(lambda: len(watch.serving()) == MAX_WORKERS, 90, "the first fleet")
            first_pids = set(watch.serving().values())
            loader.start()
            time.sleep(1.0)
            first.kill()  # SIGKILL the supervisor only: its workers are not signalled by anyone
            first.wait(10)
            wait_until(
                lambda: not any(pid_alive(p) for p in first_pids),
                60,
                "the dead supervisor's workers to drain and exit on their own",
            )
            second = supervise(redis_url, models_dir, log_path)
            wait_until(lambda: len(watch.serving()) == MAX_WORKERS, 90, "the second fleet")
            third = supervise(redis_url, models_dir, log_path)
            assert third.wait(60) == 1  # refused: the second one manages q on this host
            time.sleep(1.0)
            stop_load.set()
            loader.join(10)
            replies = producer.results(accepted, timeout_s=60)
            stop_process(second, timeout_s=60)
        assert second.returncode == 0
    finally:
        stop_load.set()
        for proc in (first, second, third):
            if proc is not None:
                stop_process(proc)
    log = log_path.read_text(errors="replace")
    assert watch.most <= MAX_WORKERS, log  # never more worker processes serving than --max-workers
    assert (
        len(watch.consumers) == 2 * MAX_WORKERS
    )  # the second fleet's names are new, not the first's
    assert "already manages queue q" in log
    assert not any(pid_alive(pid) for pid in watch.pids)  # nothing left running
    assert [r.error_code for r in replies if not r.ok] == []
    assert not any(
        redis_client.exists(KEYS.reply(rid)) for rid in accepted
    )  # no second reply anywhere
    assert redis_client.xlen(KEYS.dead) == 0
    assert os.getpid() not in watch.pids


@pytest.mark.slow
def test_a_worker_whose_supervisor_dies_drains_and_exits(
    redis_url, redis_client, models_dir, tmp_path
):
    """Without a successor: the orphans leave the group and stop on their own."""
    proc = supervise(redis_url, models_dir, tmp_path / "supervisor.log")
    try:
        watch = FleetWatch(redis_client)
        wait_until(lambda: len(watch.serving()) == MAX_WORKERS, 90, "the fleet")
        pids = set(watch.serving().values())
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not any(pid_alive(p) for p in pids), 60, "the orphans to exit")
    finally:
        stop_process(proc)
    assert read_heartbeats(redis_client, KEYS) == []  # they drained: heartbeats removed
    assert redis_client.xinfo_consumers(KEYS.requests, "workers") == []  # and left the group
