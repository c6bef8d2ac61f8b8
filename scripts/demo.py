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
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from inferfleet.producer import Producer
from inferfleet.worker.bench.load import bench_inputs, run_bench, run_paced
from inferfleet.worker.bench.report import BenchReport
from inferfleet.worker.embedded import EmbeddedRedis
from tests.fixtures.build_models import example_inputs
from tests.fixtures.fleet_procs import last_line, start_workers

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


class WorkerWatch:
    """Notices within a fraction of a second a worker that exits while the demo runs.

    It says which one and the last line it logged, and interrupts the main thread
    (SIGINT, whatever call it blocks in) so the demo stops at once instead of
    waiting out its timeout.
    """

    def __init__(self, procs: list[subprocess.Popen], log_dir: Path, label: str) -> None:
        self.procs, self.log_dir, self.label = procs, log_dir, label
        self.failed: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="worker-watch", daemon=True)

    def __enter__(self) -> WorkerWatch:
        # a demo started in the background by a shell without job control (nohup, `&` in a
        # script, CI) inherits SIGINT ignored, and the watch's interrupt would be lost
        self._sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        signal.signal(signal.SIGINT, self._sigint)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    said = last_line(self.log_dir, self.label, i)
                    self.failed = (
                        f"worker {self.label}-{i} exited (status {proc.returncode}): {said}"
                    )
                    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
                    return


def run(url: str, requests: int, workers: int) -> None:
    model = ROOT / "models" / "ctr.pt"
    with tempfile.TemporaryDirectory(prefix="inferfleet-demo-") as logs:
        with console.status(f"loading and warming up {workers} workers"):
            procs = start_workers(url, "demo-ctr", str(model), workers, "demo", log_dir=Path(logs))
        try:
            with WorkerWatch(procs, Path(logs), "demo") as watch:
                try:
                    peak, moderate, error = _measure(url, model, requests)
                except KeyboardInterrupt:
                    if watch.failed is None:
                        raise
                    raise SystemExit(f"demo failed: {watch.failed}") from None
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    _report(workers, peak, moderate, error)


def _measure(url: str, model: Path, requests: int) -> tuple[BenchReport, BenchReport, float]:
    """The peak (``requests`` at once), the latency at half its rate, the worst output error."""
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
            peak = run_bench(
                producer,
                pool,
                requests,
                window=1000,
                warmup=500,
                timeout_s=60,
                on_reply=lambda done: bar.update(task, completed=done),
            )
            bar.update(task, completed=requests)
        with console.status(f"{MODERATE_S:.0f} s at half the peak ({peak.qps / 2:,.0f}/s)"):
            moderate = run_paced(producer, pool, peak.qps / 2, MODERATE_S, timeout_s=60)
        return peak, moderate, check_sample(producer, model)


#: How long the run at half the peak rate lasts.
MODERATE_S = 3.0


def _report(workers: int, peak: BenchReport, moderate: BenchReport, error: float) -> None:
    table = Table(title=f"inferfleet demo: CTR model, {workers} workers")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in [
        ("requests", f"{peak.requests:,}"),
        ("errors", str(peak.errors + moderate.errors)),
        ("peak QPS (all sent at once)", f"{peak.qps:,.0f}"),
        ("p50 / p99 at the peak (queueing)", f"{peak.p50_ms:.2f} / {peak.p99_ms:.2f} ms"),
        (
            f"p50 / p99 at {moderate.qps:,.0f}/s (half the peak)",
            f"{moderate.p50_ms:.2f} / {moderate.p99_ms:.2f} ms",
        ),
        ("mean batch rows at the peak", f"{peak.mean_batch_rows:.1f}"),
        ("max |fleet - direct torch|", f"{error:.2e}"),
    ]:
        table.add_row(label, value)
    console.print(table)
    if peak.errors or moderate.errors or error > 1e-4:
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
    server = EmbeddedRedis()
    try:
        server.start()
    except RuntimeError as exc:  # no Redis 7+ server: say what to install, in one line
        raise SystemExit(f"demo failed: {exc}") from None
    try:
        console.print(f"embedded Redis on {server.url}: {server.binary}", soft_wrap=True)
        run(server.url, args.requests, args.workers)
    finally:
        server.stop()
    console.print("every process the demo started has stopped")


if __name__ == "__main__":
    main()
