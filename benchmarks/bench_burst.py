#!/usr/bin/env python3
"""Burst benchmark for the supervisor: how each scaling policy meets a sudden backlog.

For each policy (lag, article, fixed single worker) it starts a private
redis-server and ``inferfleet supervise`` on the simulated-accelerator
handler (each batch of 8 rows takes 20 ms: about 400 requests/s per
worker), waits for one warm worker, sends a burst of N requests at once and
records: time from the burst to the first scale-up, time to drain, peak
workers, and p50/p99 latency of the burst's requests.

    python -m benchmarks.bench_burst --burst 6000 --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import redis

from inferfleet.producer import Producer
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.heartbeat import read_heartbeats

ROOT = Path(__file__).resolve().parent.parent

POLICIES = {
    "lag": ["--policy", "lag", "--min-workers", "1", "--max-workers", "8"],
    "article": ["--policy", "article", "--min-workers", "1", "--max-workers", "8"],
    "fixed-1": ["--policy", "fixed", "--min-workers", "1", "--max-workers", "1"],
}


def supervise(url: str, policy_args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, REDIS_URL=url, PYTHONPATH=str(ROOT), BATCH_S="0.02")
    cmd = [
        sys.executable,
        "-m",
        "inferfleet",
        "supervise",
        "--name",
        "burst",
        "--model",
        "tests.fixtures.example_handlers:SimulatedAccelerator",
        "--max-batch-rows",
        "8",
        "--devices",
        "cpu",
        "--log-level",
        "warning",
        "--interval-s",
        "0.5",
        *policy_args,
    ]
    return subprocess.Popen(cmd, env=env, cwd=ROOT)


def watch_workers(
    client: redis.Redis, keys: QueueKeys, stop: threading.Event, samples: list
) -> None:
    while not stop.is_set():
        samples.append((time.perf_counter(), len(read_heartbeats(client, keys))))
        time.sleep(0.1)


def one_run(policy: str, burst: int) -> dict:
    with EmbeddedRedis() as server:
        proc = supervise(server.url, POLICIES[policy])
        client = redis.Redis.from_url(server.url)
        keys = QueueKeys("burst")
        try:
            deadline = time.monotonic() + 120
            while len(read_heartbeats(client, keys)) < 1:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the supervisor's first worker did not start")
                time.sleep(0.1)
            time.sleep(1.0)
            samples: list = []
            stop = threading.Event()
            watcher = threading.Thread(
                target=watch_workers, args=(client, keys, stop, samples), daemon=True
            )
            watcher.start()
            sent_at: dict[str, float] = {}
            latencies = []
            producer = Producer(server.url, "burst")
            x = np.ones((1, 4), np.float32)
            start = time.perf_counter()

            def stamp(rids: list[str]) -> None:
                now = time.perf_counter()
                sent_at.update((r, now) for r in rids)

            for reply in producer.imap(
                (x for _ in range(burst)), window=burst, timeout_s=120, on_send=stamp
            ):
                latencies.append(time.perf_counter() - sent_at[reply.id])
            drained = time.perf_counter() - start
            stop.set()
            watcher.join()
        finally:
            proc.terminate()
            proc.wait(60)
    first_up = next((t - start for t, n in samples if n > 1), None)
    p50, p99 = np.percentile(latencies, [50, 99]) * 1000
    return {
        "first_up_s": first_up,
        "drain_s": drained,
        "peak": max(n for _, n in samples),
        "p50_ms": float(p50),
        "p99_ms": float(p99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=6000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    print("| policy | first scale-up (s) | drain (s) | peak workers | p50 (ms) | p99 (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for policy in args.policies.split(","):
        runs = [one_run(policy, args.burst) for _ in range(args.runs)]
        for r in runs:
            print(f"<!-- {policy} run: {r} -->", file=sys.stderr)
        ups = [r["first_up_s"] for r in runs if r["first_up_s"] is not None]
        med = {
            k: statistics.median(r[k] for r in runs)
            for k in ("drain_s", "peak", "p50_ms", "p99_ms")
        }
        up = f"{statistics.median(ups):.2f}" if ups else "never"
        print(
            f"| {policy} | {up} | {med['drain_s']:.2f} | {med['peak']:.0f} | {med['p50_ms']:.0f} | "
            f"{med['p99_ms']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
