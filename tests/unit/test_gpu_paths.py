"""The GPU-only branches of the runtime and the supervisor, run on the CPU.

No GPU here: CUDA errors are simulated by their classes and messages, devices
by the ``meta`` device, the scheduler's GPUs by a fake ``CUDA_VISIBLE_DEVICES``,
ONNX Runtime's CUDA provider by a stubbed provider list, and the few CUDA
calls with no CPU counterpart (``set_device``, ``get_device_capability``,
``empty_cache``) by monkeypatched torch attributes.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ConfigError, ModelLoadError
from inferfleet.worker.fleet.placement import child_visible_devices
from inferfleet.worker.fleet.scaling import PolicySettings
from inferfleet.worker.fleet.supervisor import Slot, Supervisor, SupervisorSettings
from inferfleet.worker.runtime import devices
from inferfleet.worker.runtime.devices import is_device_broken, is_out_of_memory
from inferfleet.worker.runtime.loading import ModelRuntime, apply_precision, load_runtime
from inferfleet.worker.runtime.modules import ModuleHandler
from inferfleet.worker.runtime.readers import load_model

# -- 1 and 5: what a device error means
# ---------------------------------------------------------------

ILLEGAL_ACCESS = (
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
    "asynchronously reported at some other API call"
)
DEVICE_ASSERT = (
    "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable"
)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError(DEVICE_ASSERT),
        torch.AcceleratorError(ILLEGAL_ACCESS)
        if hasattr(torch, "AcceleratorError")
        else RuntimeError(ILLEGAL_ACCESS),
        RuntimeError("CUDA error: unspecified launch failure"),
        RuntimeError(
            "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, "
            "opb, ...)`"
        ),
        RuntimeError(
            "[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access was "
            "encountered"
        ),
    ],
)
def test_sticky_cuda_errors_break_the_device(exc):
    assert is_device_broken(exc)
    assert not is_out_of_memory(exc)


def test_the_bisection_never_swallows_a_broken_device():
    """DeviceBroken is no Exception: predict_isolated's `except Exception` lets it through at
    once."""
    from inferfleet.worker.errors import DeviceBroken
    from inferfleet.worker.serving.batching import predict_isolated

    calls: list[int] = []

    def predict(part):
        calls.append(len(part))
        raise DeviceBroken("c1", RuntimeError(DEVICE_ASSERT))

    with pytest.raises(DeviceBroken):
        predict_isolated([1, 2, 3, 4], predict)
    assert calls == [4]


def test_a_sticky_error_wrapped_by_a_handler_still_breaks_the_device():
    try:
        try:
            raise RuntimeError(DEVICE_ASSERT)
        except RuntimeError as inner:
            raise ValueError("my handler failed") from inner
    except ValueError as outer:
        assert is_device_broken(outer)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("poison row in batch"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x4)"),
        RuntimeError(
            "CUDA out of memory. Tried to allocate 2.00 GiB"
        ),  # out of memory: the context survives
    ],
)
def test_ordinary_failures_and_out_of_memory_do_not_break_the_device(exc):
    assert not is_device_broken(exc)


def test_out_of_memory_is_recognised_on_a_torch_without_torch_OutOfMemoryError(monkeypatch):
    """torch 2.2-2.4 (allowed by pyproject.toml) have only torch.cuda.OutOfMemoryError."""
    oom_class = torch.cuda.OutOfMemoryError
    monkeypatch.delattr(torch, "OutOfMemoryError")
    assert is_out_of_memory(
        oom_class("Tried to allocate 20.00 MiB")
    )  # the class alone, no telling message
    assert not is_out_of_memory(ValueError("poison"))


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for requested "
        "buffer of size 1048576",
    ],
)
def test_library_allocation_failures_are_out_of_memory(message):
    assert is_out_of_memory(RuntimeError(message))


# -- 2: .pt2 programs moved with their constants and graph-made tensors
# --------------------------------


class _LiftedConstant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.tensor([1.0, 2.0, 3.0])  # neither parameter nor buffer: export lifts it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _Arange(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(
            1
        )  # device=cpu written into the graph


@pytest.mark.parametrize(
    "module", [_LiftedConstant(), _Arange()], ids=["lifted-constant", "arange"]
)
def test_an_exported_program_runs_wholly_on_the_device_it_is_loaded_on(module, tmp_path):
    program = torch.export.export(
        module, (torch.ones(4, 3),), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},)
    )
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))
    handler, _, _ = load_model(str(path), torch.device("meta"))
    out = handler.predict(torch.ones(5, 3, device="meta"), {})
    assert out.device.type == "meta" and tuple(out.shape) == (5, 3)


def test_an_exported_program_loaded_on_the_cpu_still_computes(tmp_path):
    program = torch.export.export(
        _Arange(), (torch.ones(4, 3),), dynamic_shapes=({0: torch.export.Dim("b")},)
    )
    torch.export.save(program, str(tmp_path / "a.pt2"))
    handler, _, _ = load_model(str(tmp_path / "a.pt2"), torch.device("cpu"))
    np.testing.assert_array_equal(
        handler.predict(torch.zeros(3, 3), {}).numpy(), [[0] * 3, [1] * 3, [2] * 3]
    )


# -- 3: supervised children placed through the supervisor's own visible GPUs
# ---------------------------


def test_child_devices_map_through_the_parents_visible_gpus():
    assert child_visible_devices(("cuda:0", "cuda:1"), "2,3") == {"cuda:0": "2", "cuda:1": "3"}
    mig = "MIG-4b7c1a5e-0c1d-5a1b-9e4f-1f2e3d4c5b6a,MIG-8d9e0f1a-2b3c-5d4e-8f6a-7b8c9d0e1f2a"
    assert child_visible_devices(("cuda:1",), mig) == {"cuda:1": mig.split(",")[1]}
    assert child_visible_devices(("cuda:0", "cuda:1", "cpu"), None) == {
        "cuda:0": "0",
        "cuda:1": "1",
    }


def test_a_gpu_the_supervisor_cannot_see_is_refused():
    with pytest.raises(ConfigError, match="only 1 GPUs visible"):
        child_visible_devices(("cuda:0", "cuda:1"), "5")


class _FakeProcess:
    pid = 4242

    def __init__(self, target, args, name, daemon) -> None:
        self.args = args

    def start(self) -> None:
        pass


class _FakeContext:
    def __init__(self) -> None:
        self.started: list[_FakeProcess] = []

    def Process(self, **kwargs) -> _FakeProcess:
        process = _FakeProcess(**kwargs)
        self.started.append(process)
        return process


def test_a_supervisor_under_a_scheduler_starts_each_child_on_its_own_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # a scheduler gave this job GPUs 2 and 3
    worker = WorkerSettings(name="q", model="models/cnn.pt", device="cuda")
    settings = SupervisorSettings(
        worker=worker,
        policy=PolicySettings(min_workers=1, max_workers=2),
        devices=("cuda:0", "cuda:1"),
    )
    supervisor = Supervisor(settings, lambda settings, visible: None, client=object())  # type: ignore[arg-type]
    supervisor.context = _FakeContext()  # type: ignore[assignment]
    for index in range(2):
        supervisor._start(Slot(index, f"q-s{index}", settings.devices[index]))
    children = [(p.args[0].device, p.args[1]) for p in supervisor.context.started]
    assert children == [("cuda:0", "2"), ("cuda:0", "3")]  # each child sees one GPU, as its cuda:0


# -- 6: a hot swap returns the old copy's memory
# --------------------------------------------------------


def test_switching_models_frees_the_old_copy_before_emptying_the_cache(monkeypatch, models_dir):
    import redis

    from inferfleet.worker.serving.consumer import Consumer

    def runtime() -> ModelRuntime:
        module = torch.jit.load(str(models_dir / "affine.pt"))
        return ModelRuntime(
            ModuleHandler(module), "q", "v", torch.device("cuda")
        )  # said to be on a GPU

    unused = redis.Redis(host="127.0.0.1", port=1)  # never connected: a swap touches no Redis
    consumer = Consumer(WorkerSettings(name="q", model="m", consumer="c1"), runtime(), unused)
    old_module = weakref.ref(consumer.runtime.handler.module)
    freed_when_emptied: list[bool] = []
    monkeypatch.setattr(
        torch.cuda, "empty_cache", lambda: freed_when_emptied.append(old_module() is None)
    )
    consumer.switch_runtime(runtime(), "m2")
    assert freed_when_emptied == [True]  # the old weights were gone when the cache was returned
    gc.collect()


# -- 7: the current device, bf16 before Ampere, --compile without a compiler
# ---------------------------


def test_cuda_n_becomes_the_current_device_of_the_loading_thread(monkeypatch):
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((str(d), threading.get_ident()))
    )
    settings = WorkerSettings(
        name="q", model="tests.handlers:CallCounter", device="cuda:1", warmup_iters=0
    )
    load_runtime(settings)  # the serving thread
    swap = threading.Thread(
        target=load_runtime, args=(settings,)
    )  # a hot swap loads in its own thread
    swap.start()
    swap.join()
    assert calls == [("cuda:1", threading.get_ident()), ("cuda:1", swap.ident)]


def test_bf16_on_a_gpu_before_ampere_is_said_to_be_emulated(monkeypatch, caplog):
    handler = ModuleHandler(torch.nn.Linear(2, 2))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    with caplog.at_level(logging.WARNING, logger=devices.__name__):
        apply_precision(handler, "bf16", torch.device("cuda:0"))
    assert "emulated" in caplog.text and "7.5" in caplog.text
    caplog.clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with caplog.at_level(logging.WARNING, logger=devices.__name__):
        apply_precision(handler, "bf16", torch.device("cuda:0"))
        apply_precision(handler, "fp16", torch.device("cuda:0"))
    assert caplog.text == ""


def test_compile_without_a_c_compiler_says_so_before_loading_further(
    monkeypatch, tmp_path: Path, models_dir
):
    monkeypatch.setenv("PATH", str(tmp_path))  # the python:*-slim image: no cc, gcc or clang
    monkeypatch.delenv("CC", raising=False)
    settings = WorkerSettings(
        name="q", model=str(models_dir / "affine.pt2"), compile=True, warmup_iters=1
    )
    with pytest.raises(ModelLoadError, match="--compile needs a C compiler"):
        load_runtime(settings)


def test_tf32_is_set_as_chosen_and_reported_as_it_runs():
    from inferfleet.worker.runtime.devices import apply_tf32

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        assert apply_tf32("on") == "TF32 matmul on, conv on"
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert apply_tf32("torch") == "TF32 matmul on, conv on"  # torch: left as they are
        assert apply_tf32("off") == "TF32 matmul off, conv off"
        assert not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_tf32_accepts_only_its_choices():
    from inferfleet.worker.config import ConfigError, WorkerSettings

    with pytest.raises(ConfigError, match="tf32 'maybe' is not one of torch, on, off"):
        WorkerSettings(name="q", model="m.pt", tf32="maybe")


@pytest.mark.parametrize(
    "device,visible,label",
    [
        ("cuda:0", "3", "cuda:0 (GPU 3)"),  # a supervised child on the supervisor's GPU 3
        ("cuda:1", "2,5", "cuda:1 (GPU 5)"),  # a scheduler's CUDA_VISIBLE_DEVICES=2,5
        ("cuda:0", "MIG-4f1c", "cuda:0 (GPU MIG-4f1c)"),
        ("cuda:2", None, "cuda:2 (GPU 2)"),  # nothing hidden: the index is the GPU
        ("cpu", "3", "cpu"),
    ],
)
def test_the_heartbeat_names_the_physical_gpu(device, visible, label):
    from inferfleet.worker.runtime.devices import device_label

    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert device_label(torch.device(device), environ) == label
