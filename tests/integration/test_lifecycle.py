"""Model hot swap: publish/rollback, the double-checked version, in-flight batches, the cache, a
swap under load."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import redis

from inferfleet.producer import Producer, Reply, errors
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.heartbeat import read_heartbeats
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.alerts import read_alerts
from inferfleet.worker.serving.consumer import Consumer
from inferfleet.worker.serving.lifecycle import (
    ModelWatcher,
    NoPreviousVersion,
    mark_served,
    publish,
    read_published,
    rollback,
)
from tests.conftest import ROOT, worker_env

SCALE, TRIPLE = "tests.handlers:Scale", "tests.handlers:Triple"
FACTOR = {"scale-1": 2.0, "triple-1": 3.0}


def swap_cli(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferfleet", "swap", "--name", "q", *args],
        env=worker_env(redis_url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_publish_keeps_the_previous_version_for_rollback(redis_client):
    keys = QueueKeys("q")
    with pytest.raises(NoPreviousVersion):
        rollback(redis_client, keys)
    first = publish(redis_client, keys, "b.pt", "v2", serving=("a.pt", "v1"))
    assert (first.model, first.version, first.previous_model, first.previous_version) == (
        "b.pt",
        "v2",
        "a.pt",
        "v1",
    )
    assert first.served_version == "v1"  # what the live workers served counts as served
    assert mark_served(redis_client, keys, first)  # a worker switched to v2
    second = publish(redis_client, keys, "c.pt", "v3")
    assert (second.previous_version, second.seq) == ("v2", first.seq + 1)
    back = rollback(redis_client, keys)
    assert (back.version, back.previous_version, back.seq) == ("v2", "v3", second.seq + 1)
    assert read_published(redis_client, keys) == back


def test_rollback_returns_to_the_last_version_served_never_one_that_failed(redis_client):
    keys = QueueKeys("q")
    v2 = publish(redis_client, keys, "b.pt", "v2", serving=("a.pt", "v1"))
    mark_served(redis_client, keys, v2)
    publish(redis_client, keys, "broken.pt", "v3")  # no worker could load it: never served
    stale = publish(redis_client, keys, "other.pt", "v4")
    assert not mark_served(
        redis_client, keys, v2
    )  # a late report of a version no longer published is ignored
    back = rollback(redis_client, keys)
    assert (back.model, back.version, back.previous_version) == ("b.pt", "v2", "v4")  # not v3
    assert not mark_served(redis_client, keys, stale)
    mark_served(redis_client, keys, back)  # already the last served: nothing moves
    again = rollback(redis_client, keys)  # from a served version: the one served before it
    assert (again.model, again.version) == ("a.pt", "v1")


class GatedLoader:
    """Stands in for load_runtime: each load waits for the test to release it."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gate = threading.Semaphore(0)

    def __call__(self, settings: WorkerSettings) -> object:
        self.started.append(settings.model_version or "")
        self.gate.acquire(timeout=10)
        if settings.model == "broken":
            raise ModelLoadError("bad file")
        return settings.model_version


def wait_taken(watcher: ModelWatcher) -> tuple:
    for _ in range(200):
        outcome = watcher.take()
        if outcome[0] != "none":
            return outcome
        time.sleep(0.01)
    raise AssertionError("the load never finished")


def test_a_version_that_moved_on_while_loading_is_dropped(redis_client):
    keys = QueueKeys("q")
    loader = GatedLoader()
    watcher = ModelWatcher(redis_client, keys, WorkerSettings(name="q", model="a"), loader)
    publish(redis_client, keys, "b", "v2")
    assert watcher.poll("v1").version == "v2"  # first check: new version, start loading
    publish(redis_client, keys, "c", "v3")  # published while v2 loads
    assert watcher.poll("v1") is None  # one load at a time
    loader.gate.release()
    outcome, published, _ = wait_taken(watcher)
    assert (outcome, published.version) == ("stale", "v2")  # second check: not current any more
    assert watcher.poll("v1").version == "v3"
    loader.gate.release()
    outcome, published, runtime = wait_taken(watcher)
    assert (outcome, runtime) == ("ok", "v3")
    assert watcher.poll("v3") is None  # nothing newer


