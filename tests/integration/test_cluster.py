"""A queue sharded into S streams on a real local Redis Cluster (three masters).

Shard s of queue NAME is keyed like a queue named ``NAME.s``: its own hash
tag, so its own slot, so (for these names) its own master. Producers pick
the shard from the request id; one real ``inferfleet worker --shards S
--shard s --cluster`` subprocess per shard answers it; the contract holds
per shard.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from redis.cluster import RedisCluster

from inferfleet.producer import AsyncProducer, Producer
from inferfleet.producer.protocol import GROUP, shard_for, shard_keys
from tests.conftest import ROOT, require_programs, stop_process, worker_env
from tests.integration.conftest import MASTERS, LocalCluster

NAME = "ctr"  # with 3 shards: ctr.0, ctr.1 and ctr.2 hash to slots of three different masters
PLACED = "placed"  # the placement test's own queue: placed.0, .1 and .2 hash to three masters too
SHARDS = 3
CLI = [sys.executable, "-m", "inferfleet"]


def rows(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1 + i % 3, 16), dtype=np.float32) for i in range(n)]


def cluster_client(url: str) -> RedisCluster:
    return RedisCluster.from_url(url, socket_connect_timeout=5)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def consumers(client: RedisCluster, stream: str) -> set[str]:
    try:
        return {c["name"].decode() for c in client.xinfo_consumers(stream, GROUP)}
    except Exception:  # noqa: BLE001 - no stream or group yet
        return set()


def start_workers(
    url: str, name: str, models_dir: Path, log_dir: Path, shards: int
) -> list[subprocess.Popen]:
    """One ``inferfleet worker --shards S --shard s --cluster`` per shard, each awaited until it
    reads."""
    procs = []
    for shard in range(shards):
        with open(log_dir / f"{name}-{shard}.log", "wb") as log:  # the child keeps its own copy
            procs.append(
                subprocess.Popen(
                    [
                        *CLI,
                        "worker",
                        "--name",
                        name,
                        "--model",
                        str(models_dir / "affine.pt"),
                        "--shards",
                        str(shards),
                        "--shard",
                        str(shard),
                        "--cluster",
                        "--consumer",
                        f"w{shard}",
                        "--redis-url",
                        url,
                        "--log-level",
                        "warning",
                    ],
                    env=worker_env(url),
                    cwd=ROOT,
                    stdout=log,
                    stderr=log,
                )
            )
    client = cluster_client(url)
    for shard, (keys, proc) in enumerate(zip(shard_keys(name, shards), procs)):
        wait_until(
            lambda: f"w{shard}" in consumers(client, keys.requests) or proc.poll() is not None,
            90,
            f"worker of shard {shard}",
        )
        assert proc.poll() is None, (log_dir / f"{name}-{shard}.log").read_text()
    return procs


@pytest.fixture(scope="module")
def fleet(
    redis_cluster: LocalCluster, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Three workers, one per shard of queue ``ctr``, for the module; yields the cluster URL."""
    redis_cluster.flush()
    procs = start_workers(
        redis_cluster.url, NAME, models_dir, tmp_path_factory.mktemp("fleet"), SHARDS
    )
    yield redis_cluster.url
    for proc in procs:
        stop_process(proc)


# --------------------------------------------------------------------------- placement


