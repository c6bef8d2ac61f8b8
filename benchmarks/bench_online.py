"""The online path: single calls from many concurrent callers, as a web service makes them.

One private redis-server and one fleet worker a run; every mode of the run
uses them in turn, and each mode's CPU time is read from /proc (worker,
redis-server) and ``time.process_time`` (the client, its reader thread
included) around it:

* ``async``: ``--concurrency`` tasks, each awaiting ``AsyncProducer.infer`` on
  one request at a time, on one producer;
* ``threads``: as many threads, each calling ``Producer.infer``, on one producer;
* ``imap``: ``Producer.imap(window=concurrency)``, the bulk path, for reference;
* ``paced``: one request at a time at ``--rate`` a second for ``--paced-s``;
* ``idle``: nothing sent for ``--idle-s``: the worker's share of a core.

Reported: requests a second, the round trip's p50 and p99 (ms), CPU us a
request of each process, and for the single-call modes how many sends the
write batcher put in one round trip.

    python -m benchmarks.bench_online --requests 20000 --runs 3
    python -m benchmarks.bench_online --model models/ctr.pt --modes async,threads --runs 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.bench_cpu import ROOT, cpu_s, fleet_worker, median_rows, print_table
from inferfleet import AsyncProducer, Producer
from inferfleet.worker.bench.load import bench_inputs
from inferfleet.worker.embedded import EmbeddedRedis

NAME = "cpu"  # bench_cpu's fleet_worker serves this queue
WARMUP = 300


def _async_calls(url: str, inputs: list[Any], concurrency: int) -> tuple[list[float], float]:
    """(each call's round trip in s, sends a write round) of ``concurrency`` tasks."""

    async def main() -> tuple[list[float], float]:
        producer = AsyncProducer(url, NAME)
        latencies: list[float] = []
        todo = iter(inputs)

        async def caller() -> None:
            for x in todo:
                started = time.perf_counter()
                await producer.infer(x, timeout_s=60)
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        batching = producer._writes.commands / max(producer._writes.rounds, 1)
        await producer.close()
        return latencies, batching

    return asyncio.run(main())


def _thread_calls(url: str, inputs: list[Any], concurrency: int) -> tuple[list[float], float]:
    producer = Producer(url, NAME)
    latencies: list[float] = []
    lock = threading.Lock()
    todo = iter(inputs)

    def caller() -> None:
        while True:
            with lock:
                x = next(todo, None)
            if x is None:
                return
            started = time.perf_counter()
            producer.infer(x, timeout_s=60)
            latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=caller) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    batching = producer._writes.commands / max(producer._writes.rounds, 1)
    producer.close()
    return latencies, batching


def _imap_calls(url: str, inputs: list[Any], concurrency: int) -> tuple[list[float], float]:
    sent: dict[str, float] = {}
    latencies: list[float] = []

    def on_send(rids: list[str]) -> None:
        now = time.perf_counter()
        sent.update(dict.fromkeys(rids, now))

    with Producer(url, NAME) as producer:
        for reply in producer.imap(inputs, window=concurrency, on_send=on_send, timeout_s=60):
            latencies.append(time.perf_counter() - sent.pop(reply.id))
    return latencies, 0.0


def _paced_calls(url: str, inputs: list[Any], rate: float, seconds: float) -> list[float]:
    latencies: list[float] = []
    with Producer(url, NAME) as producer:
        start = time.perf_counter()
        for i in range(int(rate * seconds)):
            pause = start + i / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            started = time.perf_counter()
            producer.infer(inputs[i % len(inputs)], timeout_s=60)
            latencies.append(time.perf_counter() - started)
    return latencies


def _measured(pids: dict[str, int], work: Callable[[], Any]) -> tuple[Any, dict[str, float], float]:
    """(what ``work`` returned, CPU s of each process meanwhile, wall s)."""
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    client0, started = time.process_time(), time.perf_counter()
    out = work()
    wall = time.perf_counter() - started
    spent = {name: cpu_s(pid) - before[name] for name, pid in pids.items()}
    spent["client"] = time.process_time() - client0
    return out, spent, wall


def _row(latencies: list[float], spent: dict[str, float], wall: float) -> dict[str, float]:
    n = len(latencies)
    ms = np.array(latencies) * 1000
    return {
        "rps": n / wall,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        **{f"{name}_us": seconds / n * 1e6 for name, seconds in spent.items()},
    }


def one_run(args: argparse.Namespace, inputs: list[Any]) -> dict[str, dict[str, float]]:
    """Every mode of ``args.modes`` on one redis-server and one worker."""
    rows: dict[str, dict[str, float]] = {}
    with EmbeddedRedis() as server, fleet_worker(server, args) as (_, proc):
        pids = {"worker": proc.pid, "redis": server.pid}
        pool = [inputs[i % len(inputs)] for i in range(args.requests)]
        concurrent = {"async": _async_calls, "threads": _thread_calls, "imap": _imap_calls}
        for mode in args.modes.split(","):
            if mode in concurrent:
                concurrent[mode](server.url, pool[:WARMUP], args.concurrency)
                (latencies, batching), spent, wall = _measured(
                    pids, lambda m=mode: concurrent[m](server.url, pool, args.concurrency)
                )
                rows[mode] = _row(latencies, spent, wall)
                if mode != "imap":
                    rows[mode]["sends_a_round"] = batching
            elif mode == "paced":
                latencies, spent, wall = _measured(
                    pids, lambda: _paced_calls(server.url, pool, args.rate, args.paced_s)
                )
                rows[mode] = _row(latencies, spent, wall)
                rows[mode]["worker_pct"] = spent["worker"] / wall * 100
            else:  # idle
                time.sleep(1.0)  # the last mode's tail settles
                _, spent, wall = _measured(pids, lambda: time.sleep(args.idle_s))
                rows[mode] = {"worker_pct": spent["worker"] / wall * 100}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "affine.pt"))
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--modes", default="async,threads,imap,paced,idle")
    parser.add_argument("--rate", type=float, default=200.0, help="paced: requests a second")
    parser.add_argument("--paced-s", type=float, default=5.0)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-batch-rows", type=int, default=256)
    parser.add_argument("--worker-arg", action="append", default=[])
    parser.add_argument("--json", dest="json_out", default=None)
    args = parser.parse_args()
    known = {"async", "threads", "imap", "paced", "idle"}
    if unknown := set(args.modes.split(",")) - known:
        parser.error(f"unknown modes {sorted(unknown)}: choose from {sorted(known)}")
    if args.requests < 1 or args.concurrency < 1 or args.rate <= 0:
        parser.error("--requests, --concurrency and --rate must be positive")
    inputs = bench_inputs(args.model, None, 1, seed=0)
    runs = [one_run(args, inputs) for _ in range(args.runs)]
    medians = median_rows(runs)
    print_table(
        f"{args.requests:,} one-row requests, {args.concurrency} concurrent, one worker; "
        f"median of {args.runs} (CPU us a request)",
        medians,
    )
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"args": vars(args), "runs": runs, "median": medians}, fh, indent=1)


if __name__ == "__main__":
    main()