def test_a_failed_load_is_reported_once_and_not_retried(redis_client):
    keys = QueueKeys("q")
    loader = GatedLoader()
    watcher = ModelWatcher(redis_client, keys, WorkerSettings(name="q", model="a"), loader)
    publish(redis_client, keys, "broken", "v2")
    watcher.poll("v1")
    loader.gate.release()
    outcome, _, error = wait_taken(watcher)
    assert (
        outcome == "failed" and "bad file" in str(error) and watcher.error == "version v2: bad file"
    )
    assert watcher.poll("v1") is None and loader.started == ["v2"]


def run_load(producer: Producer, stop: threading.Event, log: list) -> None:
    """Closed loop of small batches; logs (submitted_at, input first value, reply)."""
    i = 0
    while not stop.is_set():
        xs = [np.array([[i + k, 1.0, 1.0, 1.0]], dtype=np.float32) for k in range(20)]
        sent = time.monotonic()
        for x, reply in zip(xs, producer.map(xs, timeout_s=30)):
            log.append((sent, x, reply))
        i += 20


def test_swap_under_load_loses_nothing_and_each_reply_names_its_version(
    redis_url, redis_client, spawn_worker
):
    for _ in range(2):
        spawn_worker("q", SCALE, "--max-wait-ms", "2")
    log: list = []
    stop = threading.Event()
    with Producer(redis_url, "q") as producer:
        load = threading.Thread(target=run_load, args=(producer, stop, log))
        load.start()
        try:
            time.sleep(0.5)
            swapped = swap_cli(redis_url, "--model", TRIPLE, "--wait-s", "30")
            assert swapped.returncode == 0, swapped.stdout + swapped.stderr
            after_swap = time.monotonic()
            time.sleep(0.5)
            rollback_started = time.monotonic()
            rolled = swap_cli(redis_url, "--rollback", "--wait-s", "30")
            assert rolled.returncode == 0, rolled.stdout + rolled.stderr
            after_rollback = time.monotonic()
            time.sleep(0.5)
        finally:
            stop.set()
            load.join(60)
    assert len(log) > 100
    versions = {}
    for sent, x, reply in log:
        assert reply.ok, reply.error_message
        # the version in the reply is the one that computed the outputs
        assert np.array_equal(reply.outputs, x * FACTOR[reply.model_version]), reply.model_version
        versions.setdefault(reply.model_version, 0)
        versions[reply.model_version] += 1
        if after_swap < sent and sent + 0.001 < rollback_started:
            assert reply.model_version == "triple-1"  # once every worker switched, none goes back
        if sent > after_rollback:
            assert reply.model_version == "scale-1"
    assert versions["triple-1"] > 0 and versions["scale-1"] > 0
    assert "triple-1 (tests.handlers:Triple) published" in swapped.stdout
    assert (
        "previous scale-1" in swapped.stdout
    )  # the version live workers served: the rollback target


def test_a_failed_swap_keeps_the_old_model_and_says_why(redis_url, redis_client, spawn_worker):
    spawn_worker("q", SCALE)
    bad = swap_cli(
        redis_url,
        "--model",
        "tests.handlers:Missing",
        "--version",
        "v9",
        "--no-check",
        "--wait-s",
        "20",
    )
    assert bad.returncode == 1
    assert "FAILED" in bad.stdout and "Missing" in bad.stdout
    with Producer(redis_url, "q") as producer:
        reply = producer.result(producer.submit(np.ones((1, 4), dtype=np.float32)), 10)
    assert reply.model_version == "scale-1" and np.array_equal(reply.outputs, np.full((1, 4), 2.0))
    (alert,) = read_alerts(redis_client, QueueKeys("q"), kind="swap_failed")
    assert "v9" in alert.detail
    (info,) = read_heartbeats(redis_client, QueueKeys("q"))
    assert info.version == "scale-1" and "v9" in info.swap_error
    shown = subprocess.run(
        [sys.executable, "-m", "inferfleet", "status", "--name", "q"],
        capture_output=True,
        env={**worker_env(redis_url), "COLUMNS": "300"},
        cwd=ROOT,
        text=True,
        check=True,
    ).stdout
    assert "swap failed: version v9" in shown