def test_shards_are_slots_of_different_masters(redis_cluster: LocalCluster) -> None:
    """Its own queue (no flush: the module's fleet may be serving ``ctr`` on the same cluster)."""
    url = redis_cluster.url
    streams = [keys.requests for keys in shard_keys(PLACED, SHARDS)]
    client = cluster_client(url)
    for stream in streams:
        client.delete(stream)
    try:
        with Producer(url, PLACED, shards=SHARDS, cluster=True) as producer:
            rids = producer.submit_many(rows(60))
            assert producer.backlog() == 60  # no group yet: every entry of every shard waits
        by_shard = [sum(1 for r in rids if shard_for(r, SHARDS) == s) for s in range(SHARDS)]
        assert all(by_shard), by_shard
        homes: dict[str, int] = {}  # stream key -> the master that holds it
        for port in redis_cluster.ports:
            with redis_cluster.node(port) as node:
                for key in node.keys(f"inferfleet:{{{PLACED}.*"):
                    homes[key.decode()] = port
                    assert (
                        node.xlen(key)
                        == by_shard[int(key.decode().split("}")[0].rsplit(".", 1)[1])]
                    )
        assert sorted(homes) == sorted(streams)
        assert len({homes[s] for s in streams}) == MASTERS == SHARDS  # each shard on its own master
        for keys in shard_keys(PLACED, SHARDS):  # every key of one shard shares its slot
            slots = {
                client.keyslot(k)
                for k in (keys.requests, keys.reply("r1"), keys.inbox("x"), keys.dead)
            }
            assert len(slots) == 1
    finally:
        for stream in streams:
            client.delete(stream)
        client.close()


# --------------------------------------------------------------------------- a worker per shard


def test_workers_per_shard_answer_every_request_once(fleet: str, affine: Callable) -> None:
    inputs = rows(90, seed=1)
    with Producer(fleet, NAME, shards=SHARDS, cluster=True) as producer:
        rids = producer.submit_many(inputs)
        replies = producer.results(rids, timeout_s=60, raise_errors=True)
    client = cluster_client(fleet)
    for rid, x, reply in zip(rids, inputs, replies):
        assert reply.id == rid and reply.model_name == NAME  # the model's name, not the shard's
        np.testing.assert_allclose(reply.outputs, affine(x), rtol=1e-5, atol=1e-6)
        assert (
            client.exists(shard_keys(NAME, SHARDS)[shard_for(rid, SHARDS)].reply(rid)) == 0
        )  # one reply only
    read = []
    for shard, keys in enumerate(shard_keys(NAME, SHARDS)):
        (group,) = client.xinfo_groups(keys.requests)
        assert int(group["pending"]) == 0
        read.append(int(group["entries-read"]))
        assert consumers(client, keys.requests) == {
            f"w{shard}"
        }  # a shard's own worker, and only it
    assert all(read) and sum(read) >= len(rids)


def test_map_and_imap_collect_from_an_inbox_per_shard(fleet: str, affine: Callable) -> None:
    inputs = rows(200, seed=2)
    with Producer(fleet, NAME, shards=SHARDS, cluster=True) as producer:
        replies = producer.map(inputs, timeout_s=60, window=64)
        unordered = {r.id: r for r in producer.imap(inputs[:50], timeout_s=60)}
        assert producer.lag() == 0
        inboxes = list(producer.inboxes)
    assert [r.ok for r in replies] == [True] * 200
    for x, reply in zip(inputs, replies):
        np.testing.assert_allclose(reply.outputs, affine(x), rtol=1e-5, atol=1e-6)
    assert len(unordered) == 50 and all(r.ok for r in unordered.values())
    assert len({i.split("}")[0] for i in inboxes}) == SHARDS  # one inbox per shard's hash tag
    assert cluster_client(fleet).exists(*inboxes) == 0  # every reply collected


