"""The result cache and the result checks, on real workers over a real Redis."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from inferfleet.producer import Producer
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.heartbeat import read_heartbeats
from inferfleet.worker.serving.alerts import read_alerts
from tests.conftest import ROOT, stop_process, worker_env
from tests.helpers import wait_until


def row(*values: float) -> np.ndarray:
    return np.array([values], dtype=np.float32)


def ask(producer: Producer, x: np.ndarray):
    return producer.result(producer.submit(x), 10, raise_errors=False)


def test_identical_inputs_are_answered_from_the_cache(redis_url, redis_client, spawn_worker):
    spawn_worker("cached", "tests.handlers:CallCounter", "--cache-size", "100")
    spawn_worker("plain", "tests.handlers:CallCounter")
    with Producer(redis_url, "cached") as cached, Producer(redis_url, "plain") as plain:
        first, again = ask(cached, row(1, 2, 3, 4)), ask(cached, row(1, 2, 3, 4))
        other = ask(cached, row(5, 6, 7, 8))
        assert np.array_equal(first.outputs, again.outputs)  # the same call answered both
        assert first.timing["batch_rows"] == 1 and again.timing["batch_rows"] == 0
        assert other.outputs[0, 0] > first.outputs[0, 0]  # a new input is computed
        # without the cache, the same input is computed again
        assert ask(plain, row(1, 2, 3, 4)).outputs[0, 0] < ask(plain, row(1, 2, 3, 4)).outputs[0, 0]
    # three lookups: the repeat hit, the first and the new input missed. A heartbeat sent between
    # the
    # lookups shows a partial rate (1/2 after two), so wait for the one sent after all three.
    deadline = time.monotonic() + 5  # the heartbeat publishes once a second
    while (rate := read_heartbeats(redis_client, QueueKeys("cached"))[0].cache_hit_rate) != round(
        1 / 3, 4
    ):
        assert time.monotonic() < deadline, (
            f"the heartbeat shows a cache hit rate of {rate}, not 1/3"
        )
        time.sleep(0.1)
    shown = subprocess.run(
        [sys.executable, "-m", "inferfleet", "status", "--name", "cached"],
        capture_output=True,
        env={**worker_env(redis_url), "COLUMNS": "250"},
        cwd=ROOT,
        text=True,
        check=True,
    ).stdout
    assert "cache hits" in shown and "33%" in shown
    (no_cache,) = read_heartbeats(redis_client, QueueKeys("plain"))
    assert no_cache.cache_hit_rate is None


def test_duplicates_in_one_batch_are_computed_once(redis_url, redis_client, spawn_worker):
    with Producer(redis_url, "q") as producer:
        # queued before any worker starts: the first read takes all eleven together
        rids = producer.submit_many([row(1, 1, 1, 1)] * 10 + [row(2, 2, 2, 2)])
        spawn_worker(
            "q", "tests.handlers:CallCounter", "--cache-size", "100", "--max-wait-ms", "20"
        )
        replies = producer.results(rids, 10)
    calls = {float(r.outputs[0, 0]) for r in replies}
    assert len(calls) == 1  # one forward pass...
    assert all(r.outputs[0, 1] == 2 for r in replies)  # ...of 2 rows: the duplicates were not in it


def test_the_fleet_cache_serves_another_worker(redis_url, redis_client, spawn_worker):
    args = ("--cache-size", "100", "--fleet-cache-ttl-s", "60")
    first = spawn_worker("q", "tests.handlers:CallCounter", *args, consumer="first")
    with Producer(redis_url, "q") as producer:
        computed = ask(producer, row(3, 3, 3, 3))
        first.terminate()
        first.wait(10)
        spawn_worker("q", "tests.handlers:CallCounter", *args, consumer="second")
        shared = ask(producer, row(3, 3, 3, 3))
    assert shared.timing["batch_rows"] == 0 and np.array_equal(shared.outputs, computed.outputs)
    assert len(redis_client.keys("inferfleet:{q}:cache:*")) == 1


def test_nan_outputs_are_a_model_error_and_an_alert(redis_url, redis_client, spawn_worker):
    with Producer(redis_url, "q") as producer:
        rids = producer.submit_many([row(1, 1, 1, 1), row(-1, 1, 1, 1), row(2, 2, 2, 2)])
        spawn_worker("q", "tests.handlers:NanOnNegative", "--max-wait-ms", "20")
        good, bad, good_too = producer.results(rids, 10)
    assert good.ok and good_too.ok and np.array_equal(good_too.outputs, row(4, 4, 4, 4))
    assert not bad.ok and bad.error_code == "model_error" and "NaN" in bad.error_message
    (alert,) = read_alerts(redis_client, QueueKeys("q"))
    assert (alert.kind, alert.rid, alert.version) == ("non_finite", rids[1], "scale-1")


def test_alerts_follow_prints_each_new_alert_of_its_kind(
    redis_url, redis_client, spawn_worker, tmp_path
):
    """docs/operations.md's ``inferfleet alerts --name ctr --kind non_finite --follow``: it keeps
    running and prints the alerts raised after it started, of its kind only."""
    spawn_worker("q", "tests.handlers:NanOnNegative", "--min-confidence", "0.99")
    printed = tmp_path / "alerts.txt"
    with open(printed, "w") as out:
        follow = subprocess.Popen(
            [sys.executable, "-m", "inferfleet", "alerts", "--name", "q"]
            + ["--kind", "non_finite", "--follow"],
            env={**worker_env(redis_url), "PYTHONUNBUFFERED": "1"},
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.PIPE,
        )
    try:
        with Producer(redis_url, "q") as producer:
            # a low_confidence alert (a top score of 0.2) is not its kind; each NaN row is, sent
            # until one arrives after the command has taken the stream's newest entry
            assert ask(producer, row(0.1, 0.1, 0.1, 0.1)).ok

            def followed() -> bool:
                assert follow.poll() is None, follow.stderr.read().decode()
                ask(producer, row(-1, 1, 1, 1))
                return "non_finite" in printed.read_text()

            wait_until(followed, 60, "a non_finite alert printed by --follow", every_s=0.5)
        assert follow.poll() is None  # still following
    finally:
        stop_process(follow)
        follow.stderr.close()
    lines = printed.read_text().splitlines()
    assert lines and all(" non_finite " in line for line in lines), lines
    kinds = {a.kind for a in read_alerts(redis_client, QueueKeys("q"))}
    assert kinds == {"non_finite", "low_confidence"}  # the other kind was raised, not printed


def test_low_confidence_is_answered_and_alerted(redis_url, redis_client, spawn_worker):
    spawn_worker("q", "tests.handlers:Probabilities", "--min-confidence", "0.9")
    with Producer(redis_url, "q") as producer:
        sure, unsure = ask(producer, row(10, 0, 0, 0)), ask(producer, row(0, 0, 0, 0))
    assert sure.ok and unsure.ok and np.allclose(unsure.outputs, 0.25)
    (alert,) = read_alerts(redis_client, QueueKeys("q"))
    assert alert.kind == "low_confidence" and alert.rid == unsure.id and "0.25" in alert.detail


def test_inconsistent_results_raise_an_alert(redis_url, redis_client, spawn_worker):
    spawn_worker("noisy", "tests.handlers:Noisy", "--consistency-tol", "1e-6")
    spawn_worker("steady", "tests.handlers:Scale", "--consistency-tol", "1e-6")
    with Producer(redis_url, "noisy") as noisy, Producer(redis_url, "steady") as steady:
        for producer in (noisy, steady):
            ask(producer, row(1, 2, 3, 4))
            ask(producer, row(1, 2, 3, 4))
    (alert,) = read_alerts(redis_client, QueueKeys("noisy"))
    assert alert.kind == "inconsistent"
    assert read_alerts(redis_client, QueueKeys("steady")) == []


def test_alerts_command(redis_url, redis_client, spawn_worker):
    spawn_worker("q", "tests.handlers:Probabilities", "--min-confidence", "0.9")
    with Producer(redis_url, "q") as producer:
        ask(producer, row(0, 0, 0, 0))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "inferfleet", "alerts", *args],
            env=worker_env(redis_url),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )

    shown = cli("--name", "q")
    assert (
        shown.returncode == 0
        and "low_confidence" in shown.stdout
        and "top score 0.25" in shown.stdout
    )
    assert "no alerts" in cli("--name", "q", "--kind", "non_finite").stdout
    assert cli("--name", "q", "--count", "0").returncode == 2
    assert cli("--name", "bad name!").returncode == 2
