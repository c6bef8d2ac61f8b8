"""Shadow and canary versions with real workers and a real redis-server (``inferfleet shadow``)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from inferfleet.producer import Producer
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.heartbeat import heartbeat_key, read_heartbeats
from inferfleet.worker.serving.alerts import read_alerts
from inferfleet.worker.serving.comparison import Thresholds
from inferfleet.worker.serving.lifecycle import read_published
from inferfleet.worker.serving.rollout import publish_candidate, read_candidate, read_pairs
from tests.conftest import ROOT, freeze_while_holding, stop_process, worker_env
from tests.helpers import wait_until

SCALE, TRIPLE, FRAGILE = "tests.handlers:Scale", "tests.handlers:Triple", "tests.handlers:Fragile"
SLOW = "tests.handlers:Slow"  # Scale (scale-1) taking SLOW_BATCH_S per batch
FAST = ("--housekeeping-s", "0.1", "--heartbeat-s", "0.1", "--max-wait-ms", "1")
KEYS = QueueKeys("q")
#: What a wait on the fleet (a load, a heartbeat, an alert) may take before it counts as a hang.
WAIT_S = 60

#: Each test starts worker processes and several CLI processes, each importing the worker side
#: (about 12 s apiece on the shared 2-core machine under load): more than the default 120 s in all.
pytestmark = pytest.mark.timeout(300)


def shadow_cli(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferfleet", "shadow", "--name", "q", *args],
        env=worker_env(redis_url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )


def report(redis_url: str) -> dict:
    done = shadow_cli(redis_url, "--report", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)["q"]


def shadow_states(client) -> list[str]:
    return [
        (client.hget(heartbeat_key(KEYS, w.consumer), "shadow") or b"").decode()
        for w in read_heartbeats(client, KEYS)
    ]


def loop_marks(client) -> set[bytes]:
    """The ``loop_ms`` of every worker's heartbeat: when each last started a round of its loop."""
    return {
        client.hget(heartbeat_key(KEYS, w.consumer), "loop_ms") or b""
        for w in read_heartbeats(client, KEYS)
    }


def wait_loaded(client, version: str, workers: int) -> None:
    wait_until(
        lambda: shadow_states(client).count(f"{version} loaded") == workers,
        WAIT_S,
        f"{workers} workers to load candidate {version}",
    )


def send(producer: Producer, values: range) -> list:
    """One request at a time (a batch each), so every share is a share of requests too."""
    replies = []
    for v in values:
        x = np.array([[float(v), 1.0, 2.0, 3.0]], dtype=np.float32)
        replies.append((x, producer.result(producer.submit(x), 30, raise_errors=False)))
    return replies


def compared(redis_url: str, client, at_least: int) -> dict:
    """The report's first pair once the fleet's totals hold ``at_least`` comparisons (polled
    in-process: each CLI call imports the worker side, slow on a loaded machine)."""

    def enough() -> bool:
        pairs = read_pairs(client, KEYS)
        return bool(pairs) and pairs[0][2].compared >= at_least

    wait_until(enough, WAIT_S, f"{at_least} requests compared")
    return report(redis_url)["pairs"][0]


def test_an_equal_candidate_agrees_fully_and_is_promoted(redis_url, redis_client, spawn_worker):
    spawn_worker("q", SCALE, *FAST)
    published = shadow_cli(
        redis_url,
        "--model",
        SCALE,
        "--version",
        "scale-2",
        "--sample",
        "1",
        "--min-compared",
        "20",
        "--no-check",
    )
    assert published.returncode == 0, published.stderr
    wait_loaded(redis_client, "scale-2", 1)
    with Producer(redis_url, "q") as producer:
        replies = send(producer, range(40))
        assert all(
            r.ok and r.model_version == "scale-1" for _, r in replies
        )  # the shadow never answers
        pair = compared(redis_url, redis_client, 40)
        assert (pair["live"], pair["candidate"]) == ("scale-1", "scale-2")
        assert (
            pair["agreement"] == 1.0
            and pair["abs_error_max"] == 0.0
            and pair["rel_error_max"] == 0.0
        )
        assert pair["candidate_errors"] == 0 and pair["verdict"] == "ok"
        promoted = shadow_cli(redis_url, "--promote", "--wait-s", "30")
        assert promoted.returncode == 0, promoted.stdout + promoted.stderr
        assert read_published(redis_client, KEYS).version == "scale-2"
        assert read_candidate(redis_client, KEYS).state == "promoted"
        x = np.ones((1, 4), dtype=np.float32)
        assert producer.result(producer.submit(x), 30).model_version == "scale-2"
    wait_until(
        lambda: shadow_states(redis_client) == [""], WAIT_S, "the promoted candidate to be unloaded"
    )
    assert not read_alerts(redis_client, KEYS, kind="shadow_divergence")


