#!/usr/bin/env python3
"""The CPU performance targets of docs/benchmarks.md, measured in one command.

For each target, ``--runs`` repetitions (ratios are taken within a run), and
the median printed as a markdown table:

* ctr:    fleet QPS against the naive baseline (closed loop, 256 in flight),
          then p99 of an open Poisson load at half the fleet's peak QPS;
* cnn:    fleet QPS (32-row batches, read-ahead on) against a bare torch loop
          at its best batch size (no Redis), then p99 of an open Poisson load
          at half the fleet's peak;
* first:  the first request after start against the steady-state p50, beside
          the naive baseline's first request (which pays the model load).

    python -m benchmarks.bench_targets --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str) -> dict:
    cmd = [sys.executable, "-m", "inferfleet", "bench", "--spawn", "1", "--json", *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def runs_of(report: dict) -> dict[str, dict]:
    return {run["target"]: run for run in report["runs"]}


def bare_best(model: str, batches: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_bare",
        "--model",
        model,
        "--threads",
        "1",
        "--batches",
        batches,
        "--seconds",
        "2",
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ctr_run() -> dict:
    model = str(ROOT / "models" / "ctr.pt")
    closed = runs_of(
        bench("--model", model, "--baseline", "naive", "-n", "20000", "--concurrency", "256")
    )
    half = closed["fleet"]["qps"] / 2
    opened = runs_of(
        bench("--model", model, "--rate", f"{half:.0f}", "--arrival", "poisson", "-n", "20000")
    )
    return {
        "fleet_qps": closed["fleet"]["qps"],
        "naive_qps": closed["naive"]["qps"],
        "ratio": closed["fleet"]["qps"] / closed["naive"]["qps"],
        "half_rate": half,
        "half_p99_ms": opened["fleet"]["p99_ms"],
        "half_p50_ms": opened["fleet"]["p50_ms"],
    }


def cnn_run(rows: int) -> dict:
    model = str(ROOT / "models" / "cnn.pt")
    bare = bare_best(model, "8,16,32,64")
    worker = (f"--worker-arg=--max-batch-rows={rows}", "--worker-arg=--prefetch=on")
    closed = runs_of(bench("--model", model, "-n", "6000", "--concurrency", "256", *worker))
    half = closed["fleet"]["qps"] / 2
    opened = runs_of(
        bench(
            "--model", model, "--rate", f"{half:.0f}", "--arrival", "poisson", "-n", "4000", *worker
        )
    )
    return {
        "bare_rows_per_s": bare["best_rows_per_s"],
        "bare_batch": bare["best_batch"],
        "fleet_qps": closed["fleet"]["qps"],
        "ratio": closed["fleet"]["qps"] / bare["best_rows_per_s"],
        "half_rate": half,
        "half_p99_ms": opened["fleet"]["p99_ms"],
        "half_p50_ms": opened["fleet"]["p50_ms"],
    }


def first_run() -> dict:
    model = str(ROOT / "models" / "ctr.pt")
    report = runs_of(
        bench("--model", model, "--baseline", "naive", "-n", "5000", "--concurrency", "64")
    )
    fleet = report["fleet"]
    return {
        "first_ms": fleet["first_ms"],
        "p50_ms": fleet["p50_ms"],
        "ratio": fleet["first_ms"] / fleet["p50_ms"],
        "naive_first_ms": report["naive"]["first_ms"],
    }


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def joined(runs: list[dict], key: str, fmt: str) -> str:
    return ", ".join(fmt.format(r[key]) for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--cnn-rows", type=int, default=32, help="--max-batch-rows of the CNN worker"
    )
    args = parser.parse_args()
    ctr = [ctr_run() for _ in range(args.runs)]
    cnn = [cnn_run(args.cnn_rows) for _ in range(args.runs)]
    first = [first_run() for _ in range(args.runs)]
    for name, runs in (("ctr", ctr), ("cnn", cnn), ("first", first)):
        for run in runs:
            print(
                f"{name}: {json.dumps({k: round(v, 3) for k, v in run.items()})}", file=sys.stderr
            )
    print(f"| target | measured (median of {args.runs}) | runs |")
    print("| --- | --- | --- |")
    print(
        f"| ctr: fleet QPS / naive QPS (256 in flight) | {median(ctr, 'ratio'):.2f}x "
        f"({median(ctr, 'fleet_qps'):,.0f} / {median(ctr, 'naive_qps'):,.0f}) | "
        f"{joined(ctr, 'ratio', '{:.2f}x')} |"
    )
    print(
        f"| ctr: p99 at half the peak ({median(ctr, 'half_rate'):,.0f}/s, Poisson) | "
        f"{median(ctr, 'half_p99_ms'):.2f} ms (p50 {median(ctr, 'half_p50_ms'):.2f}) | "
        f"{joined(ctr, 'half_p99_ms', '{:.2f}')} |"
    )
    print(
        f"| cnn: fleet QPS / bare loop (best batch) | {median(cnn, 'ratio'):.0%} "
        f"({median(cnn, 'fleet_qps'):,.0f} / {median(cnn, 'bare_rows_per_s'):,.0f} rows/s) | "
        f"{joined(cnn, 'ratio', '{:.0%}')} |"
    )
    print(
        f"| cnn: p99 at half the peak ({median(cnn, 'half_rate'):,.0f}/s, Poisson) | "
        f"{median(cnn, 'half_p99_ms'):.2f} ms (p50 {median(cnn, 'half_p50_ms'):.2f}) | "
        f"{joined(cnn, 'half_p99_ms', '{:.2f}')} |"
    )
    print(
        f"| first request / steady p50 (ctr, 64 in flight) | {median(first, 'ratio'):.2f}x "
        f"({median(first, 'first_ms'):.2f} / {median(first, 'p50_ms'):.2f} ms; naive first "
        f"{median(first, 'naive_first_ms'):.1f} ms) | {joined(first, 'ratio', '{:.2f}x')} |"
    )


if __name__ == "__main__":
    main()
