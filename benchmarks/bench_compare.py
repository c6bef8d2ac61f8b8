#!/usr/bin/env python3
"""The fleet against the naive baseline on each example model, one summary table.

For each model runs ``inferfleet bench --spawn N --model models/M.pt --baseline naive``
(a closed loop, or an open-loop sweep with ``--rates``) on a private Redis, keeps
each model's report.md, report.json and report.png under ``--out``/M/, and prints
one markdown table: per model and run, QPS and p99 of the fleet and of the naive
server, their ratios, and both first-request latencies.

    python -m benchmarks.bench_compare --out /tmp/compare -n 20000 --concurrency 64
    python -m benchmarks.bench_compare --models ctr --rates 500,1000,2000 \\
        --worker-arg=--max-batch-rows=32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEADER = (
    "| model | run | fleet QPS | naive QPS | QPS fleet/naive | fleet p99 ms | naive p99 ms "
    "| p99 fleet/naive | fleet first ms | naive first ms |\n"
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def bench_model(model: str, out: Path, args: argparse.Namespace) -> dict:
    """One ``inferfleet bench`` run of the fleet and the naive server; its JSON report."""
    load = ["--rates", args.rates] if args.rates else ["--concurrency", str(args.concurrency)]
    cmd = [
        sys.executable,
        "-m",
        "inferfleet",
        "bench",
        "--spawn",
        str(args.workers),
        "--model",
        str(ROOT / "models" / f"{model}.pt"),
        "--baseline",
        "naive",
        "-n",
        str(args.requests),
        *load,
        *(f"--worker-arg={a}" for a in args.worker_arg),
        "--json",
        "--out",
        str(out / model),
    ]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"inferfleet bench failed on {model} (status {done.returncode})")
    return json.loads(done.stdout)


def summary_rows(model: str, report: dict) -> list[str]:
    """Table rows of one model: fleet and naive side by side for every run."""
    fleet = [r for r in report["runs"] if r["target"] == "fleet"]
    naive = [r for r in report["runs"] if r["target"] == "naive"]
    first = report["first_ms"]
    rows = []
    for f, n, ratio in zip(fleet, naive, report["comparison"]):
        rows.append(
            f"| {model} | {ratio['run']} | {f['qps']:,.0f} | {n['qps']:,.0f} | "
            f"{ratio['qps_ratio']:.2f}x | {f['p99_ms']:.2f} | {n['p99_ms']:.2f} | "
            f"{ratio['p99_ratio']:.2f}x "
            f"| {first.get('fleet', 0):.1f} | {first.get('naive', 0):.1f} |"
        )
    return rows


def main() -> None:
    """Run every model, write the reports and the summary, print the summary."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--models", default="affine,ctr,cnn", help="comma-separated names under models/"
    )
    parser.add_argument("--workers", type=int, default=1, help="spawned fleet workers")
    parser.add_argument(
        "--worker-arg", action="append", default=[], help="passed to each worker (repeat)"
    )
    parser.add_argument("-n", "--requests", type=int, default=20_000, help="requests per run")
    parser.add_argument(
        "--concurrency", type=int, default=64, help="closed loop: requests in flight"
    )
    parser.add_argument("--rates", default=None, help="open-loop sweep instead, e.g. 500,1000,2000")
    parser.add_argument("--out", default="bench-compare", help="directory for each model's reports")
    args = parser.parse_args()
    out = Path(args.out)
    lines = [HEADER]
    for model in args.models.split(","):
        lines += summary_rows(model, bench_model(model, out, args))
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
