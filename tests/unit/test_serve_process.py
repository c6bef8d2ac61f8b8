"""A worker's process-wide settings reach every kind of model, the step-wise ones too.

A step-wise (generative) model is loaded by ``load_stepwise``, not ``load_runtime``: before
this test's fix its worker ran with torch's default threads (one per core) whatever
``--torch-threads`` said, and on 2 cores an OpenMP thread spun beside the loop, half the
worker's CPU (benchmarks/bench_streaming.py found it).
"""

from __future__ import annotations

import threading

import pytest
import torch

from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.serving import serve


def test_a_step_wise_model_loads_under_the_workers_torch_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, object] = {}

    def load_stepwise(model: str, device: torch.device) -> object:
        seen["threads"] = torch.get_num_threads()
        return object()  # not None: a step-wise model, served by _serve_generation

    monkeypatch.setattr(serve, "worker_client", lambda *args, **kwargs: None)
    monkeypatch.setattr(serve, "check_server", lambda client: None)
    monkeypatch.setattr(serve, "load_stepwise", load_stepwise)
    monkeypatch.setattr(serve, "_serve_generation", lambda *args: seen.setdefault("served", 1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        settings = WorkerSettings(
            name="q", model="tests.handlers:SlowTinyLM", torch_threads=1, tune_malloc=False
        )
        assert serve._serve(settings, threading.Event()) is None
    finally:
        torch.set_num_threads(threads)
    assert seen == {"threads": 1, "served": 1}
