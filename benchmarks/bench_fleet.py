#!/usr/bin/env python3
"""Benchmark a fleet end to end, several runs, medians: the numbers in docs/benchmarks.md.

Starts a private redis-server, ``--workers`` worker processes with
``--worker-arg`` options, then runs ``inferfleet bench`` ``--runs`` times and
prints every run and the median of each figure as a markdown table row.

    python -m benchmarks.bench_fleet --model models/affine.pt --requests 50000 --runs 5
    python -m benchmarks.bench_fleet --model models/ctr.pt --worker-arg=--max-batch-rows=1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from inferfleet.worker.embedded import EmbeddedRedis
from tests.fixtures.fleet_procs import start_workers

ROOT = Path(__file__).resolve().parent.parent

FIGURES = ("qps", "p50_ms", "p95_ms", "p99_ms", "mean_batch_rows")


def bench_once(url: str, name: str, model: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "inferfleet",
        "bench",
        "--name",
        name,
        "--model",
        model,
        "--json",
        "-n",
        str(args.requests),
        "--window",
        str(args.window),
        "--rows",
        str(args.rows),
        "--warmup",
        str(args.warmup),
    ]
    out = subprocess.run(
        cmd,
        env=dict(os.environ, REDIS_URL=url, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout)["runs"][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--worker-arg", action="append", default=[], help="passed to each worker (repeat)"
    )
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--window", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    name = "bench"
    with EmbeddedRedis() as server:
        procs = start_workers(server.url, name, args.model, args.workers, "bench", args.worker_arg)
        try:
            runs = []
            for i in range(args.runs):
                runs.append(bench_once(server.url, name, args.model, args))
                print(
                    f"run {i + 1}: " + "  ".join(f"{k} {runs[-1][k]}" for k in FIGURES), flush=True
                )
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    med = {k: statistics.median(r[k] for r in runs) for k in FIGURES}
    print("median: " + "  ".join(f"{k} {v:.2f}" for k, v in med.items()))
    print(
        f"| {Path(args.model).name} | {args.workers} | {' '.join(args.worker_arg) or '-'} | "
        f"{med['qps']:,.0f} | {med['p50_ms']:.2f} | {med['p99_ms']:.2f} | "
        f"{med['mean_batch_rows']:.1f} |"
    )


if __name__ == "__main__":
    main()