def test_promote_waits_for_the_comparisons_it_needs_then_decides(
    redis_url, redis_client, spawn_worker
):
    """Workers add comparisons once a housekeeping tick: --promote right after the traffic waits
    (up to --wait-s) for --min-compared of them instead of refusing on "nothing compared yet"."""
    spawn_worker("q", SCALE, *FAST)
    published = shadow_cli(
        redis_url,
        "--model",
        SCALE,
        "--version",
        "scale-2",
        "--sample",
        "1",
        "--min-compared",
        "20",
        "--no-check",
    )
    assert published.returncode == 0, published.stderr
    early = shadow_cli(redis_url, "--promote", "--wait-s", "0.5")  # no traffic: waits, then refuses
    assert early.returncode == 1 and "nothing compared yet" in early.stderr, (
        early.stdout + early.stderr
    )
    assert "waiting up to 0.5 s for 20 requests compared (0 so far)" in early.stdout
    # --promote first, the traffic once it says it waits: it must promote on comparisons made after
    # it started
    promote = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferfleet",
            "shadow",
            "--name",
            "q",
            "--promote",
            "--wait-s",
            "60",
        ],
        env=worker_env(redis_url),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "waiting up to 60 s for 20 requests compared (0 so far)" in promote.stdout.readline()
        with Producer(redis_url, "q") as producer:
            send(producer, range(30))
        out, err = promote.communicate(timeout=90)
    finally:
        stop_process(promote)
    assert promote.returncode == 0 and "candidate scale-2 promoted" in out, out + err
    assert read_published(redis_client, KEYS).version == "scale-2"


def test_a_scaled_candidate_diverges_alerts_and_is_refused_promotion(
    redis_url, redis_client, spawn_worker
):
    spawn_worker("q", SCALE, *FAST)
    published = shadow_cli(redis_url, "--model", TRIPLE, "--sample", "0.5", "--min-compared", "10")
    assert published.returncode == 0, published.stderr
    wait_loaded(redis_client, "triple-1", 1)
    with Producer(redis_url, "q") as producer:
        replies = send(producer, range(1, 41))
        assert all(
            r.ok and np.array_equal(r.outputs, x * 2) for x, r in replies
        )  # live answers, unchanged
    pair = compared(redis_url, redis_client, 20)
    assert pair["compared"] == 20  # half of the 40 batches, evenly
    assert pair["rel_error_max"] == 0.5 and pair["agreement"] == 1.0  # 3x against 2x: same argmax
    assert "relative error" in pair["verdict"]
    alerts = wait_until(
        lambda: read_alerts(redis_client, KEYS, kind="shadow_divergence"),
        WAIT_S,
        "the divergence alert",
    )
    assert len(alerts) == 1 and "triple-1 diverges from scale-1" in alerts[0].detail
    refused = shadow_cli(redis_url, "--promote", "--wait-s", "0")
    assert (
        refused.returncode == 1 and "not promoted" in refused.stderr and "--force" in refused.stderr
    )
    assert (
        read_published(redis_client, KEYS) is None
        and read_candidate(redis_client, KEYS).state == "shadow"
    )
    forced = shadow_cli(redis_url, "--promote", "--force", "--wait-s", "30")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert read_published(redis_client, KEYS).version == "triple-1"


