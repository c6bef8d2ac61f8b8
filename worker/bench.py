"""``inferfleet bench``: push requests through the SDK and measure the fleet.

Latency is client-side, end to end: from just before a request's pipeline
is sent to the moment its reply is taken from the inbox. Percentiles come
from every measured request (warm-up requests excluded).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from producer import Producer
from worker.npfiles import load_inputs

__all__ = ["BenchError", "BenchReport", "bench_inputs", "run_bench"]

_POOL = 256  # distinct inputs cycled through (avoids measuring input generation)


class BenchError(ValueError):
    """The benchmark was asked for something it cannot do."""


@dataclass
class BenchReport:
    """What one benchmark run measured. Times in milliseconds."""

    requests: int
    seconds: float
    qps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    mean_batch_rows: float
    errors: int

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}

    def text(self) -> str:
        return (f"requests {self.requests}  errors {self.errors}  time {self.seconds:.2f} s\n"
                f"QPS {self.qps:,.0f}\n"
                f"latency ms  p50 {self.p50_ms:.2f}  p95 {self.p95_ms:.2f}  p99 {self.p99_ms:.2f}  "
                f"max {self.max_ms:.2f}\n"
                f"mean batch rows {self.mean_batch_rows:.1f}")


def _random_like(example: Any, rows: int, rng: np.random.Generator) -> Any:
    if isinstance(example, dict):
        return {k: _random_like(v, rows, rng) for k, v in example.items()}
    if isinstance(example, list):
        return [_random_like(v, rows, rng) for v in example]
    shape = (rows, *example.shape[1:])
    if example.dtype.kind == "f":
        return rng.standard_normal(shape).astype(example.dtype)
    if example.dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    high = int(min(np.iinfo(example.dtype).max, 10**6))
    return rng.integers(0, high, shape, dtype=example.dtype)


def bench_inputs(model_path: str | None, input_path: str | None, rows: int, seed: int = 0) -> list[Any]:
    """A pool of random inputs shaped like the model's example (or a file's)."""
    if (model_path is None) == (input_path is None):
        raise BenchError("give exactly one of --model (use its example) or --input (a .npy/.npz file)")
    if rows < 1:
        raise BenchError(f"--rows must be at least 1, got {rows}")
    if input_path is not None:
        example = load_inputs(input_path)
    else:
        import torch

        from worker.runtime import load_model

        example = load_model(model_path, torch.device("cpu"))[1]  # type: ignore[arg-type]
        if example is None:
            raise BenchError(f"{model_path} carries no example inputs: pass --input instead")
    rng = np.random.default_rng(seed)
    return [_random_like(example, rows, rng) for _ in range(_POOL)]


def run_bench(producer: Producer, pool: list[Any], requests: int, window: int, warmup: int,
              timeout_s: float, on_reply: Callable[[int], None] | None = None) -> BenchReport:
    """Send ``warmup`` then ``requests`` requests with at most ``window`` in flight.

    ``on_reply(done)`` is called every 500 replies (progress bars).
    """
    if requests < 1:
        raise BenchError(f"--requests must be at least 1, got {requests}")
    if warmup:
        producer.map((pool[i % len(pool)] for i in range(warmup)), window=window, timeout_s=timeout_s)
    sent_at: dict[str, float] = {}

    def stamp(rids: list[str]) -> None:
        now = time.perf_counter()
        for rid in rids:
            sent_at[rid] = now

    latencies = np.empty(requests)
    batch_rows = np.empty(requests)
    errors = 0
    started = time.perf_counter()
    inputs = (pool[i % len(pool)] for i in range(requests))
    for i, reply in enumerate(producer.imap(inputs, window=window, timeout_s=timeout_s, on_send=stamp)):
        latencies[i] = time.perf_counter() - sent_at.pop(reply.id)
        batch_rows[i] = reply.timing.get("batch_rows", 0)
        errors += not reply.ok
        if on_reply is not None and (i + 1) % 500 == 0:
            on_reply(i + 1)
    seconds = time.perf_counter() - started
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99]) * 1000
    return BenchReport(requests, seconds, requests / seconds, float(p50), float(p95), float(p99),
                       float(latencies.max() * 1000), float(batch_rows.mean()), errors)