def test_async_producer_routes_through_the_cluster(fleet: str, affine: Callable) -> None:
    inputs = rows(40, seed=3)

    async def run() -> tuple[list, Any]:
        async with AsyncProducer(fleet, NAME, shards=SHARDS, cluster=True) as producer:
            mapped = await producer.map(inputs, timeout_s=60)
            one = await producer.infer(inputs[0], timeout_s=30)
            return mapped, one

    mapped, one = asyncio.run(run())
    assert all(r.ok for r in mapped)
    np.testing.assert_allclose(mapped[-1].outputs, affine(inputs[-1]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one, affine(inputs[0]), rtol=1e-5, atol=1e-6)


def test_raw_protocol_per_shard(fleet: str, redis_cluster: LocalCluster, affine: Callable) -> None:
    """redis-cli writes one request straight to each shard's stream; BLPOP its reply key."""
    require_programs("redis-cli", why="a client in another program than Python")
    client = cluster_client(fleet)
    x = np.full((1, 16), 0.5, np.float32)
    body = msgpack.packb(
        {"inputs": {"dtype": "float32", "shape": [1, 16], "data": x.tobytes()}}, use_bin_type=True
    )
    for shard, keys in enumerate(shard_keys(NAME, SHARDS)):
        rid = f"raw-{shard}"
        sent = subprocess.run(
            [
                "redis-cli",
                "-c",
                "-p",
                str(redis_cluster.ports[0]),
                "-x",
                "XADD",
                keys.requests,
                "*",
                "id",
                rid,
                "body",
            ],
            input=body,
            capture_output=True,
            timeout=10,
        )
        assert sent.returncode == 0 and b"-" in sent.stdout, sent
        popped = client.execute_command("BLPOP", keys.reply(rid), 30)
        assert popped is not None and popped[0].decode() == keys.reply(rid)
        reply = msgpack.unpackb(popped[1], raw=False)
        assert reply["ok"] is True and reply["id"] == rid and reply["model"]["name"] == NAME
        out = np.frombuffer(reply["outputs"]["data"], np.float32).reshape(reply["outputs"]["shape"])
        np.testing.assert_allclose(out, affine(x), rtol=1e-5, atol=1e-6)


def test_cli_enqueue_result_and_status_find_the_shard(
    fleet: str, tmp_path: Path, affine: Callable
) -> None:
    x = np.ones((2, 16), np.float32)
    np.save(tmp_path / "x.npy", x)
    common = ["--name", NAME, "--shards", str(SHARDS), "--cluster", "--redis-url", fleet]
    rid = subprocess.run(
        [*CLI, "enqueue", *common, "--input", str(tmp_path / "x.npy")],
        env=worker_env(fleet),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    out = subprocess.run(
        [*CLI, "result", *common, rid, "--output", str(tmp_path / "y.npy")],
        env=worker_env(fleet),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert json.loads(out)["model"]["name"] == NAME
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), affine(x), rtol=1e-5, atol=1e-6)
    status = subprocess.run(
        [*CLI, "status", *common],
        env=worker_env(fleet),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for shard in range(SHARDS):
        assert f"queue {NAME}.{shard}" in status and f"w{shard}" in status


def test_swap_and_alerts_reach_every_shard(fleet: str, models_dir: Path) -> None:
    """The same affine model as a .pt2 file: other version, same outputs, so later tests still
    hold."""
    from inferfleet.worker.heartbeat import read_heartbeats

    common = ["--name", NAME, "--shards", str(SHARDS), "--cluster", "--redis-url", fleet]
    swapped = subprocess.run(
        [*CLI, "swap", *common, "--model", str(models_dir / "affine.pt2"), "--wait-s", "60"],
        env=worker_env(fleet),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert swapped.returncode == 0, swapped.stdout + swapped.stderr
    assert all(f"{NAME}.{s}: version" in swapped.stdout for s in range(SHARDS))
    client = cluster_client(fleet)
    versions = {
        w.version for keys in shard_keys(NAME, SHARDS) for w in read_heartbeats(client, keys)
    }
    with Producer(fleet, NAME, shards=SHARDS, cluster=True) as producer:
        replies = producer.map(rows(30, seed=9), timeout_s=60)
    assert {r.model_version for r in replies} == versions and len(
        versions
    ) == 1  # every shard switched
    rolled = subprocess.run(
        [*CLI, "swap", *common, "--rollback", "--wait-s", "60"],
        env=worker_env(fleet),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    shown = subprocess.run(
        [*CLI, "alerts", *common],
        env=worker_env(fleet),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        shown.returncode == 0
        and "no alerts in" in shown.stdout
        and f"{{{NAME}.2}}:alerts" in shown.stdout
    )


def test_cli_refuses_a_name_too_long_for_its_shards(redis_cluster: LocalCluster) -> None:
    url = redis_cluster.url
    done = subprocess.run(
        [
            *CLI,
            "result",
            "--name",
            "n" * 63,
            "--shards",
            "2",
            "--cluster",
            "--redis-url",
            url,
            "r1",
        ],
        env=worker_env(url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        done.returncode == 2
        and "too long for 2 shards" in done.stderr
        and "use at most 62" in done.stderr
    )


# --------------------------------------------------------------------------- the supervisor


@pytest.mark.slow
def test_supervise_spreads_its_workers_over_the_shards(
    redis_cluster: LocalCluster, models_dir: Path, tmp_path: Path, affine: Callable
) -> None:
    url, name = redis_cluster.url, "sup"  # its own queue: the module's fleet keeps serving ctr
    with open(tmp_path / "supervise.log", "wb") as log:
        proc = subprocess.Popen(
            [
                *CLI,
                "supervise",
                "--name",
                name,
                "--model",
                str(models_dir / "affine.pt"),
                "--shards",
                "2",
                "--cluster",
                "--redis-url",
                url,
                "--policy",
                "fixed",
                "--min-workers",
                "1",
                "--max-workers",
                "2",
                "--devices",
                "cpu",
                "--interval-s",
                "0.2",
                "--log-level",
                "warning",
            ],
            env=worker_env(url),
            cwd=ROOT,
            stdout=log,
            stderr=log,
        )
    try:
        client = cluster_client(url)
        for shard, keys in enumerate(shard_keys(name, 2)):
            wait_until(
                lambda: (
                    any(c.startswith(f"{name}-s{shard}-") for c in consumers(client, keys.requests))
                    or proc.poll() is not None
                ),
                90,
                f"the supervised worker of shard {shard}",
            )
            assert proc.poll() is None, (tmp_path / "supervise.log").read_text()
        inputs = rows(60, seed=4)
        with Producer(url, name, shards=2, cluster=True) as producer:
            replies = producer.map(inputs, timeout_s=60)
        assert all(r.ok for r in replies)
        np.testing.assert_allclose(replies[7].outputs, affine(inputs[7]), rtol=1e-5, atol=1e-6)
        assert (
            b"fewer than --shards 2" in (tmp_path / "supervise.log").read_bytes()
        )  # min 1 raised to 2, said so
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_the_reply_script_runs_on_the_slots_master_and_survives_a_script_flush(
    redis_cluster: LocalCluster,
) -> None:
    """register_script on a RedisCluster: EVALSHA goes to the master of the keys' one slot (a
    queue's hash tag), and NOSCRIPT after a SCRIPT FLUSH on every master loads it again."""
    from inferfleet.producer.protocol import QueueKeys
    from inferfleet.worker.counters import Counters
    from inferfleet.worker.serving.consumer import ensure_group
    from inferfleet.worker.serving.intake import Answer
    from inferfleet.worker.serving.replies import ReplyWriter

    keys = QueueKeys("reply-script")
    client = cluster_client(redis_cluster.url)
    rids = ["r0", "r1"]
    try:
        ensure_group(client, keys.requests)
        writer = ReplyWriter(client, keys, 60, ("affine", "1"), Counters())
        writer.load()
        for rid in rids:
            entry_id = client.xadd(keys.requests, {"id": rid})
            client.xreadgroup(GROUP, "c1", {keys.requests: ">"}, count=1)
            writer.write(
                [Answer(entry_id, keys.reply(rid), b"reply of " + rid.encode(), True, rid=rid)]
            )
            assert client.lrange(keys.reply(rid), 0, -1) == [b"reply of " + rid.encode()]
            assert client.xpending(keys.requests, GROUP)["pending"] == 0
            for port in redis_cluster.ports:
                with redis_cluster.node(port) as node:
                    node.script_flush()
    finally:
        for key in [keys.requests, *(keys.reply(rid) for rid in rids)]:
            client.delete(key)
        client.close()
