#!/usr/bin/env python3
"""What recording metrics costs a worker: CPU per request with metrics on and off, interleaved.

A private redis-server gets a backlog of one-row requests for the affine
model, drained by one in-process Consumer. Every ``--segment`` rounds the
consumer's WorkerMetrics (``consumer.counters.metrics``) is swapped between
a recording one and a disabled one, and the thread CPU time of each segment
is added to its mode. Switching several times a second cancels the drift of
a shared machine's load, which swamps a few percent when whole runs are
compared.

    python -m benchmarks.bench_metrics --requests 100000 --passes 5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from prometheus_client import REGISTRY

from inferfleet.producer import Producer
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import worker_client
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.metrics import WorkerMetrics
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.consumer import Consumer

ROOT = Path(__file__).resolve().parent.parent


def drain(
    consumer: Consumer,
    modes: dict[str, WorkerMetrics],
    cpu: dict[str, float],
    done: dict[str, int],
    segment: int,
) -> None:
    """Run rounds until the stream is empty, switching the metrics every ``segment`` rounds."""
    mode = "off"
    while True:
        consumer.counters.metrics = modes[mode]
        started, handled = time.thread_time(), 0
        for _ in range(segment):
            handled += consumer.run_once()
        cpu[mode] += time.thread_time() - started
        done[mode] += handled
        if handled == 0:
            return
        mode = "on" if mode == "off" else "off"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "affine.pt"))
    parser.add_argument(
        "--features", type=int, default=16, help="float32 inputs per row (affine: 16)"
    )
    parser.add_argument("--requests", type=int, default=100_000, help="backlog drained per pass")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--segment", type=int, default=20, help="rounds between switches")
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        settings = WorkerSettings(
            name="bench-metrics", model=args.model, redis_url=server.url, device="cpu"
        )
        consumer = Consumer(settings, load_runtime(settings), worker_client(server.url))
        consumer.prepare()
        modes = {
            "on": WorkerMetrics(settings.name, REGISTRY),
            "off": WorkerMetrics(settings.name, None),
        }
        cpu, done = {"on": 0.0, "off": 0.0}, {"on": 0, "off": 0}
        x = np.random.default_rng(0).standard_normal((1, args.features), dtype=np.float32)
        with Producer(server.url, settings.name) as producer:
            for _ in range(args.passes):
                producer.submit_many([x] * args.requests)
                drain(consumer, modes, cpu, done, args.segment)
                consumer.redis.flushall()  # the replies (the stream is drained)
                consumer.prepare()
                off, on = (cpu[m] / max(done[m], 1) * 1e6 for m in ("off", "on"))
                print(
                    f"{done['off'] + done['on']:,} requests: metrics off {off:.2f} us, on {on:.2f} "
                    f"us of worker CPU per request ({(on / off - 1) * 100:+.1f}%)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
