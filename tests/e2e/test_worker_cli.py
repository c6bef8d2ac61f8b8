"""Whole processes: ``inferfleet worker`` subprocesses on the example models."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from inferfleet.producer import Producer
from inferfleet.producer.protocol import GROUP
from tests.conftest import stop_process, worker_env
from tests.fixtures.build_models import example_inputs


def direct(model_path, inputs):
    model = torch.jit.load(str(model_path))
    with torch.no_grad():
        if isinstance(inputs, dict):
            return model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).numpy()
        return model(torch.from_numpy(inputs)).numpy()


@pytest.mark.parametrize("kind", ["ctr", "cnn"])
def test_replies_equal_direct_forward_single_and_mixed_batches(
    kind, spawn_worker, redis_url, models_dir
):
    path = models_dir / f"{kind}.pt"
    spawn_worker(kind, str(path), "--max-batch-rows", "32", "--max-wait-ms", "20")
    producer = Producer(redis_url, kind)
    single = example_inputs(kind, rows=1, seed=99)
    reply = producer.result(producer.submit(single), timeout_s=20)
    np.testing.assert_allclose(reply.outputs, direct(path, single), rtol=1e-4, atol=1e-5)
    assert reply.model_name == kind and reply.model_version
    # many requests of mixed sizes, batched together
    inputs = [example_inputs(kind, rows=1 + i % 5, seed=i) for i in range(60)]
    replies = producer.map(inputs, timeout_s=30)
    for x, r in zip(inputs, replies):
        assert r.ok, r.error_message
        np.testing.assert_allclose(r.outputs, direct(path, x), rtol=1e-4, atol=1e-5)
    assert max(r.timing["batch_rows"] for r in replies) > 5  # they were batched


def test_mixed_shapes_on_a_handler_are_batched_apart(spawn_worker, redis_url, redis_client):
    spawn_worker("scale", "tests.handlers:Scale", "--max-wait-ms", "20")
    producer = Producer(redis_url, "scale")
    # Scale's example is float32[N,4]: other trailing shapes are refused, not mixed in
    inputs = [np.full((2, 4), i, np.float32) for i in range(10)] + [np.ones((1, 7), np.float32)]
    replies = producer.map(inputs, timeout_s=20)
    assert all(r.ok for r in replies[:10])
    for i in range(10):
        np.testing.assert_array_equal(replies[i].outputs, inputs[i] * 2)
    assert replies[10].error_code == "bad_request" and "float32[N,4]" in replies[10].error_message
    assert redis_client.xpending("inferfleet:{scale}:requests", GROUP)["pending"] == 0


def test_torch_export_model(spawn_worker, redis_url, models_dir):
    spawn_worker("exported", str(models_dir / "affine.pt2"))
    x = np.random.default_rng(0).standard_normal((3, 16), dtype=np.float32)
    producer = Producer(redis_url, "exported")
    reply = producer.result(producer.submit(x), timeout_s=20)
    np.testing.assert_allclose(
        reply.outputs, direct(models_dir / "affine.pt", x), rtol=1e-5, atol=1e-6
    )


def test_enqueue_and_result_commands(spawn_worker, redis_url, models_dir, tmp_path):
    spawn_worker("affine", str(models_dir / "affine.pt"))
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    np.save(tmp_path / "x.npy", x)
    env = worker_env(redis_url)
    cli = [sys.executable, "-m", "inferfleet"]
    rid = subprocess.run(
        [*cli, "enqueue", "--name", "affine", "--input", str(tmp_path / "x.npy")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = subprocess.run(
        [*cli, "result", "--name", "affine", rid, "--output", str(tmp_path / "y.npy")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads(out.stdout)
    assert summary["ok"] and summary["id"] == rid
    np.testing.assert_allclose(
        np.load(tmp_path / "y.npy"), direct(models_dir / "affine.pt", x), rtol=1e-5
    )
    # --wait on a request the model refuses: exit status 1 and the error code printed
    np.save(tmp_path / "bad.npy", np.ones((1, 5), np.float32))
    bad = subprocess.run(
        [*cli, "enqueue", "--name", "affine", "--input", str(tmp_path / "bad.npy"), "--wait"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and json.loads(bad.stdout)["error"]["code"] == "bad_request"


def test_cli_rejects_bad_options_clearly(redis_url, tmp_path):
    env = worker_env(redis_url)
    cli = [sys.executable, "-m", "inferfleet"]
    bad_name = subprocess.run(
        [*cli, "worker", "--name", "no spaces", "--model", "x.pt"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad_name.returncode == 2 and "invalid queue name" in bad_name.stderr
    missing = subprocess.run(
        [*cli, "worker", "--name", "m", "--model", str(tmp_path / "nope.pt")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    bad_device = subprocess.run(
        [*cli, "worker", "--name", "m", "--model", "x.pt", "--device", "tpu"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad_device.returncode == 2 and "auto, cpu, cuda" in bad_device.stderr


def test_sigterm_stops_a_worker_cleanly(spawn_worker, redis_url, models_dir):
    proc = spawn_worker("affine", str(models_dir / "affine.pt"))
    producer = Producer(redis_url, "affine")
    assert len(producer.map([np.ones((1, 16), np.float32)] * 200, timeout_s=20)) == 200
    assert stop_process(proc) == 0


def test_status_shows_the_queue_and_its_workers(spawn_worker, redis_url, redis_client, models_dir):
    spawn_worker("affine", str(models_dir / "affine.pt"), consumer="status-w0")
    Producer(redis_url, "affine").map([np.ones((1, 16), np.float32)] * 50, timeout_s=20)
    redis_client.xadd("inferfleet:{affine}:dead", {"id": "x", "reason": "test"})
    env = {**worker_env(redis_url), "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "inferfleet", "status"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "queue affine" in out
    assert "status-w0" in out and "cpu" in out and "serving" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "dead letters" in line)
    assert lines[header + 2].split("│")[4].strip() == "1"  # one dead letter
    bad = subprocess.run(
        [sys.executable, "-m", "inferfleet", "status", "--name", "bad name"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "invalid queue name" in bad.stderr


def test_a_worker_whose_device_broke_exits_with_status_4_and_acknowledges_nothing(
    spawn_worker, redis_url, redis_client
):
    """After a (simulated) device-side assert the process exits for its restart policy to replace
    it, instead of answering model_error to every later request while its heartbeat says healthy."""
    from tests.handlers import POISON

    proc = spawn_worker(
        "dev", "tests.handlers:BreaksDevice", "--warmup-iters", "0", "--max-wait-ms", "50"
    )
    producer = Producer(redis_url, "dev")
    producer.submit_many([np.full((1, 4), POISON if i == 0 else i, np.float32) for i in range(3)])
    assert proc.wait(30) == 4
    stderr = proc.stderr.read().decode(errors="replace")
    assert "device is unusable" in stderr and "device-side assert" in stderr
    assert (
        int(redis_client.xpending("inferfleet:{dev}:requests", GROUP)["pending"]) >= 1
    )  # left for replay
    assert not redis_client.keys("inferfleet:{dev}:inbox:*")  # no model_error replies
    from inferfleet.producer.protocol import QueueKeys
    from inferfleet.worker.heartbeat import read_heartbeats

    assert read_heartbeats(redis_client, QueueKeys("dev")) == []  # not listed as a healthy worker


def test_supervise_refuses_a_gpu_its_cuda_visible_devices_hides(models_dir):
    """--devices cuda:N counts the supervisor's own visible GPUs: under a scheduler's
    CUDA_VISIBLE_DEVICES=0 there is no cuda:1, and it says so instead of starting children on it."""
    env = {**worker_env("redis://127.0.0.1:1/0"), "CUDA_VISIBLE_DEVICES": "0"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferfleet",
            "supervise",
            "--name",
            "q",
            "--model",
            str(models_dir / "affine.pt"),
            "--devices",
            "cuda:1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "CUDA_VISIBLE_DEVICES='0' makes only 1 GPUs visible" in out.stderr
