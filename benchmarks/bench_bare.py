#!/usr/bin/env python3
"""The ceiling: a bare torch loop on an example model, no Redis, no batching logic.

Loads the model once (the worker's loader: the same device placement,
precision and threads; fp16/bf16 cast the weights, the article's
``model.half()``), then times the model alone: its forward in a tight loop
at several batch sizes under ``torch.inference_mode``, on one random input
per size placed on the device (and cast) once, with nothing copied back and
one device synchronisation a size, so no transfer or numpy conversion is in
it. Convolutional models (4-d inputs) run ``channels_last`` with
``cudnn.benchmark`` on a GPU. Prints rows per second at each size. The last
line is JSON: the best size and rate, every size's rate, TF32 as it ran, on
a GPU the peak memory torch's allocator held (allocated and reserved, MiB),
and the outputs of a fixed input against the fp32 model's (max error
relative to the largest fp32 output, and whether they differ at all: a
reduced precision that silently ran in fp32 would not). The fleet's
throughput is compared against the best of these in docs/benchmarks.md.

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
import torch

from inferfleet.worker.config import PRECISIONS, WorkerSettings
from inferfleet.worker.runtime.devices import peak_memory_mib, tf32_state
from inferfleet.worker.runtime.loading import ModelRuntime, cast_floats, load_runtime


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_input(runtime: ModelRuntime, inputs: Any) -> Any:
    """``inputs`` as the model takes them, on its device, in its precision: done once."""
    x = runtime.handler.preprocess(inputs, {})
    if runtime.precision in ("fp16", "bf16"):  # as the worker does: floats cast, ids left alone
        x = cast_floats(x, torch.float16 if runtime.precision == "fp16" else torch.bfloat16)
    if _is_image_batch(x):
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def _is_image_batch(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 4  # float, or uint8 images


def rows_per_s(runtime: ModelRuntime, x: Any, rows: int, seconds: float) -> float:
    """The model's own forward on ``x`` in a loop for about ``seconds``: rows per second."""
    predict, device = runtime.handler.predict, runtime.device
    amp = runtime.precision == "amp"  # the fp32 model under autocast, as the worker runs it
    with torch.inference_mode(), torch.autocast(device.type, torch.float16, enabled=amp):
        predict(x, {})  # warm this size (and let cudnn.benchmark pick its kernels)
        _sync(device)
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            for _ in range(8):  # queue a few launches between clock reads
                predict(x, {})
            done += 8 * rows
            _sync(device)
        return done / (time.perf_counter() - started)


def against_fp32(model: str, runtime: ModelRuntime, inputs: Any, threads: int) -> dict:
    """The precision's outputs for ``inputs`` against the fp32 model's on the same device."""
    if runtime.precision == "fp32":
        return {"max_rel_error": 0.0, "differs": False}
    full = load_runtime(
        WorkerSettings(
            name="bare-fp32",
            model=model,
            torch_threads=threads,
            device=str(runtime.device),
            warmup_iters=0,
        )
    ).predict(inputs, {})
    reduced = runtime.predict(inputs, {})
    if not (isinstance(full, np.ndarray) and isinstance(reduced, np.ndarray)):
        return {"max_rel_error": None, "differs": None}  # several outputs: not compared here
    scale = float(np.abs(full).max()) or 1.0
    return {
        "max_rel_error": float(np.abs(reduced - full).max()) / scale,
        "differs": not np.array_equal(reduced, full),
    }


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
        x = bare_input(runtime, random_like(runtime.example, size, rng))
        if size == sizes[0] and _is_image_batch(x):
            _channels_last(runtime)
        results[size] = rows_per_s(runtime, x, size, args.seconds)
        print(f"batch {size:4d}: {results[size]:10,.0f} rows/s", flush=True)
    best = max(results, key=lambda k: results[k])
    peak = peak_memory_mib(runtime.device)
    fixed = random_like(runtime.example, min(sizes[-1], 8), np.random.default_rng(1))
    print(
        json.dumps(
            {
                "model": Path(args.model).name,
                "threads": args.threads,
                "device": str(runtime.device),
                "precision": args.precision,
                "tf32": tf32_state(),
                "best_batch": best,
                "best_rows_per_s": round(results[best]),
                "rows_per_s": {str(k): round(v) for k, v in results.items()},
                "peak_allocated_mib": round(peak[0]) if peak else None,
                "peak_reserved_mib": round(peak[1]) if peak else None,
                "against_fp32": against_fp32(args.model, runtime, fixed, args.threads),
            }
        )
    )


def _channels_last(runtime: ModelRuntime) -> None:
    """A CNN's weights in channels_last (NHWC), and cuDNN left to pick the fastest kernels."""
    for name, value in list(vars(runtime.handler).items()):
        if isinstance(value, torch.nn.Module):
            setattr(runtime.handler, name, value.to(memory_format=torch.channels_last))
    if runtime.device.type == "cuda":
        torch.backends.cudnn.benchmark = True


if __name__ == "__main__":
    main()
