#!/usr/bin/env python3
"""Reliability scenarios with real processes on a real redis-server; the figures in
docs/reliability.md.

Each scenario starts a private redis-server and ``inferfleet supervise``,
pushes requests, breaks something, and counts what came back:

* ``kill``:   SIGKILL a random worker every second while requests flow;
* ``redis``:  SIGKILL redis-server mid-run and start it again (AOF, fsync always);
* ``poison``: one request kills every worker that computes it, others keep flowing;
* ``swap``:   hot swaps and a rollback while a random worker is SIGKILLed every second;
* ``failover``, ``switchover``: the primary behind Sentinels SIGKILLed, or switched over;
* ``cluster``: a cluster master SIGKILLed, its replica promoted.

Every scenario reports requests, answered, lost (no reply), duplicated (a reply
list that holds a reply again after the client took one with LPOP: every list
read again at the end, once the group holds nothing unacknowledged),
unacknowledged (entries the group still held then: 0, or the duplicate count is
not final), wrong (outputs other than the version that replied computes: 2x
for sim-1, 3x for sim-2), settle_s (the wait for that, left out of every
recovery time) and recovery time. The tests in
tests/integration/test_reliability.py run the same functions smaller and assert on them.

    python -m benchmarks.chaos kill --requests 5000
    python -m benchmarks.chaos redis --requests 3000
    python -m benchmarks.chaos poison --requests 2000
    python -m benchmarks.chaos swap --requests 4000
    python -m benchmarks.chaos failover --requests 4000
    python -m benchmarks.chaos switchover --requests 4000
    python -m benchmarks.chaos failover --requests 4000 --durable
    python -m benchmarks.chaos switchover --requests 4000 --durable
    python -m benchmarks.chaos cluster --requests 4000
    python -m benchmarks.chaos cluster --requests 4000 --durable

``failover`` and ``switchover`` run the fleet and two producers (the SDK, and a raw-redis one
writing XADDs as docs/protocol.md says) on a Sentinel URL: a primary, a replica and three
Sentinels; the primary is SIGKILLed, or handed over by SENTINEL FAILOVER. ``cluster`` kills the
master of the queue's slot in a cluster of three masters with a replica each. ``--durable``:
producers and workers WAIT for one replica (500 ms at most), and ``not_accepted`` counts the
requests producers were told were not accepted (sent again with new ids).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import redis

from inferfleet.producer import Durability, Producer, errors
from inferfleet.producer.connections import close_client, connect
from inferfleet.producer.protocol import GROUP, QueueKeys, decode_reply, encode_body
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.heartbeat import read_heartbeats
from inferfleet.worker.serving.lifecycle import publish, rollback
from tests.fixtures.example_handlers import POISON
from tests.fixtures.replicated_cluster import ReplicatedCluster
from tests.fixtures.sentinels import SERVICE, SentinelSet

ROOT = Path(__file__).resolve().parent.parent

NAME = "chaos"
KEYS = QueueKeys(NAME)
#: what each example handler version multiplies its inputs by
FACTOR = {"sim-1": 2.0, "sim-2": 3.0}


@contextmanager
def fleet(
    url: str, workers: int, handler: str = "SimulatedAccelerator", *extra: str
) -> Iterator[subprocess.Popen]:
    """``inferfleet supervise`` with a fixed fleet, until the block ends (then drained)."""
    env = dict(os.environ, REDIS_URL=url, PYTHONPATH=str(ROOT), BATCH_S="0.005")
    cmd = [
        sys.executable,
        "-m",
        "inferfleet",
        "supervise",
        "--name",
        NAME,
        "--model",
        f"tests.fixtures.example_handlers:{handler}",
        "--max-batch-rows",
        "16",
        "--devices",
        "cpu",
        "--policy",
        "fixed",
        "--min-workers",
        str(workers),
        "--max-workers",
        str(workers),
        "--interval-s",
        "0.2",
        "--log-level",
        "warning",
        *extra,
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    client = connect(url, cluster="--cluster" in extra)  # a Sentinel URL too
    try:
        wait_for(lambda: len(read_heartbeats(client, KEYS)) >= workers, 120, "the fleet to start")
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        close_client(client)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except redis.exceptions.ConnectionError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def inputs_for(i: int) -> np.ndarray:
    return np.full((1, 4), float(i % 1000), np.float32)


def feed(
    url: str,
    requests: int,
    per_s: float,
    accepted: dict[str, int],
    *,
    start: int = 0,
    durability: Durability | None = None,
    cluster: bool = False,
    refused: list[int] | None = None,
) -> None:
    """Submit requests ``start`` .. ``start + requests - 1`` in small chunks at about ``per_s``
    through the SDK; record what Redis accepted. A chunk not accepted (Redis down, or with
    ``durability`` not confirmed by a replica: counted in ``refused``, ``[count, monotonic time
    of the last]``) is sent again, new ids."""
    producer = Producer(url, NAME, default_deadline_s=None, durability=durability, cluster=cluster)
    for indices in _paced_chunks(start, requests, per_s):
        while True:
            try:
                rids = producer.submit_many([inputs_for(i) for i in indices])
                accepted.update(zip(rids, indices))
                break
            except errors.NotReplicated:
                _count_refused(refused, len(indices))
            except errors.ConnectionError:
                time.sleep(0.1)  # Redis is down: this chunk was not accepted; retry it
    producer.close()


def _paced_chunks(start: int, requests: int, per_s: float) -> Iterator[range]:
    """Request indices ``start`` .. ``start + requests - 1`` in chunks of 50, about ``per_s`` a
    second (the pause follows each chunk, once the caller has sent it)."""
    chunk = 50
    for first in range(start, start + requests, chunk):
        yield range(first, min(first + chunk, start + requests))
        time.sleep(chunk / per_s)


def _count_refused(refused: list | None, count: int) -> None:
    """``count`` requests a producer was told were not accepted, now (then a short pause)."""
    if refused is not None:
        refused[:] = [refused[0] + count, time.monotonic()]
    time.sleep(0.1)


def raw_feed(
    url: str,
    requests: int,
    per_s: float,
    accepted: dict[str, int],
    *,
    start: int = 0,
    durability: Durability | None = None,
    refused: list[int] | None = None,
) -> None:
    """:func:`feed` as a client in another language does it, from docs/protocol.md alone: one
    pipelined ``XADD`` per request with its own id (followed by ``WAIT`` with durability on,
    on the same connection), redis-py with no SDK. Reconnects after a ``WAIT`` shortfall."""
    client = connect(url)
    for indices in _paced_chunks(start, requests, per_s):
        while True:
            rids = [f"raw-{uuid.uuid4().hex}" for _ in indices]
            pipe = client.pipeline(transaction=False)
            for rid, i in zip(rids, indices):
                pipe.xadd(KEYS.requests, {"id": rid, "body": encode_body(inputs_for(i))})
            if durability is not None:
                pipe.execute_command("WAIT", durability.replicas, durability.timeout_ms)
            try:
                told = pipe.execute()
            except redis.exceptions.RedisError:
                time.sleep(0.1)  # not accepted (Redis down, READONLY): send again
                continue
            if durability is not None and int(told[-1]) < durability.replicas:
                client.connection_pool.disconnect()  # find the primary again
                _count_refused(refused, len(indices))
                continue
            accepted.update(zip(rids, indices))
            break
    close_client(client)


def tally(
    client: redis.Redis, accepted: dict[str, int], timeout_s: float, settle_s: float = 30.0
) -> dict[str, float]:
    """Collect every accepted request's reply as a client does (LPOP: taken once); count lost,
    duplicated, wrong, dead-lettered.

    Duplicates are counted at the end, once the group holds nothing unacknowledged (so no
    worker can answer again; waited for up to ``settle_s``): a request is duplicated when its
    reply list holds a reply again after the client took one (a second answer, pushed before
    or after the first was taken).
    """
    pending = dict(accepted)
    taken: list[str] = []
    counts = {
        "answered": 0,
        "duplicated": 0,
        "wrong": 0,
        "dead_lettered": 0,
        "sim-1": 0,
        "sim-2": 0,
    }
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        rids = list(pending)
        pipe = client.pipeline(transaction=False)
        for rid in rids:
            pipe.lpop(KEYS.reply(rid))
        try:
            popped = pipe.execute()
        except redis.exceptions.ConnectionError:
            popped = [None] * len(rids)  # a failover under way: try again
        for rid, raw in zip(rids, popped):
            if raw is not None:
                _check(raw, pending.pop(rid), counts)
                taken.append(rid)
        time.sleep(0.1)
    counts["lost"] = len(pending)
    counts["requests"] = len(accepted)
    settling = time.monotonic()
    counts["unacknowledged"] = _wait_acknowledged(client, settling + settle_s)
    counts["duplicated"] = count_duplicates(client, taken)
    counts["settle_s"] = round(time.monotonic() - settling, 2)  # not part of any recovery time
    return counts


def _wait_acknowledged(client: redis.Redis, deadline: float) -> int:
    """Wait until group ``workers`` holds no unacknowledged entry; what it still holds at
    ``deadline``."""
    while True:
        try:
            held = int(client.xpending(KEYS.requests, GROUP)["pending"])
        except redis.exceptions.ResponseError:  # no stream or group: nothing was ever delivered
            return 0
        if held == 0 or time.monotonic() >= deadline:
            return held
        time.sleep(0.1)


def count_duplicates(client: redis.Redis, taken: Iterable[str]) -> int:
    """Requests taken once whose reply list holds a reply again (one LLEN each, pipelined)."""
    pipe = client.pipeline(transaction=False)
    for rid in taken:
        pipe.llen(KEYS.reply(rid))
    return sum(1 for length in pipe.execute() if int(length) > 0)


def _check(raw: bytes, index: int, counts: dict) -> None:
    counts["answered"] += 1
    reply = decode_reply(raw)
    if not reply.ok:
        counts["dead_lettered" if reply.error_code == "dead_letter" else "wrong"] += 1
        return
    counts[reply.model_version or "?"] = counts.get(reply.model_version or "?", 0) + 1
    factor = FACTOR.get(reply.model_version or "")
    if factor is None or not np.array_equal(reply.outputs, inputs_for(index) * factor):
        counts["wrong"] += 1  # the outputs are not what the version named in the reply computes


def kill_random_worker(client: redis.Redis) -> int:
    """SIGKILL one live worker (from the heartbeats); 1 if one was killed."""
    pids = [b.pid for b in read_heartbeats(client, KEYS)]
    if not pids:
        return 0
    try:
        os.kill(random.choice(pids), signal.SIGKILL)
        return 1
    except ProcessLookupError:
        return 0


def scenario_kill(requests: int = 5000, workers: int = 3, kill_every_s: float = 1.0) -> dict:
    """SIGKILL a random worker every ``kill_every_s`` while requests flow."""
    with (
        EmbeddedRedis() as server,
        fleet(
            server.url,
            workers,
            "SimulatedAccelerator",
            "--crash-loop-deaths",
            "1000",
            "--max-deliveries",
            "20",
        ),
    ):
        client = redis.Redis.from_url(server.url)
        accepted: dict[str, int] = {}
        feeder = threading.Thread(target=feed, args=(server.url, requests, 600, accepted))
        feeder.start()
        kills = 0
        while feeder.is_alive():
            time.sleep(kill_every_s)
            kills += kill_random_worker(client)
        feeder.join()
        last_kill = time.monotonic()
        result = tally(client, accepted, 120)
        result.update(
            kills=kills, recover_s=round(time.monotonic() - last_kill - result["settle_s"], 2)
        )
        client.close()
    return result


def scenario_redis(requests: int = 3000, workers: int = 2, down_s: float = 1.0) -> dict:
    """SIGKILL redis-server mid-run, then start it again on the same AOF (appendfsync always)."""
    aof = ("--appendonly", "yes", "--appendfsync", "always")
    with EmbeddedRedis(extra_args=aof) as server, fleet(server.url, workers):
        accepted: dict[str, int] = {}
        feeder = threading.Thread(target=feed, args=(server.url, requests, 800, accepted))
        feeder.start()
        time.sleep(1.5)
        server.crash()
        time.sleep(down_s)
        server.start()
        back = time.monotonic()
        client = redis.Redis.from_url(server.url)
        probe = Producer(server.url, NAME, default_deadline_s=None)
        probe.result(
            probe.submit(inputs_for(0)), timeout_s=60
        )  # a full round trip through the fleet
        first_reply_s = time.monotonic() - back
        probe.close()
        feeder.join()
        result = tally(client, accepted, 120)
        result.update(redis_down_s=down_s, first_reply_after_restart_s=round(first_reply_s, 2))
        client.close()
    return result


def scenario_poison(requests: int = 2000, workers: int = 2) -> dict:
    """One request kills every worker that computes it; the rest must keep flowing."""
    with (
        EmbeddedRedis() as server,
        fleet(server.url, workers, "CrashOnPoison", "--crash-loop-deaths", "100"),
    ):
        client = redis.Redis.from_url(server.url)
        producer = Producer(server.url, NAME, default_deadline_s=None)
        started = time.monotonic()
        poison = producer.submit(np.full((1, 4), POISON, np.float32))
        accepted: dict[str, int] = {}
        feed(server.url, requests, 200, accepted)
        reply = producer.result(poison, timeout_s=120, raise_errors=False)
        result = tally(client, accepted, 120)
        answered_s = time.monotonic() - started - result["settle_s"]
        result.update(
            poison_code=reply.error_code,
            poison_answered_s=round(answered_s, 2),
            dead_letters=int(client.xlen(KEYS.dead)),
        )
        producer.close()
        client.close()
    return result


def scenario_swap(requests: int = 4000, workers: int = 3, kill_every_s: float = 1.0) -> dict:
    """Swap sim-1 -> sim-2, roll back, swap again, while a random worker is SIGKILLed every
    second."""
    base = "tests.fixtures.example_handlers:SimulatedAccelerator"
    steps = [
        lambda c: publish(c, KEYS, base + "V2", "sim-2", serving=(base, "sim-1")),
        lambda c: rollback(c, KEYS),
        lambda c: rollback(c, KEYS),
    ]  # rolling back a rollback: sim-2 again
    with (
        EmbeddedRedis() as server,
        fleet(
            server.url,
            workers,
            "SimulatedAccelerator",
            "--crash-loop-deaths",
            "1000",
            "--max-deliveries",
            "20",
        ),
    ):
        client = redis.Redis.from_url(server.url)
        accepted: dict[str, int] = {}
        feeder = threading.Thread(target=feed, args=(server.url, requests, 600, accepted))
        feeder.start()
        kills = ticks = 0
        while feeder.is_alive():
            time.sleep(kill_every_s)
            ticks += 1
            if ticks % 2 and steps:
                steps.pop(0)(client)
            kills += kill_random_worker(client)
        feeder.join()
        result = tally(client, accepted, 120)
        wait_for(
            lambda: {b.version for b in read_heartbeats(client, KEYS)} == {"sim-2"},
            60,
            "every worker, restarted ones included, to serve the published version",
        )
        result.update(kills=kills, swaps=3 - len(steps))
        client.close()
    return result


def durability(durable: bool, replicas: int = 1) -> Durability | None:
    """What ``--durable`` asks of the producers and the workers: every replica there is (a
    planned switch-over leaves the old primary writable with the replicas not promoted, so a
    write only one of them confirmed could still be lost), 500 ms at most."""
    return Durability(replicas=replicas, timeout_ms=500) if durable else None


def _durable_args(wait: Durability | None) -> tuple[str, ...]:
    if wait is None:
        return ()
    return ("--wait-replicas", str(wait.replicas), "--wait-timeout-ms", str(wait.timeout_ms))


def _feeders(
    url: str,
    requests: int,
    accepted: dict[str, int],
    wait: Durability | None,
    refused: list[int],
    raw: bool = True,
) -> list[threading.Thread]:
    """The load, 600 requests a second: half through the SDK, half from a raw-redis producer
    (none on a cluster, where the SDK routes)."""
    sdk_share = requests // 2 if raw else requests
    threads = [
        threading.Thread(
            target=feed,
            args=(url, sdk_share, 300 if raw else 600, accepted),
            kwargs={"durability": wait, "refused": refused, "cluster": not raw},
        )
    ]
    if raw:
        threads.append(
            threading.Thread(
                target=raw_feed,
                args=(url, requests - sdk_share, 300, accepted),
                kwargs={"start": sdk_share, "durability": wait, "refused": refused},
            )
        )
    for thread in threads:
        thread.start()
    return threads  # fmt: skip


def scenario_failover(
    requests: int = 4000,
    workers: int = 2,
    planned: bool = False,
    durable: bool = False,
    replicas: int = 1,
) -> dict:
    """Requests flow through a Sentinel URL (half through the SDK, half from a raw-redis
    producer); the primary is SIGKILLed mid-run (``planned``: ``SENTINEL FAILOVER`` instead),
    the Sentinels promote the replica, and the fleet and the producers follow it without a
    restart. Without ``durable`` replication is asynchronous: what the primary had accepted but
    not yet sent to the replica is lost (or answered on the old primary only); with it, a write
    counts as accepted once every replica confirmed it (``WAIT``), and the workers wait
    likewise. ``failovers`` counts the Sentinels' promotions (their config epoch): 1 unless a
    stall made them fail over again."""
    wait = durability(durable, replicas)
    with (
        SentinelSet(replicas=replicas) as sentinels,
        fleet(sentinels.url, workers, "SimulatedAccelerator", *_durable_args(wait)),
    ):
        accepted: dict[str, int] = {}
        refused = [0, 0.0]
        feeders = _feeders(sentinels.url, requests, accepted, wait, refused)
        time.sleep(1.5)
        broke = time.monotonic()
        if planned:
            redis.Redis(port=sentinels.ports[0]).sentinel_failover(SERVICE)
        else:
            sentinels.primary.crash()  # SIGKILL
        promoted_s = sentinels.wait_promoted()
        if not planned:  # as an operator (or Kubernetes) would: the Sentinels make it a replica
            sentinels.wait_all_moved()  # not before: it comes back empty (no persistence)
            sentinels.primary.start()
        first_reply_s = _first_reply_s(sentinels.url, broke, wait=wait)
        for feeder in feeders:
            feeder.join()
        client = connect(sentinels.url)
        result = tally(client, accepted, 30)  # the fleet drains the rest within seconds
        master = redis.Redis(port=sentinels.ports[0]).sentinel_master(SERVICE)
        _describe(result, refused, broke, promoted_s, first_reply_s)
        result.update(
            failover="SENTINEL FAILOVER" if planned else "primary SIGKILLed",
            durable=durable,
            replicas=replicas,
            failovers=int(master.get("config-epoch", 0)),
        )
        close_client(client)
    return result


def scenario_switchover(
    requests: int = 4000, workers: int = 2, durable: bool = False, replicas: int = 1
) -> dict:
    """``failover`` planned: SENTINEL FAILOVER while the primary is healthy."""
    return scenario_failover(requests, workers, planned=True, durable=durable, replicas=replicas)


def scenario_cluster(requests: int = 4000, workers: int = 2, durable: bool = False) -> dict:
    """A Redis Cluster of three masters with a replica each: the master holding the queue's
    slot is SIGKILLed mid-run; its replica takes over (``cluster-node-timeout`` 1 s) and the
    fleet and the producer follow it through the cluster's own redirections."""
    wait = durability(durable)
    with (
        ReplicatedCluster() as cluster,
        fleet(cluster.url, workers, "SimulatedAccelerator", "--cluster", *_durable_args(wait)),
    ):
        accepted: dict[str, int] = {}
        refused = [0, 0.0]
        feeders = _feeders(cluster.url, requests, accepted, wait, refused, raw=False)
        time.sleep(1.5)
        victim = cluster.master_of(KEYS.requests)
        broke = time.monotonic()
        cluster.kill(victim)
        promoted_s = cluster.wait_promoted(KEYS.requests, victim)
        cluster.restart(victim)  # it rejoins as the replica of the node that took over
        first_reply_s = _first_reply_s(cluster.url, broke, cluster=True, wait=wait)
        for feeder in feeders:
            feeder.join()
        client = connect(cluster.url, cluster=True)
        result = tally(client, accepted, 30)
        _describe(result, refused, broke, promoted_s, first_reply_s)
        result.update(failover="cluster master SIGKILLed", durable=durable)
        close_client(client)
    return result


