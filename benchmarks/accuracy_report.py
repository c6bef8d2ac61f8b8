#!/usr/bin/env python3
"""What 8-bit (and 16-bit) costs: each example model at every precision against fp32, as a markdown
table.

For affine, ctr and cnn (weights from tests/fixtures/build_models.py's seeds) the
script saves a torch.export program and an ONNX file into a temporary folder,
loads each through the worker's own runtime (``load_runtime``, one thread,
CPU) at fp32, bf16, fp16 and int8 (torch) and fp32 and int8 (ONNX Runtime),
runs one fixed seeded input set (``--rows``, default 4,096) and compares with
torch fp32:

* max |err|: the largest absolute difference of any output;
* max rel err: that difference over the largest |fp32 output| (a norm-wise
  relative error; element-wise ratios explode on outputs near zero);
* top-1: rows whose argmax over the last axis agrees; for the one-output CTR
  model, rows whose decision (p >= 0.5) agrees, and the Spearman rank
  correlation of the scores (does the ranking of ads survive?);
* rows/s: single-process throughput at ``--batch`` rows, median of 3 runs
  (the variants of a model interleaved, so ratios come from one run).

    python -m benchmarks.accuracy_report [--rows 4096] [--batch 64] [--seconds 1] [--only \\
        affine,ctr,cnn] [--device cpu]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.bench_bare import rows_per_s
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.runtime.loading import ModelRuntime, load_runtime
from tests.fixtures.build_models import DEFAULT_MODELS, example_inputs, save_export
from tests.fixtures.export_onnx import export_onnx

#: (label, file suffix, precision); the first is the reference.
VARIANTS = [
    ("torch fp32", ".pt2", "fp32"),
    ("torch bf16", ".pt2", "bf16"),
    ("torch fp16", ".pt2", "fp16"),
    ("torch int8", ".pt2", "int8"),
    ("ORT fp32", ".onnx", "fp32"),
    ("ORT int8", ".onnx", "int8"),
]
_INPUT_SEED = 1234


@dataclass
class Row:
    """One model at one precision, against the torch fp32 reference."""

    model: str
    variant: str
    max_abs: float
    max_rel: float
    top1: float
    extra: str
    rows_per_s: float


def rank(a: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 of a 1-d array (ties broken by position: scores here are floats)."""
    order = np.argsort(a, kind="stable")
    ranks = np.empty(len(a), dtype=np.float64)
    ranks[order] = np.arange(len(a))
    return ranks


def compare(reference: np.ndarray, other: np.ndarray) -> tuple[float, float, float, str]:
    """(max |err|, max |err| / max |ref|, top-1 agreement, extra): see the module docstring."""
    diff = np.abs(other.astype(np.float64) - reference.astype(np.float64))
    max_abs = float(diff.max())
    max_rel = max_abs / float(np.abs(reference).max())
    if reference.shape[-1] == 1:  # one score per row: a click probability
        ref, got = reference.reshape(-1), other.reshape(-1)
        top1 = float(np.mean((ref >= 0.5) == (got >= 0.5)))
        spearman = float(np.corrcoef(rank(ref), rank(got))[0, 1])
        return max_abs, max_rel, top1, f"Spearman {spearman:.6f}"
    top1 = float(np.mean(reference.argmax(-1) == other.argmax(-1)))
    return max_abs, max_rel, top1, ""


def predict_all(runtime: ModelRuntime, inputs: Any, batch: int) -> np.ndarray:
    """The outputs for every row, ``batch`` rows at a time (as a worker would batch them)."""
    rows = len(inputs["dense"]) if isinstance(inputs, dict) else len(inputs)
    parts = []
    for start in range(0, rows, batch):
        part = (
            {k: v[start : start + batch] for k, v in inputs.items()}
            if isinstance(inputs, dict)
            else inputs[start : start + batch]
        )
        parts.append(runtime.predict(part, {}))
    return np.concatenate(parts)


def throughputs(
    runtimes: list[ModelRuntime], inputs: Any, batch: int, seconds: float
) -> list[float]:
    """Median rows/s of each runtime over 3 rounds, interleaved so a noisy neighbour hits all
    alike."""
    part = {k: v[:batch] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[:batch]
    samples = [[rows_per_s(runtime, part, seconds) for runtime in runtimes] for _ in range(3)]
    return [statistics.median(column) for column in zip(*samples)]


def report_model(
    kind: str, folder: str, rows: int, batch: int, seconds: float, device: str
) -> list[Row]:
    """Every variant of ``kind`` against torch fp32 (on a GPU: the torch fp32/bf16/fp16 ones)."""
    files = {
        ".pt2": save_export(kind, os.path.join(folder, f"{kind}.pt2")),
        ".onnx": export_onnx(kind, os.path.join(folder, f"{kind}.onnx")),
    }
    variants = (
        VARIANTS if device == "cpu" else VARIANTS[:3]
    )  # int8 is CPU only; ORT-GPU is another wheel
    inputs = example_inputs(kind, rows=rows, seed=_INPUT_SEED)
    runtimes = [
        load_runtime(
            WorkerSettings(
                name=kind,
                model=files[suffix],
                precision=precision,
                torch_threads=1,
                device=device,
                warmup_iters=1,
                max_batch_rows=batch,
            )
        )
        for _, suffix, precision in variants
    ]
    outputs = [predict_all(runtime, inputs, batch) for runtime in runtimes]
    speeds = throughputs(runtimes, inputs, batch, seconds)
    print(f"  {kind} done", file=sys.stderr, flush=True)
    return [
        Row(kind, label, *compare(outputs[0], out), speed)
        for (label, _, _), out, speed in zip(variants, outputs, speeds)
    ]


def markdown(rows: list[Row]) -> str:
    lines = [
        "| model | precision | max abs err | max rel err | top-1 agreement | rank agreement | "
        "rows/s |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.variant} | {r.max_abs:.2e} | {r.max_rel:.2e} | {100 * r.top1:.2f} % "
            f"| {r.extra} | {r.rows_per_s:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, default=4096, help="rows in the fixed input set (default 4096)"
    )
    parser.add_argument("--batch", type=int, default=64, help="rows per predict call (default 64)")
    parser.add_argument(
        "--seconds", type=float, default=1.0, help="length of each throughput run (default 1)"
    )
    parser.add_argument(
        "--only", default=",".join(DEFAULT_MODELS), help="comma-separated subset of affine,ctr,cnn"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: torch fp32, bf16 and fp16 only (default cpu)",
    )
    args = parser.parse_args()
    kinds = args.only.split(",")
    if (
        any(k not in DEFAULT_MODELS for k in kinds)
        or args.rows < 1
        or args.batch < 1
        or args.seconds <= 0
    ):
        parser.error(
            f"--only takes {', '.join(DEFAULT_MODELS)}; --rows, --batch and --seconds must be "
            "positive"
        )
    logging.basicConfig(level=logging.ERROR)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="inferfleet-accuracy-") as folder:
        for kind in kinds:
            rows.extend(
                report_model(kind, folder, args.rows, args.batch, args.seconds, args.device)
            )
    print(markdown(rows))


if __name__ == "__main__":
    main()
