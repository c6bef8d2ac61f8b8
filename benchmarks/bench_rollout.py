#!/usr/bin/env python3
"""What a shadow version and tracing cost a worker (issue 15), each measured interleaved.

``--part shadow``: one in-process Consumer serves a closed loop of one-request
batches (one client, ``Producer.submit`` + ``result``) while its candidate (a
second copy of the same model) is switched on and off every ``--switch-s``
seconds. Reported per mode: the live replies' latency (median, p90, p99) and
the worker thread's CPU per request.

``--part tracing``: one in-process Consumer drains backlogs of one-row
requests while its hooks are switched every ``--segment`` rounds between
"none" (no hooks: the loop before this change), "off" (hooks, nothing loaded
and no tracing: what every worker runs when tracing is off) and "on" (spans
made for every request, handed to a BatchSpanProcessor whose exporter drops
them). Reported: worker CPU per request of each mode.

    python -m benchmarks.bench_rollout --part shadow --model models/cnn.pt --seconds 60
    python -m benchmarks.bench_rollout --part tracing --requests 50000 --passes 3
    python -m benchmarks.bench_rollout --part tracing --modes none,off --requests 50000 --passes 3
    python -m benchmarks.bench_rollout --part tracing --modes off,on --sampler-ratio 0.01
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from inferfleet.producer import Producer
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import worker_client
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.comparison import Thresholds
from inferfleet.worker.serving.compute import encode_answer
from inferfleet.worker.serving.consumer import Consumer
from inferfleet.worker.serving.hooks import Hooks
from inferfleet.worker.serving.replies import BatchEncoder
from inferfleet.worker.serving.rollout import publish_candidate, read_pairs
from inferfleet.worker.serving.shadow import ShadowRunner
from inferfleet.worker.serving.tracing import tracing_from_env

ROOT = Path(__file__).resolve().parent.parent


def _consumer(server: EmbeddedRedis, model: str, name: str) -> Consumer:
    settings = WorkerSettings(
        name=name, model=model, redis_url=server.url, device="cpu", max_wait_ms=0
    )
    consumer = Consumer(settings, load_runtime(settings), worker_client(server.url))
    consumer.prepare()
    return consumer


def _shadow_runner(consumer: Consumer, sample: float) -> ShadowRunner:
    """A runner with the candidate (another copy of the live model) loaded as a worker would."""
    settings = consumer.settings
    runner = ShadowRunner(
        consumer.redis,
        consumer.keys,
        settings,
        load_runtime,
        consumer.counters,
        lambda alerts: None,
        encode_answer,
    )
    runner.runtime = load_runtime(settings)
    runner.encoder = BatchEncoder(runner.runtime.model_meta, encode_answer)
    # published as `inferfleet shadow` would, so the runner's housekeeping keeps it loaded
    runner.spec = publish_candidate(
        consumer.redis, consumer.keys, settings.model, "candidate", sample, 0.0, Thresholds()
    )
    return runner


def _percentiles(values: list[float]) -> str:
    a = np.asarray(values) * 1000.0
    p90, p99 = np.percentile(a, 90), np.percentile(a, 99)
    return f"median {np.median(a):.3f} ms, p90 {p90:.3f} ms, p99 {p99:.3f} ms"


def shadow_part(args: argparse.Namespace) -> None:
    with EmbeddedRedis() as server:
        consumer = _consumer(server, args.model, "bench-shadow")
        runner = _shadow_runner(consumer, args.sample)
        consumer.hooks = Hooks(runner)
        mode = {"now": "off"}
        cpu, served = {"off": 0.0, "on": 0.0}, {"off": 0, "on": 0}
        stop = threading.Event()

        def serve() -> None:
            next_switch = time.monotonic() + args.switch_s
            while not stop.is_set():
                if time.monotonic() >= next_switch:
                    mode["now"] = "on" if mode["now"] == "off" else "off"
                    runner.ready = mode["now"] == "on"
                    next_switch += args.switch_s
                started, current = time.thread_time(), mode["now"]
                served[current] += consumer.run_once()
                cpu[current] += time.thread_time() - started

        thread = threading.Thread(target=serve)
        thread.start()
        latency: dict[str, list[float]] = {"off": [], "on": []}
        x = consumer.runtime.example[:1] if consumer.runtime.example is not None else None
        with Producer(server.url, "bench-shadow") as producer:
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                before = mode["now"]
                sent = time.perf_counter()
                producer.result(producer.submit(x), 30)
                took = time.perf_counter() - sent
                if mode["now"] == before:
                    latency[before].append(took)
        stop.set()
        thread.join()
        consumer.hooks.housekeep(consumer.runtime)  # flush the last comparisons
        shadowed = sum(stats.compared for _, _, stats in read_pairs(consumer.redis, consumer.keys))
    for m in ("off", "on"):
        print(
            f"shadow {m:>3} (sample {args.sample:g}): {len(latency[m]):,} replies, "
            f"{_percentiles(latency[m])}; worker CPU {cpu[m] / max(served[m], 1) * 1e6:.1f} "
            "us/request"
        )
    print(
        f"requests compared with the candidate: {shadowed:,} of {len(latency['on']):,} served with "
        "the shadow on"
    )


_LABELS = {"none": "no hooks", "off": "hooks, tracing off", "on": "tracing on"}


class _Drop:
    """A span exporter that drops what it is given (the cost measured is making spans, not shipping
    them)."""

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def tracing_part(args: argparse.Namespace) -> None:
    with EmbeddedRedis() as server:
        consumer = _consumer(server, args.model, "bench-tracing")
        tracing = tracing_from_env("bench-tracing", env={}, exporter=_Drop())
        every = {"none": None, "off": Hooks(), "on": Hooks(tracing=tracing)}
        modes = {m: every[m] for m in args.modes.split(",")}
        cpu = dict.fromkeys(modes, 0.0)
        done = dict.fromkeys(modes, 0)
        x = np.random.default_rng(0).standard_normal((1, args.features), dtype=np.float32)
        order = list(modes)
        with Producer(server.url, "bench-tracing") as producer:
            for _ in range(args.passes):
                producer.submit_many([x] * args.requests)
                turn = 0
                while True:
                    mode = order[turn % len(order)]
                    consumer.hooks = modes[mode]
                    started, handled = time.thread_time(), 0
                    for _ in range(args.segment):
                        handled += consumer.run_once()
                    cpu[mode] += time.thread_time() - started
                    done[mode] += handled
                    turn += 1
                    if handled == 0:
                        break
                consumer.redis.flushall()
                consumer.prepare()
                per = {m: cpu[m] / max(done[m], 1) * 1e6 for m in modes}
                base = per[order[0]]
                print(
                    f"{sum(done.values()):,} requests, worker CPU per request: "
                    + ", ".join(
                        f"{_LABELS[m]} {per[m]:.2f} us ({(per[m] / base - 1) * 100:+.1f}%)"
                        for m in order
                    ),
                    flush=True,
                )
        if tracing is not None:
            tracing.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["shadow", "tracing"], required=True)
    parser.add_argument("--model", default=str(ROOT / "models" / "affine.pt"))
    parser.add_argument(
        "--sample", type=float, default=0.1, help="shadow: share of batches shadowed"
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="shadow: length of the run")
    parser.add_argument(
        "--switch-s", type=float, default=0.5, help="shadow: seconds between switches"
    )
    parser.add_argument(
        "--features", type=int, default=16, help="tracing: float32 inputs per row (affine: 16)"
    )
    parser.add_argument(
        "--requests", type=int, default=50_000, help="tracing: backlog drained per pass"
    )
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--segment", type=int, default=20, help="tracing: rounds between switches")
    parser.add_argument(
        "--modes", default="none,off,on", help="tracing: the modes to interleave, first = base"
    )
    parser.add_argument(
        "--sampler-ratio",
        type=float,
        default=None,
        help="tracing: record this share of traces (OTEL_TRACES_SAMPLER=traceidratio)",
    )
    args = parser.parse_args()
    if args.sampler_ratio is not None:
        os.environ.update(
            OTEL_TRACES_SAMPLER="traceidratio", OTEL_TRACES_SAMPLER_ARG=str(args.sampler_ratio)
        )
    shadow_part(args) if args.part == "shadow" else tracing_part(args)


if __name__ == "__main__":
    main()