def test_the_canary_answers_its_share_then_rolls_back_when_it_fails(
    redis_url, redis_client, spawn_worker
):
    spawn_worker("q", SCALE, *FAST)
    published = shadow_cli(
        redis_url,
        "--model",
        FRAGILE,
        "--version",
        "fragile-1",
        "--no-check",
        "--canary",
        "25",
        "--sample",
        "0.2",
        "--min-compared",
        "5",
        "--max-error-rate",
        "0.05",
    )
    assert published.returncode == 0, published.stderr
    wait_loaded(redis_client, "fragile-1", 1)
    with Producer(redis_url, "q") as producer:
        healthy = send(producer, range(80))
        by_version = Counter(r.model_version for _, r in healthy)
        assert by_version == {"scale-1": 60, "fragile-1": 20}  # 25% of the requests, one batch each
        assert all(r.ok and np.array_equal(r.outputs, x * 2) for x, r in healthy)
        assert read_candidate(redis_client, KEYS).state == "canary"
        failing = send(producer, range(1000, 1040))  # traffic the candidate fails on
        assert all(
            r.ok and r.model_version == "scale-1" for _, r in failing
        )  # recomputed on the live model
        cand = wait_until(
            lambda: (c := read_candidate(redis_client, KEYS)).state == "rolled_back" and c,
            WAIT_S,
            "the automatic rollback",
        )
        assert "canary failed" in cand.reason
        wait_until(
            lambda: shadow_states(redis_client) == [""], WAIT_S, "the candidate to be unloaded"
        )
        after = send(producer, range(20))
        assert {r.model_version for _, r in after} == {"scale-1"}
    rollback = read_alerts(redis_client, KEYS, kind="canary_rollback")
    assert len(rollback) == 1 and rollback[0].version == "fragile-1"
    pair = report(redis_url)["pairs"][0]
    assert pair["canary_requests"] >= 22 and pair["canary_failed"] >= 1 and pair["compared"] >= 4


def test_a_candidate_that_fails_to_load_leaves_the_live_model_serving(
    redis_url, redis_client, spawn_worker
):
    spawn_worker("q", SCALE, *FAST)
    published = shadow_cli(
        redis_url, "--model", "tests.handlers:NoSuchHandler", "--version", "v9", "--no-check"
    )
    assert published.returncode == 1 and ": v9 failed" in published.stdout, (
        published.stdout
    )  # waited, and says so
    alerts = wait_until(
        lambda: read_alerts(redis_client, KEYS, kind="shadow_failed"),
        WAIT_S,
        "the shadow_failed alert",
    )
    assert "v9" in alerts[0].detail
    # the state travels with the next heartbeat (every heartbeat_s), the alert at once: wait for it
    wait_until(
        lambda: shadow_states(redis_client) == ["v9 failed"],
        WAIT_S,
        "the heartbeat to show the failed load",
    )
    with Producer(redis_url, "q") as producer:
        replies = send(producer, range(5))
        assert all(r.ok and r.model_version == "scale-1" for _, r in replies), [
            (r.ok, r.model_version, r.error_message) for _, r in replies
        ]
    # several rounds of the loop, each with a housekeeping tick (every 0.1 s; an idle round
    # lasts 1 s), seen in the heartbeat's loop_ms: the load is not retried, the alert not repeated
    rounds: set[bytes] = set()
    wait_until(
        lambda: rounds.update(loop_marks(redis_client)) or len(rounds) > 3,
        WAIT_S,
        "three more rounds of the worker's loop",
    )
    assert len(read_alerts(redis_client, KEYS, kind="shadow_failed")) == 1
    assert shadow_states(redis_client) == ["v9 failed"]
    # the positive control: a second failing candidate is followed and alerted in the same way,
    # so a repeated load of v9 would have shown, and v9's alert is still the only one of its own
    again = shadow_cli(
        redis_url, "--model", "tests.handlers:NoSuchHandler", "--version", "v10", "--no-check"
    )
    assert again.returncode == 1 and ": v10 failed" in again.stdout, again.stdout
    alerts = wait_until(
        lambda: (found := read_alerts(redis_client, KEYS, kind="shadow_failed"))[1:] and found,
        WAIT_S,
        "the v10 shadow_failed alert",
    )
    assert sorted(a.version for a in alerts) == ["v10", "v9"]


