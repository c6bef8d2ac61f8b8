"""What a bench run sends: the plan (closed or open loop), the inputs and the send schedule.

All of it is pure but :func:`bench_inputs`, which reads ``--input`` or the
model's example; :mod:`inferfleet.worker.bench.load` runs the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from inferfleet.worker.bench.fleet import BenchError
from inferfleet.worker.bench.report import RunSpec
from inferfleet.worker.npfiles import load_inputs

__all__ = [
    "ARRIVALS",
    "DEFAULT_CONCURRENCY",
    "BenchPlan",
    "bench_inputs",
    "parse_rates",
    "send_schedule",
]

#: How an open loop's requests arrive: evenly spaced, or Poisson arrivals.
ARRIVALS = ("fixed", "poisson")
#: Requests in flight in a closed loop unless --concurrency says otherwise.
DEFAULT_CONCURRENCY = 256
_POOL = 256  # distinct inputs cycled through (avoids measuring input generation)


# --------------------------------------------------------------------------- what to run


def parse_rates(rate: float | None, rates: str | None) -> tuple[float, ...]:
    """``--rate R`` or ``--rates R1,R2,...`` as a tuple of positive rates (empty: closed loop)."""
    if rate is not None and rates is not None:
        raise BenchError("give --rate or --rates, not both")
    if rate is not None:
        values = [rate]
    elif rates is not None:
        try:
            values = [float(part) for part in rates.split(",") if part.strip()]
        except ValueError as exc:
            raise BenchError(f"--rates must be numbers separated by commas, got {rates!r}") from exc
        if not values:
            raise BenchError("--rates needs at least one rate")
    else:
        return ()
    if any(not value > 0 or value == float("inf") for value in values):
        raise BenchError(f"rates must be positive requests per second, got {values}")
    return tuple(values)


@dataclass(frozen=True)
class BenchPlan:
    """The load every target gets. Validated on construction (BenchError names the option)."""

    requests: int
    rows: int = 1
    concurrency: int | None = None
    rates: tuple[float, ...] = ()
    arrival: str | None = None
    warmup: int | None = None
    seed: int = 0
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise BenchError(f"--requests must be at least 1, got {self.requests}")
        if self.rows < 1:
            raise BenchError(f"--rows must be at least 1, got {self.rows}")
        if self.concurrency is not None and self.rates:
            raise BenchError(
                "--concurrency (closed loop) contradicts --rate/--rates (open loop): give one"
            )
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.arrival is not None and not self.rates:
            raise BenchError("--arrival needs --rate or --rates (an open loop)")
        if self.arrival is not None and self.arrival not in ARRIVALS:
            raise BenchError(
                f"--arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}"
            )
        if self.warmup is not None and self.warmup < 0:
            raise BenchError(f"--warmup must be at least 0, got {self.warmup}")
        if not self.timeout_s > 0:
            raise BenchError(f"--timeout-s must be positive, got {self.timeout_s}")

    def runs(self) -> list[RunSpec]:
        """The measured runs, in order: one closed loop, or one open loop per rate."""
        if not self.rates:
            return [RunSpec(concurrency=self.concurrency or DEFAULT_CONCURRENCY)]
        return [RunSpec(rate=rate, arrival=self.arrival or "poisson") for rate in self.rates]

    @property
    def warmup_requests(self) -> int:
        """``--warmup``, or by default a fifth of the requests, at most 1000."""
        return self.warmup if self.warmup is not None else min(1000, self.requests // 5)

    @property
    def warmup_window(self) -> int:
        """Requests in flight during the warm-up."""
        return self.concurrency or 64

    def describe(self) -> str:
        """One line on the load, for report headings."""
        rows = f"{self.rows} row{'s' if self.rows != 1 else ''}"
        warmup = f"{self.warmup_requests:,} warm-up requests"
        return f"{self.requests:,} requests of {rows} per run after {warmup}"


# --------------------------------------------------------------------------- inputs


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
    # integers are often indices (embeddings, token ids): draw within the example's range, which the
    # model takes
    low, high = (int(example.min()), int(example.max())) if example.size else (0, 0)
    return rng.integers(low, high, shape, dtype=example.dtype, endpoint=True)


def _model_example(model_path: str) -> Any:
    import torch

    from inferfleet.worker.errors import ModelLoadError
    from inferfleet.worker.runtime.loading import resolve_spec
    from inferfleet.worker.runtime.readers import load_model
    from inferfleet.worker.runtime.signature import RAW_SPECS, synthesize

    try:
        handler, example, _ = load_model(model_path, torch.device("cpu"))
        spec = resolve_spec(handler, example, None)
    except ModelLoadError as exc:
        raise BenchError(f"--model: {exc}") from exc
    if example is None and spec is not None and spec not in RAW_SPECS:
        example = synthesize(
            spec
        )  # the signature the file carries: zeros, which every index model takes
    if example is None:
        raise BenchError(f"{model_path} carries no example inputs: pass --input FILE.npz instead")
    return example


def bench_inputs(
    model_path: str | None, input_path: str | None, rows: int, seed: int = 0
) -> list[Any]:
    """A pool of random inputs shaped like ``--input`` (if given) or the model's example."""
    if model_path is None and input_path is None:
        raise BenchError("give --model (its example inputs) or --input (a .npy/.npz file)")
    if rows < 1:
        raise BenchError(f"--rows must be at least 1, got {rows}")
    if input_path is not None:
        try:
            example = load_inputs(input_path)
        except ValueError as exc:
            raise BenchError(f"--input: {exc}") from exc
    else:
        example = _model_example(model_path or "")
    rng = np.random.default_rng(seed)
    return [_random_like(example, rows, rng) for _ in range(_POOL)]


# --------------------------------------------------------------------------- pure measurements


def send_schedule(requests: int, rate: float, arrival: str, seed: int = 0) -> np.ndarray:
    """Send offsets (seconds from the start) of ``requests`` requests at ``rate`` per second.

    ``fixed``: exactly ``1 / rate`` apart. ``poisson``: exponential gaps of
    mean ``1 / rate`` from a rng seeded with ``seed`` (the same schedule for
    every target). The first request is due at 0.
    """
    if arrival == "fixed":
        return np.arange(requests, dtype=float) / rate
    if arrival != "poisson":
        raise BenchError(f"arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(requests - 1, 0))
    return np.concatenate(([0.0], np.cumsum(gaps)))
