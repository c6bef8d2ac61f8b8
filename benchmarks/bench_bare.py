#!/usr/bin/env python3
"""The ceiling: a bare torch loop on an example model, no Redis, no batching logic.

Loads the model once (with the worker's own runtime: the same device
placement, precision, thread settings and warm-up), then runs its forward
in a tight loop at several batch sizes under ``torch.inference_mode`` on one
random input per size, and prints rows per second at each size. The last
line is JSON: the best size and rate, every size's rate, and on a GPU the
peak memory torch's allocator held (allocated and reserved, MiB). The
fleet's throughput is compared against the best of these in docs/benchmarks.md.

    python -m benchmarks.bench_bare --model models/cnn.pt --threads 1 --batches 1,8,16,32,64,128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from inferfleet.worker.config import PRECISIONS, WorkerSettings
from inferfleet.worker.runtime.devices import peak_memory_mib
from inferfleet.worker.runtime.loading import load_runtime


def rows_per_s(runtime, inputs, seconds: float) -> float:
    runtime.predict(inputs, {})  # warm this size
    done, started = 0, time.perf_counter()
    rows = next(iter(inputs.values())).shape[0] if isinstance(inputs, dict) else inputs.shape[0]
    while time.perf_counter() - started < seconds:
        runtime.predict(inputs, {})  # outputs come back as numpy: every call waits for the device
        done += rows
    return done / (time.perf_counter() - started)


def random_like(example: Any, rows: int, rng: np.random.Generator) -> Any:
    """One random input of ``rows`` rows shaped like the model's example (ids kept in its range)."""
    if isinstance(example, dict):
        return {k: random_like(v, rows, rng) for k, v in example.items()}
    if isinstance(example, list):
        return [random_like(v, rows, rng) for v in example]
    shape = (rows, *example.shape[1:])
    if example.dtype.kind == "f":
        return rng.standard_normal(shape).astype(example.dtype)
    return rng.choice(
        example.reshape(-1), size=shape
    )  # ids the model accepts: an embedding's range


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,8,16,32,64,128")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sizes = [int(b) for b in args.batches.split(",")]
    settings = WorkerSettings(
        name="bare",
        model=args.model,
        torch_threads=args.threads,
        device=args.device,
        precision=args.precision,
        max_batch_rows=max(sizes),
        warmup_iters=1,
    )
    runtime = load_runtime(settings)
    if runtime.example is None:
        sys.exit(f"{args.model} carries no example inputs to shape the batches from")
    rng = np.random.default_rng(0)
    results = {}
    for size in sizes:
        results[size] = rows_per_s(runtime, random_like(runtime.example, size, rng), args.seconds)
        print(f"batch {size:4d}: {results[size]:10,.0f} rows/s", flush=True)
    best = max(results, key=lambda k: results[k])
    peak = peak_memory_mib(runtime.device)
    print(
        json.dumps(
            {
                "model": Path(args.model).name,
                "threads": args.threads,
                "device": str(runtime.device),
                "precision": args.precision,
                "best_batch": best,
                "best_rows_per_s": round(results[best]),
                "rows_per_s": {str(k): round(v) for k, v in results.items()},
                "peak_allocated_mib": round(peak[0]) if peak else None,
                "peak_reserved_mib": round(peak[1]) if peak else None,
            }
        )
    )


if __name__ == "__main__":
    main()