@pytest.mark.slow
def test_a_worker_started_later_loads_the_candidate_and_stop_unloads_it(
    redis_url, redis_client, spawn_worker
):
    spawn_worker("q", SCALE, *FAST)
    assert (
        shadow_cli(
            redis_url, "--model", SCALE, "--version", "scale-2", "--sample", "1", "--no-check"
        ).returncode
        == 0
    )
    wait_loaded(redis_client, "scale-2", 1)
    spawn_worker("q", SCALE, *FAST)
    wait_loaded(redis_client, "scale-2", 2)
    stopped = shadow_cli(redis_url, "--stop")
    assert stopped.returncode == 0 and "candidate stopped" in stopped.stdout
    wait_until(
        lambda: shadow_states(redis_client) == ["", ""],
        WAIT_S,
        "every worker to unload the candidate",
    )
    assert read_candidate(redis_client, KEYS).state == "stopped"


@pytest.mark.slow
def test_a_swap_during_a_shadow_compares_against_the_new_live_version(
    redis_url, redis_client, spawn_worker
):
    spawn_worker("q", SCALE, *FAST)
    assert (
        shadow_cli(
            redis_url, "--model", SCALE, "--version", "scale-2", "--sample", "1", "--no-check"
        ).returncode
        == 0
    )
    wait_loaded(redis_client, "scale-2", 1)
    with Producer(redis_url, "q") as producer:
        send(producer, range(5))
        swapped = subprocess.run(
            [
                sys.executable,
                "-m",
                "inferfleet",
                "swap",
                "--name",
                "q",
                "--model",
                TRIPLE,
                "--no-check",
                "--version",
                "triple-1",
                "--wait-s",
                "30",
            ],
            env=worker_env(redis_url),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert swapped.returncode == 0, swapped.stdout + swapped.stderr
        send(producer, range(5))
    wait_until(
        lambda: sorted(s.compared for _, _, s in read_pairs(redis_client, KEYS)) == [5, 5],
        WAIT_S,
        "5 comparisons with each live version",
    )
    by_live = {p["live"]: p for p in report(redis_url)["pairs"]}
    assert by_live["scale-1"]["rel_error_max"] == 0.0 and by_live["scale-1"]["compared"] == 5
    assert by_live["triple-1"]["rel_error_max"] > 0.3 and by_live["triple-1"]["compared"] == 5
    assert shadow_states(redis_client) == ["scale-2 loaded"]  # the candidate stays through the swap


def worker_state(client, consumer: str) -> str:
    return (client.hget(heartbeat_key(KEYS, consumer), "shadow") or b"").decode()


def fleet_compared(client) -> int:
    return sum(stats.compared for _, _, stats in read_pairs(client, KEYS))


def kill_while_holding_entries(client, proc: subprocess.Popen, consumer: str) -> list[bytes]:
    """SIGKILL ``consumer`` once it holds entries and the fleet has compared some; the entries it
    held."""
    freeze_while_holding(
        client,
        KEYS.requests,
        consumer,
        proc.pid,
        ready=lambda: fleet_compared(client) >= 4,
        timeout_s=30,
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    return [
        p["message_id"]
        for p in client.xpending_range(
            KEYS.requests, "workers", "-", "+", 100, consumername=consumer
        )
    ]


@pytest.mark.slow
def test_a_worker_killed_during_a_shadow_loses_nothing_and_its_replacement_shadows_again(
    redis_url, redis_client, spawn_worker, monkeypatch
):
    """SIGKILL one of two shadowing workers mid-traffic: every request is still answered once (its
    entries are taken over), a replacement loads the candidate again and adds to the same
    comparison, and the report reads as before: one pair, full agreement, no more comparisons than
    requests."""
    monkeypatch.setenv(
        "SLOW_BATCH_S", "0.05"
    )  # a batch takes a while: the victim dies holding entries
    args = (*FAST, "--max-batch-rows", "2", "--claim-idle-s", "0.5")
    victim = spawn_worker("q", SLOW, *args, consumer="w-a")
    other = spawn_worker("q", SLOW, *args, consumer="w-b")
    publish_candidate(redis_client, KEYS, SCALE, "scale-2", 1.0, 0.0, Thresholds())
    wait_loaded(redis_client, "scale-2", 2)
    with Producer(redis_url, "q") as producer:
        inputs = [np.array([[float(v), 1.0, 2.0, 3.0]], dtype=np.float32) for v in range(200)]
        rids = producer.submit_many(inputs)
        held = kill_while_holding_entries(redis_client, victim, "w-a")
        replacement = spawn_worker("q", SLOW, *args, consumer="w-c")
        replies = producer.results(rids, 60)
        assert held and all(r.ok and r.model_version == "scale-1" for r in replies)
        assert all(np.array_equal(r.outputs, x * 2) for x, r in zip(inputs, replies))
        # answered once: nothing pending, no second reply left behind, nothing dead-lettered
        assert redis_client.xpending(KEYS.requests, "workers")["pending"] == 0
        assert [
            k
            for k in redis_client.scan_iter(match="inferfleet:{q}:*")
            if b":reply:" in k or b":inbox:" in k
        ] == []
        assert redis_client.xlen(KEYS.dead) == 0
        wait_until(
            lambda: worker_state(redis_client, "w-c") == "scale-2 loaded",
            WAIT_S,
            "the replacement to load it",
        )
        stop_process(other)  # only the replacement serves from here
        before = fleet_compared(redis_client)
        send(producer, range(20))
        wait_until(
            lambda: fleet_compared(redis_client) >= before + 20,
            WAIT_S,
            "the replacement's 20 comparisons",
        )
    assert replacement.poll() is None
    shown = report(redis_url)
    (pair,) = shown["pairs"]
    assert (pair["live"], pair["candidate"], pair["agreement"]) == ("scale-1", "scale-2", 1.0)
    assert (
        before + 20 <= pair["compared"] <= 220
        and pair["candidate_errors"] == 0
        and pair["verdict"] == "ok"
    )
    assert shown["workers"] == {
        "w-c": "scale-2 loaded"
    }  # the victim's heartbeat expired, w-b left cleanly


def test_status_shows_the_candidate_and_each_workers_copy(redis_url, redis_client, spawn_worker):
    spawn_worker("q", SCALE, *FAST, consumer="w-0")
    publish_candidate(redis_client, KEYS, TRIPLE, "triple-1", 0.5, 10.0, Thresholds())
    wait_loaded(redis_client, "triple-1", 1)
    env = {**worker_env(redis_url), "COLUMNS": "300"}
    shown = subprocess.run(
        [sys.executable, "-m", "inferfleet", "status", "--name", "q", "--json"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert shown.returncode == 0, shown.stderr
    (queue,) = json.loads(shown.stdout)["queues"]
    assert {
        k: queue["candidate"][k]
        for k in (
            "model",
            "version",
            "state",
            "sample",
            "canary_percent",
            "loaded",
            "failed",
            "workers",
        )
    } == {
        "model": TRIPLE,
        "version": "triple-1",
        "state": "canary",
        "sample": 0.5,
        "canary_percent": 10.0,
        "loaded": 1,
        "failed": 0,
        "workers": 1,
    }
    (worker,) = queue["workers"]
    assert (worker["consumer"], worker["shadow"], worker["shadow_error"]) == (
        "w-0",
        "triple-1 loaded",
        "",
    )
    table = subprocess.run(
        [sys.executable, "-m", "inferfleet", "status", "--name", "q"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert table.returncode == 0, table.stderr
    lines = [line.strip() for line in table.stdout.splitlines()]
    assert "candidate" in lines  # the candidate's table, by its title
    assert any(
        TRIPLE in line and "canary" in line and "10%" in line and "1 of 1" in line for line in lines
    )
    assert any(line.startswith("│ w-0") and "triple-1 loaded" in line for line in lines)


def test_bad_input_is_refused_clearly(redis_url, redis_client):
    assert "give one of" in shadow_cli(redis_url).stderr
    assert "from 0 to 1" in shadow_cli(redis_url, "--model", SCALE, "--sample", "2").stderr
    assert "percent" in shadow_cli(redis_url, "--model", SCALE, "--canary", "101").stderr
    assert "min_agreement" in shadow_cli(redis_url, "--model", SCALE, "--min-agreement", "3").stderr
    nothing = shadow_cli(redis_url, "--promote")
    assert nothing.returncode == 1 and "no active candidate" in nothing.stderr
    assert "no candidate published" in shadow_cli(redis_url, "--report").stdout
    assert shadow_cli(redis_url, "--canary", "10").returncode == 1
