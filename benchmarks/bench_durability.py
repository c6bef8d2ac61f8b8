"""What durability costs: the SDK and a fleet worker with and without ``WAIT`` for one replica.

Each run starts a private primary and its replica on loopback and one fleet worker, then sends
the same requests three ways, interleaved within the run (ratios are taken within a run,
figures are medians over ``--runs``):

* ``off``: Redis's asynchronous replication (the default);
* ``producer``: the SDK waits for the replica (``Durability(1, 1000)``): a request counts as
  accepted once the replica has it;
* ``both``: the worker too (``--wait-replicas 1``) after each round of replies.

Two load shapes: ``map`` (one producer's ``Producer.map`` over ``--requests`` one-row affine
requests: a WAIT a round of writes) and ``infer`` (``--threads`` threads calling
``Producer.infer`` one request at a time: the online path, a WAIT a group commit). Reported:
requests a second, CPU microseconds a request of the client, the worker and the primary
redis-server (``/proc``, as benchmarks/bench_cpu.py), and for ``infer`` the p50 and p99 of one
call in milliseconds.

    python -m benchmarks.bench_durability --requests 20000 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import redis

from benchmarks.bench_cpu import NAME, cpu_s, start_worker, wait_joined
from inferfleet.producer import Durability, Producer
from inferfleet.worker.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "models" / "affine.pt")
VARIANTS = ("off", "producer", "both")
WAIT = Durability(replicas=1, timeout_ms=1000)


@contextmanager
def primary_and_replica() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    with EmbeddedRedis() as primary:
        args = ("--replicaof", "127.0.0.1", str(primary.port))
        with EmbeddedRedis(extra_args=args) as replica:
            link = redis.Redis(port=replica.port)
            deadline = time.monotonic() + 30
            while link.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise TimeoutError("the replica did not sync within 30 s")
                time.sleep(0.05)
            yield primary, replica


def one_variant(variant: str, shape: str, args: argparse.Namespace) -> dict[str, float]:
    """One variant of one shape on fresh servers and a fresh worker."""
    extra = ["--wait-replicas", "1"] if variant == "both" else []
    with primary_and_replica() as (primary, _):
        worker = start_worker("fleet", primary.url, MODEL, 256, extra)
        try:
            wait_joined(redis.Redis.from_url(primary.url), worker, "fleet-0")
            durability = None if variant == "off" else WAIT
            with Producer(primary.url, NAME, durability=durability) as producer:
                producer.map([np.ones((1, 16), np.float32)] * 200)  # warm: the first batches
                assert primary.pid is not None
                before = (cpu_s(worker.pid), cpu_s(primary.pid), time.process_time())
                started = time.perf_counter()
                latencies = _send(shape, producer, args)
                wall = time.perf_counter() - started
                after = (cpu_s(worker.pid), cpu_s(primary.pid), time.process_time())
        finally:
            worker.terminate()
            worker.wait(60)
    n = args.requests
    row = {
        "req_per_s": round(n / wall),
        "client_us": round((after[2] - before[2]) / n * 1e6, 1),
        "worker_us": round((after[0] - before[0]) / n * 1e6, 1),
        "redis_us": round((after[1] - before[1]) / n * 1e6, 1),
    }
    if latencies:
        ordered = sorted(latencies)
        row["p50_ms"] = round(ordered[len(ordered) // 2] * 1000, 2)
        row["p99_ms"] = round(ordered[int(len(ordered) * 0.99)] * 1000, 2)
    return row


def _send(shape: str, producer: Producer, args: argparse.Namespace) -> list[float]:
    x = np.ones((1, 16), np.float32)
    if shape == "map":
        got = sum(r.ok for r in producer.map([x] * args.requests))
        assert got == args.requests, got
        return []
    latencies: list[float] = []
    each = args.requests // args.threads

    def caller() -> None:
        mine = []
        for _ in range(each):
            t = time.perf_counter()
            producer.infer(x, timeout_s=60)
            mine.append(time.perf_counter() - t)
        latencies.extend(mine)

    threads = [threading.Thread(target=caller) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(latencies) == each * args.threads
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--shapes", nargs="+", choices=("map", "infer"), default=["map", "infer"])
    args = parser.parse_args()
    if args.requests < args.threads or args.runs < 1 or args.threads < 1:
        parser.error("--requests must be at least --threads, --runs and --threads at least 1")
    if not Path(MODEL).exists():
        parser.error(f"{MODEL} is missing: run ./scripts/setup (it builds the example models)")
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.runs):
        for shape in args.shapes:
            for variant in VARIANTS:  # interleaved: a drift of the machine hits every variant
                runs.setdefault((shape, variant), []).append(one_variant(variant, shape, args))
    for (shape, variant), rows in runs.items():
        median = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(json.dumps({"shape": shape, "variant": variant, **median, "runs": rows}))


if __name__ == "__main__":
    main()
