#!/usr/bin/env python3
"""Soak run: push N requests (default 1,000,000) through one worker and track its memory.

Starts a private redis-server and one ``inferfleet worker``, sends requests
through the SDK with a bounded window, and samples the worker's resident
memory from its heartbeat every half second. Reports the RSS after warm-up
(the first 5% of requests), at the end, and the growth between them, and
plots RSS against requests served.

    python -m benchmarks.soak --model models/affine.pt --requests 1000000 --png \\
        docs/img/soak-rss.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from inferfleet.producer import Producer
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.bench.load import bench_inputs
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.heartbeat import read_heartbeats

ROOT = Path(__file__).resolve().parent.parent


def sample(url: str, stop: threading.Event, samples: list[tuple[float, int, float]]) -> None:
    client = redis.Redis.from_url(url)
    keys = QueueKeys("soak")
    while not stop.wait(0.5):
        beats = read_heartbeats(client, keys)
        if beats:
            samples.append((time.monotonic(), beats[0].requests, beats[0].rss_mb))
    client.close()


def plot(samples: list[tuple[float, int, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    ax.plot([s[1] / 1000 for s in samples], [s[2] for s in samples], lw=1.5)
    ax.set_xlabel("requests served (thousands)")
    ax.set_ylabel("worker RSS (MiB)")
    ax.set_title(title)
    ax.set_ylim(
        0, max(s[2] for s in samples) * 1.2
    )  # headroom: a flat line must not hide under the frame
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "affine.pt"))
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--png", default=None, help="write the RSS curve here")
    args = parser.parse_args()
    with EmbeddedRedis() as server:
        env = dict(os.environ, REDIS_URL=server.url, PYTHONPATH=str(ROOT))
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferfleet",
                "worker",
                "--name",
                "soak",
                "--model",
                args.model,
                "--consumer",
                "soak-0",
                "--log-level",
                "warning",
            ],
            env=env,
            cwd=ROOT,
        )
        client = redis.Redis.from_url(server.url)
        while not read_heartbeats(client, QueueKeys("soak")):
            time.sleep(0.1)
        samples: list[tuple[float, int, float]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(server.url, stop, samples), daemon=True)
        sampler.start()
        pool = bench_inputs(args.model, None, rows=1)
        started = time.perf_counter()
        errors = 0
        with Producer(server.url, "soak") as producer:
            for reply in producer.imap(
                (pool[i % len(pool)] for i in range(args.requests)), window=2000
            ):
                errors += not reply.ok
        seconds = time.perf_counter() - started
        time.sleep(1.2)
        stop.set()
        sampler.join()
        worker.terminate()
        worker.wait(30)
    warm = next(s for s in samples if s[1] >= args.requests * 0.05)
    end = samples[-1]
    growth = (end[2] - warm[2]) / warm[2] * 100
    report = {
        "requests": args.requests,
        "errors": errors,
        "seconds": round(seconds, 1),
        "qps": round(args.requests / seconds),
        "rss_warm_mb": warm[2],
        "rss_end_mb": end[2],
        "rss_peak_mb": max(s[2] for s in samples),
        "growth_pct": round(growth, 2),
    }
    report["samples"] = len(samples)
    print(json.dumps(report))
    if args.png:
        plot(
            samples,
            args.png,
            f"worker RSS over {args.requests:,} requests ({Path(args.model).name})",
        )


if __name__ == "__main__":
    main()
