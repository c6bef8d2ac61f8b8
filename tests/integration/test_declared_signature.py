"""swap and shadow check a TorchScript candidate against the signature the fleet declared.

The article's own format: TorchScript files, which carry no example inputs, served by a worker
started with ``--input-spec 'float32[N,16]'``. The worker publishes that spec in its heartbeat;
``swap`` and ``shadow`` (check on) run the candidate on inputs of it and refuse one of another
signature, naming the inputs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.heartbeat import heartbeat_key, read_heartbeats
from tests.conftest import ROOT, worker_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
QUEUE = "declared"


def _torchscript(path: Path, features: int) -> str:
    """A TorchScript affine model of ``features`` inputs and 4 outputs, no example embedded."""
    torch.manual_seed(features)
    torch.jit.script(torch.nn.Linear(features, 4)).save(str(path))
    return str(path)


def _cli(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferfleet", *args, "--name", QUEUE],
        env=worker_env(redis_url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _declared(redis_client, timeout_s: float = 60) -> str:
    keys = QueueKeys(QUEUE)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for info in read_heartbeats(redis_client, keys):
            raw = redis_client.hget(heartbeat_key(keys, info.consumer), "input_spec")
            if raw:
                return raw.decode()
        time.sleep(0.1)
    raise AssertionError("no worker declared its input spec")


def test_swap_and_shadow_check_a_torchscript_candidate_against_the_declared_spec(
    redis_url, redis_client, spawn_worker, tmp_path: Path
) -> None:
    served = _torchscript(tmp_path / "v1.pt", 16)
    spawn_worker(QUEUE, served, "--input-spec", "float32[N,16]")
    assert _declared(redis_client) == "float32[N,16]"
    other = _torchscript(tmp_path / "other.pt", 8)
    for command in (("shadow", "--sample", "1"), ("swap",)):
        refused = _cli(redis_url, *command, "--model", other, "--wait-s", "0")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "the fleet's inputs float32[N,16]" in refused.stderr, refused.stderr
    # the same refusal from a spec given on the command line, with no fleet to ask
    given = _cli(
        redis_url,
        "swap",
        "--model",
        other,
        "--input-spec",
        "float32[N,16]",
        "--wait-s",
        "0",
        "--prefix",
        "nobody",
    )
    assert given.returncode == 2 and "float32[N,16]" in given.stderr, given.stderr
    good = _torchscript(tmp_path / "v2.pt", 16)
    shadowed = _cli(redis_url, "shadow", "--model", good, "--sample", "1", "--wait-s", "60")
    assert shadowed.returncode == 0, shadowed.stdout + shadowed.stderr
    assert _cli(redis_url, "shadow", "--stop").returncode == 0
    swapped = _cli(redis_url, "swap", "--model", good, "--wait-s", "60")
    assert swapped.returncode == 0, swapped.stdout + swapped.stderr
    assert ": ok" in swapped.stdout