def test_a_worker_started_after_a_swap_serves_the_published_version(
    redis_url, redis_client, spawn_worker
):
    publish(redis_client, QueueKeys("q"), TRIPLE, "triple-1", serving=(SCALE, "scale-1"))
    spawn_worker("q", SCALE)  # its --model is the old one
    with Producer(redis_url, "q") as producer:
        reply = producer.result(producer.submit(np.ones((1, 4), dtype=np.float32)), 10)
    assert reply.model_version == "triple-1" and np.array_equal(reply.outputs, np.full((1, 4), 3.0))


def test_swap_refuses_bad_input(redis_url, redis_client):
    assert "either --model" in swap_cli(redis_url).stderr
    assert "does not exist" in swap_cli(redis_url, "--model", "/nope/model.pt").stderr
    broken = swap_cli(redis_url, "--model", "tests.handlers:Missing")
    assert broken.returncode == 2 and "does not load" in broken.stderr
    assert "no earlier version" in swap_cli(redis_url, "--rollback").stderr
    assert "--version" in swap_cli(redis_url, "--model", SCALE, "--version", "").stderr
    assert "--version" in swap_cli(redis_url, "--model", SCALE, "--version", "v 2").stderr
    assert read_published(redis_client, QueueKeys("q")) is None  # nothing was published


# six swap commands (each imports torch) and two workers: about two minutes on 2 cores
@pytest.mark.slow
def test_the_swap_sequence_ends_on_the_version_the_fleet_served(
    redis_url, redis_client, spawn_worker
):
    """v2 (good), v3 (broken, --no-check), v4 (another signature), rollback: the fleet is back on
    v2, also a worker started afterwards."""
    worker = spawn_worker("q", SCALE)
    assert swap_cli(redis_url, "--model", TRIPLE, "--wait-s", "30").returncode == 0
    broken = swap_cli(
        redis_url,
        "--model",
        "tests.handlers:Missing",
        "--version",
        "v3",
        "--no-check",
        "--wait-s",
        "20",
    )
    assert broken.returncode == 1 and "FAILED" in broken.stdout
    wide = swap_cli(redis_url, "--model", "tests.handlers:Wide", "--wait-s", "5")
    assert (
        wide.returncode == 2
        and "float32[N,8] is not the one the fleet serves, float32[N,4]" in wide.stderr
    )
    halves = swap_cli(redis_url, "--model", "tests.handlers:Halves", "--wait-s", "5")
    assert halves.returncode == 2 and "outputs float32[N,2]" in halves.stderr
    assert (
        read_published(redis_client, QueueKeys("q")).version == "v3"
    )  # neither check published anything
    rolled = swap_cli(redis_url, "--rollback", "--wait-s", "30")
    assert rolled.returncode == 0 and "version triple-1" in rolled.stdout, (
        rolled.stdout + rolled.stderr
    )
    with Producer(redis_url, "q") as producer:
        assert (
            producer.result(producer.submit(np.ones((1, 4), np.float32)), 20).model_version
            == "triple-1"
        )
        worker.kill()  # a restarted worker: its --model is v1, the fleet's version is v2
        worker.wait(10)
        spawn_worker("q", SCALE, consumer="restarted")
        replies = producer.map([np.ones((1, 4), np.float32)] * 20, timeout_s=30)
    assert {r.model_version for r in replies} == {"triple-1"}


