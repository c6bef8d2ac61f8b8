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


def test_a_step_wise_model_loads_on_its_device_made_current_with_the_tf32_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As ``load_runtime`` does for any other model: on a GPU, ``cuda:N`` is the loop's
    current device and ``--tf32`` is applied before the model loads."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(serve, "worker_client", lambda *args, **kwargs: None)
    monkeypatch.setattr(serve, "check_server", lambda client: None)
    monkeypatch.setattr(serve, "select_device", lambda device: calls.append(("select", device)))
    monkeypatch.setattr(serve, "apply_tf32", lambda tf32: calls.append(("tf32", tf32)))
    monkeypatch.setattr(
        serve, "load_stepwise", lambda model, device: calls.append(("load", device)) or object()
    )
    monkeypatch.setattr(serve, "_serve_generation", lambda *args: None)
    settings = WorkerSettings(name="q", model="tests.handlers:SlowTinyLM", tune_malloc=False)
    serve._serve(settings, threading.Event())
    cpu = torch.device("cpu")
    assert calls == [("select", cpu), ("tf32", settings.tf32), ("load", cpu)]
