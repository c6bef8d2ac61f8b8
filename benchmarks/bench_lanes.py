"""Sharing a fleet (issue 14): what the high lane buys, and what admission and the cancel check
cost.

Three parts, each run ``--runs`` times with its cases interleaved (figures are medians):

* ``latency``: one worker of ``tests.fixtures.example_handlers:SimulatedAccelerator``
  (each batch of up to 32 rows takes BATCH_S = 10 ms of wall time, no CPU) gets
  a normal backlog of ``--backlog`` requests, then ``--interactive`` requests
  one every 10 ms, on the high lane (``lanes``) or on the normal lane like the
  backlog (``no lanes``). Reported: p50 and p99 of the interactive requests'
  time from enqueue to computed (the reply's ``queued_ms + infer_ms``), and
  that every backlog request was answered.
* ``admission``: the client's CPU per request (``time.process_time()``) and
  redis-server's (``/proc``) for ``submit_many`` (chunks of 1,000) and for
  single ``submit`` calls, with no limits and with limits in force (a backlog
  limit and the producer's tenant's quota, both too high to refuse: the
  function runs in full). No worker.
* ``read``: the worker's read alone, in this process: ``--requests`` entries
  in the normal lane read 256 at a time by the one-stream XREADGROUP the
  worker made before lanes (``client.xreadgroup``), and by ``LaneReader.read``
  (the three lanes and the cancel marks' EXISTS in one round trip), and by
  ``LaneReader.read`` with a cancel mark standing, so that each read also
  looks its entries' marks up (``take_cancels``: one ZMSCORE for the read).
  Reported: this process's and redis-server's CPU per entry.
* ``cancel``: a worker draining ``--requests`` one-row affine requests (paused
  while they are written, as ``bench_cpu.py --kind drain``): its CPU per
  request with no cancel marks, and with one mark of an unrelated id standing
  (so every round looks its requests up).

    python -m benchmarks.bench_lanes --part all --runs 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from benchmarks.bench_cpu import NAME, cpu_s, fill, start_worker, wait_drained, wait_joined
from inferfleet import Producer
from inferfleet.producer.protocol import QueueKeys, encode_body
from inferfleet.producer.sharing import cancels_key, limits_key
from inferfleet.worker.connections import stream_entries, worker_client
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.serving.lanes import LaneReader
from inferfleet.worker.serving.sharing import load_library, take_cancels

ROOT = Path(__file__).resolve().parent.parent

KEYS = QueueKeys(NAME)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def latency_run(high: bool, args: argparse.Namespace) -> dict[str, float]:
    os.environ["BATCH_S"] = "0.01"
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        proc = start_worker(
            "fleet", server.url, "tests.fixtures.example_handlers:SimulatedAccelerator", 32, []
        )
        try:
            wait_joined(client, proc, "fleet-0")
            producer = Producer(server.url, NAME)
            x = np.ones((1, 4), np.float32)
            backlog = producer.submit_many([x] * args.backlog, deadline_s=600)
            urgent = []
            for _ in range(args.interactive):
                urgent.append(
                    producer.submit(x, deadline_s=600, priority="high" if high else "normal")
                )
                time.sleep(0.01)
            replies = producer.results(urgent, timeout_s=300)
            drained = sum(r.ok for r in producer.results(backlog, timeout_s=300))
        finally:
            proc.terminate()
            proc.wait(30)
    waits = [r.timing["queued_ms"] + r.timing["infer_ms"] for r in replies]
    return {
        "p50_ms": percentile(waits, 50),
        "p99_ms": percentile(waits, 99),
        "backlog_answered": float(drained),
    }


def _limits(client: redis.Redis) -> None:
    client.hset(
        limits_key(KEYS),
        mapping={
            "max_backlog": 10**9,
            "rate:bench": "1000000.0",
            "burst:bench": "1000000.0",
            "stamp": "bench",
        },
    )


def admission_run(limited: bool, args: argparse.Namespace) -> dict[str, float]:
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        if limited:
            _limits(client)
        producer = Producer(server.url, NAME, tenant="bench", default_deadline_s=None)
        producer.submit(x)  # connects, reads the limits (loads the functions)
        out: dict[str, float] = {}
        for call, n in (("submit_many", args.requests), ("submit", args.requests // 10)):
            client.delete(KEYS.requests)
            client0, redis0 = time.process_time(), cpu_s(server.pid)
            if call == "submit_many":
                producer.submit_many([x] * n)
            else:
                for _ in range(n):
                    producer.submit(x)
            out[f"{call}_client_us"] = (time.process_time() - client0) / n * 1e6
            out[f"{call}_redis_us"] = (cpu_s(server.pid) - redis0) / n * 1e6
            if client.xlen(KEYS.requests) != n:
                raise RuntimeError(f"{call}: {client.xlen(KEYS.requests)} entries written, not {n}")
        producer.close()
    return out


def read_run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    body = encode_body(np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32))
    with EmbeddedRedis() as server:
        client = worker_client(server.url)
        for stream in (KEYS.requests + ":high", KEYS.requests, KEYS.requests + ":low"):
            client.xgroup_create(stream, "workers", id="0", mkstream=True)
        fill(client, body, args.requests)
        reader = LaneReader(KEYS)
        load_library(client)
        if mode == "take":  # an unrelated request's mark stands: every read looks its entries up
            client.zadd(cancels_key(KEYS), {"someone-else": int(time.time() * 1000) + 600_000})
        read = 0
        client0, redis0 = time.process_time(), cpu_s(server.pid)
        while read < args.requests:
            if mode != "old":
                entries, _ = reader.read(client, "c", 256, None)
                if (
                    reader.cancels
                ):  # the consumer has each request's id decoded already: so does this
                    take_cancels(client, KEYS, [f"r{read + i}" for i in range(len(entries))])
            else:
                response = client.xreadgroup("workers", "c", {KEYS.requests: ">"}, count=256)
                entries = stream_entries(response)
            read += len(entries)
        out = {
            "client_us": (time.process_time() - client0) / read * 1e6,
            "redis_us": (cpu_s(server.pid) - redis0) / read * 1e6,
        }
        client.close()
    return out


def cancel_run(marked: bool, args: argparse.Namespace) -> dict[str, float]:
    body = encode_body(np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32))
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        proc = start_worker("fleet", server.url, str(ROOT / "models" / "affine.pt"), 256, [])
        try:
            wait_joined(client, proc, "fleet-0")
            proc.send_signal(signal.SIGSTOP)
            fill(client, body, args.requests)
            if marked:  # an unrelated request's mark, standing for the whole drain
                expiry = int(time.time() * 1000) + 600_000
                client.zadd(cancels_key(KEYS), {"someone-else": expiry})
                client.pexpireat(cancels_key(KEYS), expiry)
            worker0, started = cpu_s(proc.pid), time.perf_counter()
            proc.send_signal(signal.SIGCONT)
            wait_drained(client, 600)
            wall = time.perf_counter() - started
            worker_s = cpu_s(proc.pid) - worker0
        finally:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(30)
    return {"worker_us": worker_s / args.requests * 1e6, "drain_rps": args.requests / wall}


PARTS: dict[str, tuple[Any, dict[str, Any]]] = {
    "latency": (
        latency_run,
        {"no lanes (interactive on the normal lane)": False, "lanes (interactive on high)": True},
    ),
    "admission": (admission_run, {"no limits": False, "limits in force": True}),
    "read": (
        read_run,
        {
            "one-stream XREADGROUP (before lanes)": "old",
            "LaneReader.read": "lanes",
            "LaneReader.read + take_cancels (a mark standing)": "take",
        },
    ),
    "cancel": (cancel_run, {"no cancel marks": False, "a cancel mark standing": True}),
}


def run_part(part: str, args: argparse.Namespace) -> None:
    function, cases = PARTS[part]
    runs = []
    for i in range(args.runs):
        runs.append({name: function(flag, args) for name, flag in cases.items()})
        print(f"{part} run {i + 1}: {runs[-1]}", flush=True)
    print(f"\n{part}, median of {args.runs} runs")
    for name in cases:
        row = {k: statistics.median(run[name][k] for run in runs) for k in runs[0][name]}
        print(f"  {name}: " + ", ".join(f"{k} {v:,.2f}" for k, v in row.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--backlog", type=int, default=2000, help="latency: normal requests queued first"
    )
    parser.add_argument("--interactive", type=int, default=100, help="latency: requests measured")
    parser.add_argument(
        "--requests", type=int, default=50_000, help="admission and cancel: requests a case"
    )
    args = parser.parse_args()
    for part in PARTS if args.part == "all" else [args.part]:
        run_part(part, args)


if __name__ == "__main__":
    main()
