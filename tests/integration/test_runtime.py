"""The model runtime on the example models: precision, compile, memory hygiene, heartbeat RSS."""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch

from inferfleet.producer import Producer
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.handler import to_device
from inferfleet.worker.heartbeat import Heartbeat, read_heartbeats
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.consumer import Consumer
from tests.fixtures.build_models import example_inputs


def runtime(models_dir, kind: str, **settings):
    suffix = ".pt2" if kind == "affine2" else ".pt"
    path = models_dir / f"{kind.rstrip('2')}{suffix}"
    return load_runtime(WorkerSettings(name="q", model=str(path), warmup_iters=1, **settings))


@pytest.mark.parametrize("precision,tolerance", [("bf16", 0.05), ("fp16", 0.01), ("amp", 0.01)])
@pytest.mark.parametrize("kind", ["ctr", "cnn"])
def test_reduced_precision_stays_close_and_returns_float32(models_dir, kind, precision, tolerance):
    x = example_inputs(kind, rows=8, seed=5)
    full = runtime(models_dir, kind).predict(x, {})
    reduced = runtime(models_dir, kind, precision=precision).predict(x, {})
    assert reduced.dtype == np.float32
    scale = np.abs(full).max()
    assert np.abs(reduced - full).max() <= tolerance * scale
    assert not np.array_equal(reduced, full)  # it really ran in reduced precision


def _weights(rt) -> list[torch.Tensor]:
    modules = [v for v in vars(rt.handler).values() if isinstance(v, torch.nn.Module)]
    return [t for m in modules for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()]


@pytest.mark.parametrize("kind", ["ctr", "cnn", "affine2"])
def test_fp16_and_bf16_cast_the_weights_amp_keeps_them_fp32(models_dir, kind):
    """Issue 31: --precision fp16 is the article's model.half() (half the weights' memory), with
    the CTR model's integer ids left as ids; autocast is its own choice, amp."""
    assert {w.dtype for w in _weights(runtime(models_dir, kind))} == {torch.float32}
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        rt = runtime(models_dir, kind, precision=precision)
        weights = _weights(rt)
        assert weights and {w.dtype for w in weights} == {dtype}
    assert {w.dtype for w in _weights(runtime(models_dir, kind, precision="amp"))} == {
        torch.float32
    }


def test_fp16_refuses_a_handler_with_no_module_to_cast():
    with pytest.raises(ModelLoadError, match=r"holds no torch\.nn\.Module.*--precision amp"):
        load_runtime(
            WorkerSettings(name="q", model="tests.handlers:Scale", precision="fp16", warmup_iters=1)
        )


def test_compile_an_exported_model(models_dir):
    x = example_inputs("affine", rows=5, seed=1)
    compiled = runtime(models_dir, "affine2", compile=True)
    np.testing.assert_allclose(
        compiled.predict(x, {}), runtime(models_dir, "affine2").predict(x, {}), rtol=1e-5, atol=1e-6
    )


def test_compile_refuses_torchscript_clearly(models_dir):
    with pytest.raises(ModelLoadError, match=r"torch\.compile cannot compile a TorchScript model"):
        runtime(models_dir, "affine", compile=True)


def test_cpu_inputs_are_not_copied_to_the_device():
    x = np.ones((4, 16), np.float32)
    assert to_device(x, torch.device("cpu")).data_ptr() == x.ctypes.data


def test_memory_hygiene_cadence(redis_url, redis_client, models_dir, monkeypatch):
    settings = WorkerSettings(
        name="q",
        model=str(models_dir / "affine.pt"),
        redis_url=redis_url,
        consumer="c1",
        warmup_iters=1,
        idle_block_ms=50,
        max_batch_rows=1,
        empty_cache_every=10,
    )
    consumer = Consumer(settings, load_runtime(settings), redis.Redis.from_url(redis_url))
    consumer.prepare()
    calls = []
    monkeypatch.setattr(consumer.runtime, "release_memory", lambda: calls.append(1))
    Producer(redis_url, "q").submit_many([np.ones((1, 16), np.float32)] * 35)
    while consumer.run_once():
        pass
    assert consumer.counters.batches == 35 and len(calls) == 3


def test_heartbeat_reports_resident_memory(redis_url, redis_client):
    from inferfleet.producer.protocol import QueueKeys
    from inferfleet.worker.counters import Counters

    beat = Heartbeat(
        redis_client, QueueKeys("q"), "c1", Counters(), {"device": "cpu", "version": "1"}
    ).start()
    try:
        (info,) = read_heartbeats(redis_client, QueueKeys("q"))
        assert 10 < info.rss_mb < 100_000
    finally:
        beat.stop()
    assert read_heartbeats(redis_client, QueueKeys("q")) == []


_MMAP_PROBE = """
import ctypes, sys
from inferfleet.worker.runtime.memory import tune_allocator
if sys.argv[1] == "tuned":
    assert tune_allocator()
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                 "usmblks", "fsmblks", "uordblks", "fordblks",
                                                 "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblks
block = libc.malloc(4 * 1024 * 1024)  # a batch-sized buffer: 4 MiB
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.parametrize("mode,mmapped", [("default", "1"), ("tuned", "0")])
def test_allocator_tuning_keeps_batch_buffers_in_the_heap(mode, mmapped):
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = subprocess.run(
        [sys.executable, "-c", _MMAP_PROBE, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (
        out.stdout.strip() == mmapped
    )  # default glibc mmaps the buffer; tuned, it comes from the heap


def test_a_worker_freezes_its_start_up_heap_before_it_serves(spawn_worker, redis_url):
    """torch's import-time objects are never garbage: a worker takes them out of the cyclic GC's
    walks (worker/serving/serve.py) before loading its model, which stays collectable for hot
    swaps."""
    spawn_worker("frozen", "tests.handlers:FrozenHeap")
    frozen = Producer(redis_url, "frozen").infer(np.ones((1, 4), np.float32), timeout_s=30)
    assert frozen.shape == (1, 4)
    assert (
        frozen.min() == frozen.max() > 50_000
    )  # torch, numpy and redis-py leave well over this many