def test_a_worker_that_cannot_load_the_published_version_serves_nothing_and_says_so(
    redis_url, redis_client, tmp_path
):
    keys = QueueKeys("q")
    publish(redis_client, keys, "tests.handlers:Missing", "v3", serving=(SCALE, "scale-1"))
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferfleet",
                "worker",
                "--name",
                "q",
                "--model",
                SCALE,
                "--consumer",
                "w1",
                "--heartbeat-s",
                "0.2",
                "--housekeeping-s",
                "0.2",
            ],
            env=worker_env(redis_url),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        producer = Producer(redis_url, "q")
        rid = producer.submit(np.ones((1, 4), np.float32))
        deadline = time.monotonic() + 60
        while not [h for h in read_heartbeats(redis_client, keys) if h.state == "cannot-load"]:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        (info,) = read_heartbeats(redis_client, keys)
        assert "v3" in info.swap_error and info.version == "none"
        (alert,) = read_alerts(redis_client, keys, kind="swap_failed")
        assert "v3" in alert.detail and alert.consumer == "w1"
        shown = subprocess.run(
            [sys.executable, "-m", "inferfleet", "status", "--name", "q"],
            capture_output=True,
            env={**worker_env(redis_url), "COLUMNS": "300"},
            cwd=ROOT,
            text=True,
        ).stdout
        assert "swap failed: version v3" in shown
        with pytest.raises(
            errors.ReplyTimeout
        ):  # it serves nothing: not v3, and not its --model either
            producer.result(rid, timeout_s=2)
        assert (
            swap_cli(redis_url, "--rollback", "--wait-s", "0").returncode == 0
        )  # back to scale-1: it joins
        assert producer.result(rid, timeout_s=60).model_version == "scale-1"
        assert "CANNOT SERVE" in log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_batch_in_flight_during_a_swap_finishes_and_answers_on_the_old_copy(
    redis_url, redis_client
):
    """Deterministic: the batch blocks mid-forward-pass, the swap is published and loaded
    meanwhile, then the batch is let go. Its replies carry and name the old version; the
    next batch is computed and named by the new one."""
    from tests.handlers import GATE, Gate

    Gate.entered.clear()
    Gate.release.clear()
    keys = QueueKeys("q")
    settings = WorkerSettings(
        name="q",
        model="tests.handlers:Gate",
        redis_url=redis_url,
        consumer="c1",
        warmup_iters=0,
        idle_block_ms=50,
    )
    client = redis.Redis.from_url(redis_url)
    watcher = ModelWatcher(client, keys, settings, load_runtime)
    consumer = Consumer(settings, load_runtime(settings), client, watcher=watcher)
    consumer.prepare()
    held = [np.full((1, 4), value, np.float32) for value in (GATE, 1.0, 2.0)]
    with Producer(redis_url, "q") as producer:
        held_ids = producer.submit_many(held)
        in_flight = threading.Thread(target=consumer.run_once)
        in_flight.start()
        try:
            assert Gate.entered.wait(30), "the batch never started"
            publish(client, keys, TRIPLE, "triple-1", serving=(settings.model, "scale-1"))
            assert (
                watcher.poll(consumer.runtime.version).version == "triple-1"
            )  # housekeeping's first check
            for loading in [t for t in threading.enumerate() if t.name == "swap-triple-1"]:
                loading.join(60)  # the new copy is loaded while the batch is still held
            assert in_flight.is_alive()
        finally:
            Gate.release.set()
            in_flight.join(30)
        for x, reply in zip(held, producer.results(held_ids, timeout_s=5)):
            assert reply.model_version == "scale-1", (
                reply.model_version
            )  # named by the old version ...
            assert np.array_equal(reply.outputs, x * 2)  # ... and computed by it
            assert reply.timing["batch_rows"] == 3  # all three in the held batch
        after = [np.full((1, 4), value, np.float32) for value in (3.0, 4.0)]
        after_ids = producer.submit_many(after)
        consumer.run_once()  # switches between rounds, then computes
        for x, reply in zip(after, producer.results(after_ids, timeout_s=5)):
            assert reply.model_version == "triple-1" and np.array_equal(reply.outputs, x * 3)
    assert consumer.runtime.version == "triple-1"
    client.close()


