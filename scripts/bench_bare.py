#!/usr/bin/env python3
"""The ceiling: a bare torch loop on an example model, no Redis, no batching logic.

Runs the model's forward in a tight loop at several batch sizes under
``torch.inference_mode`` with the same thread settings as a worker, and
prints rows per second at each size and the best. The fleet's throughput is
compared against the best of these in docs/benchmarks.md.

    python scripts/bench_bare.py --model models/cnn.pt --threads 1 --batches 1,8,16,32,64,128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inferfleet.worker.bench.load import bench_inputs  # noqa: E402
from inferfleet.worker.config import WorkerSettings  # noqa: E402
from inferfleet.worker.runtime.loading import load_runtime  # noqa: E402


def rows_per_s(runtime, inputs, seconds: float) -> float:
    runtime.predict(inputs, {})  # warm this size
    done, started = 0, time.perf_counter()
    rows = next(iter(inputs.values())).shape[0] if isinstance(inputs, dict) else inputs.shape[0]
    while time.perf_counter() - started < seconds:
        runtime.predict(inputs, {})
        done += rows
    return done / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,8,16,32,64,128")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    settings = WorkerSettings(name="bare", model=args.model, torch_threads=args.threads, device=args.device,
                              warmup_iters=1)
    runtime = load_runtime(settings)
    results = {}
    for size in map(int, args.batches.split(",")):
        batch = bench_inputs(args.model, None, rows=size)[0]
        results[size] = rows_per_s(runtime, batch, args.seconds)
        print(f"batch {size:4d}: {results[size]:10,.0f} rows/s", flush=True)
    best = max(results, key=lambda k: results[k])
    print(json.dumps({"model": Path(args.model).name, "threads": args.threads, "best_batch": best,
                      "best_rows_per_s": round(results[best])}))


if __name__ == "__main__":
    main()
