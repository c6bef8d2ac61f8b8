"""Real ``inferfleet worker`` processes serving an exported .onnx model and int8 models."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from inferfleet.producer import Producer
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.runtime.onnx_backend import load_onnx
from inferfleet.worker.runtime.readers import file_version
from tests.conftest import worker_env
from tests.fixtures.build_models import example_inputs


def local(path, **settings):
    """The same model loaded in this process: what the worker's replies must equal."""
    return load_runtime(WorkerSettings(name="local", model=str(path), warmup_iters=0, **settings))


def test_worker_serves_an_onnx_model_like_its_torchscript_form(
    spawn_worker, redis_url, onnx_models_dir, models_dir
):
    path = onnx_models_dir / "ctr.onnx"
    spawn_worker("ctr", str(path), "--max-batch-rows", "32", "--max-wait-ms", "20")
    script = local(models_dir / "ctr.pt")
    inputs = [example_inputs("ctr", rows=1 + i % 4, seed=i) for i in range(40)]
    with Producer(redis_url, "ctr") as producer:
        replies = producer.map(inputs, timeout_s=30)
    for x, reply in zip(inputs, replies):
        assert reply.ok, reply.error_message
        assert reply.outputs.dtype == np.float32
        np.testing.assert_allclose(reply.outputs, script.predict(x, {}), rtol=1e-5, atol=1e-5)
    assert {r.model_version for r in replies} == {file_version(str(path))}
    assert (
        max(r.timing["batch_rows"] for r in replies) > 4
    )  # requests were batched through ONNX Runtime


def test_worker_serves_int8_with_float32_outputs(
    spawn_worker, redis_url, models_dir, onnx_models_dir
):
    spawn_worker("a8", str(models_dir / "affine.pt2"), "--precision", "int8")
    spawn_worker("c8", str(onnx_models_dir / "ctr.onnx"), "--precision", "int8")
    for name, path, kind in (
        ("a8", models_dir / "affine.pt2", "affine"),
        ("c8", onnx_models_dir / "ctr.onnx", "ctr"),
    ):
        x = example_inputs(kind, rows=6, seed=11)
        with Producer(redis_url, name) as producer:
            reply = producer.result(producer.submit(x), timeout_s=20)
        full, int8 = local(path).predict(x, {}), local(path, precision="int8").predict(x, {})
        assert reply.outputs.dtype == np.float32
        np.testing.assert_allclose(
            reply.outputs, int8, rtol=1e-5, atol=1e-6
        )  # the worker ran int8 ...
        assert not np.array_equal(reply.outputs, full)  # ... not fp32


def test_worker_refuses_int8_on_torchscript_and_says_what_to_serve(redis_url, models_dir):
    cmd = [
        sys.executable,
        "-m",
        "inferfleet",
        "worker",
        "--name",
        "m",
        "--model",
        str(models_dir / "ctr.pt"),
        "--precision",
        "int8",
    ]
    done = subprocess.run(
        cmd, env=worker_env(redis_url), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert "cannot quantize a TorchScript model" in done.stderr and ".pt2" in done.stderr


@pytest.mark.filterwarnings(
    "ignore:Specified provider 'CUDAExecutionProvider' is not in available provider"
)
def test_onnx_runtime_that_falls_back_to_the_cpu_on_a_gpu_is_refused(onnx_models_dir, monkeypatch):
    """onnxruntime-gpu whose CUDA libraries fail to load lists the CUDA provider, then builds a
    CPU-only session: a "GPU" worker at CPU speed. Stubbed here by the provider list this CPU build
    reports."""
    import onnxruntime

    monkeypatch.setattr(
        onnxruntime,
        "get_available_providers",
        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"],
    )
    with pytest.raises(ModelLoadError, match="fell back to CPUExecutionProvider"):
        load_onnx(str(onnx_models_dir / "affine.onnx"), torch.device("cuda:0"), threads=1)