def swap_in_process(client: redis.Redis, consumer: Consumer, watcher: ModelWatcher) -> None:
    """What a worker's housekeeping and next round do: publish Triple, load it, switch to it."""
    publish(
        client,
        QueueKeys("q"),
        TRIPLE,
        "triple-1",
        serving=(consumer.model_source, consumer.runtime.version),
    )
    assert watcher.poll(consumer.runtime.version).version == "triple-1"
    for loading in [t for t in threading.enumerate() if t.name == "swap-triple-1"]:
        loading.join(60)
    consumer.run_once()  # switches between rounds (nothing queued: an idle round)


def test_the_local_cache_is_not_served_after_a_swap(redis_url, redis_client):
    """--cache-size without the fleet tier, in-process: a repeated input after the swap is computed
    by the new version; then the new version's result is cached."""
    settings = WorkerSettings(
        name="q",
        model=SCALE,
        redis_url=redis_url,
        consumer="c1",
        warmup_iters=0,
        idle_block_ms=50,
        cache_size=64,
    )
    client = redis.Redis.from_url(redis_url)
    watcher = ModelWatcher(client, QueueKeys("q"), settings, load_runtime)
    consumer = Consumer(settings, load_runtime(settings), client, watcher=watcher)
    consumer.prepare()
    x = np.full((1, 4), 1.5, np.float32)
    with Producer(redis_url, "q") as producer:

        def ask() -> Reply:
            rid = producer.submit(x)
            consumer.run_once()
            return producer.result(rid, 5)

        first, cached = ask(), ask()
        assert (first.timing["batch_rows"], cached.timing["batch_rows"]) == (
            1,
            0,
        )  # the repeat: a cache hit
        assert np.array_equal(cached.outputs, x * 2) and cached.model_version == "scale-1"
        swap_in_process(client, consumer, watcher)
        after, cached_after = ask(), ask()
    assert (after.model_version, after.timing["batch_rows"]) == (
        "triple-1",
        1,
    )  # computed, not a hit
    assert np.array_equal(after.outputs, x * 3)
    assert cached_after.timing["batch_rows"] == 0 and np.array_equal(cached_after.outputs, x * 3)
    client.close()


def wait_serving(client: redis.Redis, version: str, timeout_s: float = 60.0) -> None:
    """Until every worker's heartbeat names ``version`` (it switched)."""
    deadline = time.monotonic() + timeout_s
    while {beat.version for beat in read_heartbeats(client, QueueKeys("q"))} != {version}:
        assert time.monotonic() < deadline, f"the workers never switched to {version}"
        time.sleep(0.05)


def test_the_fleet_cache_is_not_served_after_a_swap(redis_url, redis_client, spawn_worker):
    """A worker with --cache-size and --fleet-cache-ttl-s across a hot swap: the model version is
    part of the cache key, so a repeated input after the swap is computed by the new version, never
    answered from what the old one left in Redis (the swap empties the worker's local tier, not
    Redis)."""
    spawn_worker(
        "q", SCALE, "--max-wait-ms", "1", "--cache-size", "64", "--fleet-cache-ttl-s", "60"
    )
    x = np.full((1, 4), 1.5, np.float32)
    with Producer(redis_url, "q") as producer:

        def ask() -> Reply:
            return producer.result(producer.submit(x), 20)

        first, cached = ask(), ask()
        assert (first.timing["batch_rows"], cached.timing["batch_rows"]) == (
            1,
            0,
        )  # the repeat: a cache hit
        assert np.array_equal(cached.outputs, x * 2) and cached.model_version == "scale-1"
        assert len(redis_client.keys("inferfleet:{q}:cache:*")) == 1
        publish(
            redis_client, QueueKeys("q"), TRIPLE, "triple-1", serving=(SCALE, "scale-1")
        )  # what `swap` does
        wait_serving(redis_client, "triple-1")
        after, cached_after = ask(), ask()
    assert (after.model_version, after.timing["batch_rows"]) == (
        "triple-1",
        1,
    )  # computed, not a hit
    assert np.array_equal(after.outputs, x * 3)
    assert cached_after.timing["batch_rows"] == 0 and np.array_equal(cached_after.outputs, x * 3)
    assert len(redis_client.keys("inferfleet:{q}:cache:*")) == 2  # one entry per version
