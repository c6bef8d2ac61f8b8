#!/usr/bin/env python3
"""The inferfleet demo: a fleet of CTR workers end to end, on a private Redis.

Starts an embedded redis-server (unless REDIS_URL is set), builds nothing
(scripts/demo already built the example models), starts two worker
processes, pushes a few thousand ad-ranking requests through the SDK with a
progress bar, checks a sample of replies against a direct torch forward,
prints a report, and stops every process it started.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from inferfleet.producer import Producer
from inferfleet.worker.bench.load import bench_inputs, run_bench
from inferfleet.worker.embedded import EmbeddedRedis
from tests.fixtures.build_models import example_inputs
from tests.fixtures.fleet_procs import start_workers

ROOT = Path(__file__).resolve().parent.parent

console = Console()


def check_sample(producer: Producer, model: Path) -> float:
    """Largest absolute difference between fleet replies and a direct forward."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        direct = torch.jit.load(str(model))
    worst = 0.0
    for seed in range(20):
        x = example_inputs("ctr", rows=1 + seed % 4, seed=1000 + seed)
        got = producer.result(producer.submit(x), timeout_s=30).outputs
        with torch.no_grad():
            want = direct(**{k: torch.from_numpy(v) for k, v in x.items()}).numpy()
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


def run(url: str, requests: int, workers: int) -> None:
    model = ROOT / "models" / "ctr.pt"
    with console.status(f"loading and warming up {workers} workers"):
        procs = start_workers(url, "demo-ctr", str(model), workers, "demo")
    try:
        with Producer(url, "demo-ctr") as producer:
            pool = bench_inputs(str(model), None, rows=1)
            columns = (
                TextColumn("[bold]requests"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
            )
            with Progress(*columns, console=console) as bar:
                task = bar.add_task("requests", total=requests)
                report = run_bench(
                    producer,
                    pool,
                    requests,
                    window=1000,
                    warmup=500,
                    timeout_s=60,
                    on_reply=lambda done: bar.update(task, completed=done),
                )
                bar.update(task, completed=requests)
            error = check_sample(producer, model)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    table = Table(title=f"inferfleet demo: CTR model, {workers} workers")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in [
        ("requests", f"{report.requests:,}"),
        ("errors", str(report.errors)),
        ("QPS", f"{report.qps:,.0f}"),
        ("p50 latency", f"{report.p50_ms:.2f} ms"),
        ("p99 latency", f"{report.p99_ms:.2f} ms"),
        ("mean batch rows", f"{report.mean_batch_rows:.1f}"),
        ("max |fleet - direct torch|", f"{error:.2e}"),
    ]:
        table.add_row(label, value)
    console.print(table)
    if report.errors or error > 1e-4:
        raise SystemExit("demo failed: errors in replies or outputs differ from a direct forward")


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the inferfleet fleet end to end.")
    parser.add_argument(
        "--requests", type=int, default=5000, help="requests to push (default 5000)"
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args()
    if os.environ.get("REDIS_URL"):
        console.print(f"using REDIS_URL={os.environ['REDIS_URL']}")
        run(os.environ["REDIS_URL"], args.requests, args.workers)
        return
    with EmbeddedRedis(allow_fake=True) as server:
        kind = "fakeredis TCP server (no redis-server found)" if server.fake else server.binary
        console.print(f"embedded Redis on {server.url}: {kind}")
        run(server.url, args.requests, args.workers)
    console.print("every process the demo started has stopped")


if __name__ == "__main__":
    main()
