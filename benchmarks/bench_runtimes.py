#!/usr/bin/env python3
"""ONNX Runtime against TorchScript on the CPU: a bare predict loop per model and batch size.

Loads each example model as TorchScript (``models/KIND.pt``, built if
missing) and as ONNX (exported into a temporary folder by
tests/fixtures/export_onnx.py), fp32 and ``--precision int8``, through the worker's
runtime with the same ``--threads``, then times ``ModelRuntime.predict`` on
one batch in a tight loop. Runs are interleaved (every variant at one size,
then the next size, ``--runs`` times over), so a noisy neighbour hits all
variants alike; the table gives the median rows/s and the ratio to
TorchScript within the same run set.

    python -m benchmarks.bench_runtimes [--threads 1] [--batches 1,8,64] [--seconds 1] [--runs 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile

from benchmarks.bench_bare import rows_per_s
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.runtime.loading import ModelRuntime, load_runtime
from tests.fixtures.build_models import DEFAULT_MODELS, build, example_inputs
from tests.fixtures.export_onnx import export_onnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: (label, file suffix, precision); the first is the baseline of the ratios.
VARIANTS = [
    ("TorchScript", ".pt", "fp32"),
    ("ONNX Runtime", ".onnx", "fp32"),
    ("ONNX Runtime int8", ".onnx", "int8"),
]


def load_variants(kind: str, folder: str, threads: int, max_rows: int) -> dict[str, ModelRuntime]:
    script = os.path.join(ROOT, "models", f"{kind}.pt")
    if not os.path.exists(script):
        build(kind, os.path.join(ROOT, "models"))
    files = {".pt": script, ".onnx": export_onnx(kind, os.path.join(folder, f"{kind}.onnx"))}
    return {
        label: load_runtime(
            WorkerSettings(
                name=kind,
                model=files[suffix],
                precision=precision,
                device="cpu",
                torch_threads=threads,
                warmup_iters=1,
                max_batch_rows=max_rows,
            )
        )
        for label, suffix, precision in VARIANTS
    }


def measure(
    kind: str, runtimes: dict[str, ModelRuntime], batches: list[int], seconds: float, runs: int
) -> dict[tuple[str, int], list[float]]:
    """rows/s of every (variant, batch), ``runs`` samples each, interleaved."""
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(runs):
        for size in batches:
            x = example_inputs(kind, rows=size, seed=size)
            for label, runtime in runtimes.items():
                samples.setdefault((label, size), []).append(rows_per_s(runtime, x, seconds))
    return samples


def table(results: dict[str, dict[tuple[str, int], list[float]]], batches: list[int]) -> str:
    head = "| model | batch | " + " | ".join(f"{label} rows/s" for label, _, _ in VARIANTS)
    head += " | " + " | ".join(f"{label} / TorchScript" for label, _, _ in VARIANTS[1:]) + " |"
    lines = [head, "| --- | ---: |" + " ---: |" * (2 * len(VARIANTS) - 1)]
    for kind, samples in results.items():
        for size in batches:
            medians = [statistics.median(samples[(label, size)]) for label, _, _ in VARIANTS]
            ratios = [m / medians[0] for m in medians[1:]]
            lines.append(
                f"| {kind} | {size} | "
                + " | ".join(f"{m:,.0f}" for m in medians)
                + " | "
                + " | ".join(f"{r:.2f}x" for r in ratios)
                + " |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads", type=int, default=1, help="torch and ONNX Runtime intra-op threads (default 1)"
    )
    parser.add_argument("--batches", default="1,8,64", help="batch sizes (default 1,8,64)")
    parser.add_argument(
        "--seconds", type=float, default=1.0, help="length of one timed loop (default 1)"
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="samples per cell; the median is reported (default 3)"
    )
    parser.add_argument(
        "--only", default=",".join(DEFAULT_MODELS), help="comma-separated subset of affine,ctr,cnn"
    )
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches takes comma-separated integers, got {args.batches!r}")
    kinds = args.only.split(",")
    if (
        any(k not in DEFAULT_MODELS for k in kinds)
        or min(batches) < 1
        or args.runs < 1
        or args.seconds <= 0
    ):
        parser.error(
            f"--only takes {', '.join(DEFAULT_MODELS)}; batches, --runs and --seconds must be "
            "positive"
        )
    logging.basicConfig(level=logging.ERROR)
    results = {}
    with tempfile.TemporaryDirectory(prefix="inferfleet-runtimes-") as folder:
        for kind in kinds:
            runtimes = load_variants(kind, folder, args.threads, max(batches))
            results[kind] = measure(kind, runtimes, batches, args.seconds, args.runs)
            print(f"  {kind} done", file=sys.stderr, flush=True)
    print(f"threads {args.threads}, {args.seconds:g} s per loop, median of {args.runs}")
    print(table(results, batches))


if __name__ == "__main__":
    main()
