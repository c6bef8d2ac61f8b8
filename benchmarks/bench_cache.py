#!/usr/bin/env python3
"""The result cache on a Zipf-distributed workload: throughput and hit rate, cache off against on.

Draws ``--requests`` inputs from a universe of ``--distinct`` inputs with
Zipf(``--skew``) popularity (a few inputs are very frequent, most are rare: the
article's "frequent inputs"), then for each configuration starts a fresh
worker on a private redis-server and sends the same sequence through the SDK
(``Producer.map``), ``--runs`` times. Prints each run, then a markdown table
of medians: requests/s, the share answered from a cache (replies whose
``timing.batch_rows`` is 0), and the p50/p99 of the server-side time
(``queued_ms + infer_ms``).

    python -m benchmarks.bench_cache --model ctr --runs 3
    python -m benchmarks.bench_cache --model cnn --distinct 5000 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import redis

from inferfleet.producer import Producer
from inferfleet.worker.embedded import EmbeddedRedis
from tests.fixtures.build_models import example_inputs
from tests.fixtures.fleet_procs import start_workers

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {
    "off": [],
    "in-batch only (LFU of 1)": ["--cache-size", "1"],
    "LFU 1,000": ["--cache-size", "1000"],
    "LFU 10,000": ["--cache-size", "10000"],
}


def zipf_sequence(distinct: int, requests: int, skew: float, seed: int) -> np.ndarray:
    """Indexes into the universe, rank r drawn with probability proportional to 1 / r**skew."""
    ranks = np.arange(1, distinct + 1, dtype=np.float64)
    p = ranks**-skew
    rng = np.random.default_rng(seed)
    return rng.choice(distinct, size=requests, p=p / p.sum())


def universe(kind: str, distinct: int) -> list:
    batch = example_inputs(kind, rows=distinct, seed=7)
    if isinstance(batch, dict):
        return [{k: v[i : i + 1] for k, v in batch.items()} for i in range(distinct)]
    return [batch[i : i + 1] for i in range(distinct)]


def run_once(url: str, inputs: list) -> dict:
    with Producer(url, "bench") as producer:
        started = time.perf_counter()
        replies = producer.map(inputs, timeout_s=120, window=2000)
        elapsed = time.perf_counter() - started
    assert all(r.ok for r in replies), next(r.error_message for r in replies if not r.ok)
    server = np.array([r.timing["queued_ms"] + r.timing["infer_ms"] for r in replies])
    return {
        "qps": len(replies) / elapsed,
        "hit": sum(r.timing["batch_rows"] == 0 for r in replies) / len(replies),
        "p50_ms": float(np.percentile(server, 50)),
        "p99_ms": float(np.percentile(server, 99)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["affine", "ctr", "cnn"], default="ctr")
    parser.add_argument("--distinct", type=int, default=50_000)
    parser.add_argument("--requests", type=int, default=30_000)
    parser.add_argument("--skew", type=float, default=1.1)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    pool = universe(args.model, args.distinct)
    sequence = zipf_sequence(args.distinct, args.requests, args.skew, seed=11)
    inputs = [pool[i] for i in sequence]
    print(
        f"{args.requests} requests over {len(set(sequence.tolist()))} distinct inputs "
        f"(universe {args.distinct}, Zipf {args.skew})",
        flush=True,
    )
    rows = []
    with EmbeddedRedis() as server:
        for label, extra in CONFIGS.items():
            runs = []
            for i in range(args.runs):
                redis.Redis.from_url(server.url).flushall()  # no fleet entries, no backlog
                procs = start_workers(
                    server.url,
                    "bench",
                    str(ROOT / "models" / f"{args.model}.pt"),
                    1,
                    "cache",
                    extra,
                )
                try:
                    runs.append(run_once(server.url, inputs))
                finally:
                    for proc in procs:
                        proc.terminate()
                        proc.wait(30)
                print(
                    f"{label} run {i + 1}: "
                    + "  ".join(f"{k} {v:.3f}" for k, v in runs[-1].items()),
                    flush=True,
                )
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append((label, med))
    base = rows[0][1]["qps"]
    print("\n| cache | req/s | vs off | answered from cache | p50 server ms | p99 server ms |")
    print("|---|---|---|---|---|---|")
    for label, med in rows:
        print(
            f"| {label} | {med['qps']:,.0f} | {med['qps'] / base:.2f}x | {med['hit']:.1%} | "
            f"{med['p50_ms']:.2f} | {med['p99_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
