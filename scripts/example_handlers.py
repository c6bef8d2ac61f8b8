"""Example handlers for benchmarks and docs (``--model scripts.example_handlers:NAME``)."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from inferfleet.worker.handler import Handler


class SimulatedAccelerator(Handler):
    """y = 2x, each batch taking ``BATCH_S`` seconds of wall time without using the CPU.

    Stands in for a model bound by an accelerator or a remote call, so that a
    2-core machine can show a fleet scaling to many workers: each worker
    serves at most ``max_batch_rows / BATCH_S`` requests per second.
    """

    version = "sim-1"

    def example_inputs(self) -> np.ndarray:
        return np.ones((2, 4), dtype=np.float32)

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        time.sleep(float(os.environ.get("BATCH_S", "0.02")))
        return x * 2.0


class SimulatedAcceleratorV2(SimulatedAccelerator):
    """The "next version" of SimulatedAccelerator for hot swap runs: y = 3x, version sim-2."""

    version = "sim-2"

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        return super().predict(x, params) * 1.5


POISON = -999.0


class CrashOnPoison(SimulatedAccelerator):
    """SimulatedAccelerator that kills its own process on a row starting with ``POISON``.

    Stands in for an input that segfaults a model or exhausts host memory:
    the request can never be answered by computing it.
    """

    def predict(self, x: torch.Tensor, params: dict) -> torch.Tensor:
        if bool((x[:, 0] == POISON).any()):
            os._exit(17)
        return super().predict(x, params)