def _describe(
    result: dict, refused: list, broke: float, promoted_s: float, first_reply_s: float
) -> None:
    """Add a failover's figures to its tally: what was refused (and until when, in seconds
    after the failure), when the replica was promoted and the first new request answered."""
    result.update(
        not_accepted=int(refused[0]),
        last_not_accepted_s=round(max(refused[1] - broke, 0.0), 2) if refused[0] else None,
        promoted_s=round(promoted_s, 2),
        first_reply_after_failure_s=round(first_reply_s, 2),
    )


def _first_reply_s(
    url: str, since: float, cluster: bool = False, wait: Durability | None = None
) -> float:
    """Seconds from ``since`` until a new request is answered through ``url`` (sent as the
    load's producers send theirs: with ``wait``, WAITing for the replicas)."""
    probe = Producer(url, NAME, default_deadline_s=None, cluster=cluster, durability=wait)
    try:
        while True:
            try:
                probe.result(probe.submit(inputs_for(0)), timeout_s=5)
                return time.monotonic() - since
            except (errors.ConnectionError, errors.InferfleetError):
                time.sleep(0.05)  # still failing over: the request may not have been accepted
    finally:
        probe.close()


SCENARIOS = {
    "kill": scenario_kill,
    "redis": scenario_redis,
    "poison": scenario_poison,
    "swap": scenario_swap,
    "failover": scenario_failover,
    "switchover": scenario_switchover,
    "cluster": scenario_cluster,
}


#: the scenarios that take ``--durable``
DURABLE_SCENARIOS = ("cluster", "failover", "switchover")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument(
        "--durable",
        action="store_true",
        help="failover, switchover, cluster: producers and workers WAIT for one replica",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="failover, switchover: replicas of the primary (default 1)",
    )
    args = parser.parse_args()
    if args.replicas is not None and (
        args.replicas < 1 or args.scenario not in ("failover", "switchover")
    ):
        parser.error("--replicas takes 1 or more, for failover and switchover only")
    if args.requests is not None and args.requests < 1:
        parser.error("--requests must be at least 1")
    if args.durable and args.scenario not in DURABLE_SCENARIOS:
        parser.error(f"--durable applies to {', '.join(DURABLE_SCENARIOS)} only")
    kwargs: dict = {"requests": args.requests} if args.requests else {}
    if args.durable:
        kwargs["durable"] = True
    if args.replicas is not None:
        kwargs["replicas"] = args.replicas
    print(json.dumps(SCENARIOS[args.scenario](**kwargs)))


if __name__ == "__main__":
    main()
