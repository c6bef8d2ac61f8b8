"""The command line a new user meets: no torch where no model is served, one-line errors, docs that run."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import worker_env

#: Runs the inferfleet command line in-process and reports, at exit, whether torch was ever imported.
_PROBE = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("\\nTORCH-IMPORTED\\n" if "torch" in sys.modules else "\\nNO-TORCH\\n"))
from inferfleet.worker.cli import main
main(sys.argv[1:], prog_name="inferfleet")
"""


def _probe(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROBE, *args], env=env, capture_output=True, text=True, timeout=120)


def test_commands_that_serve_no_model_never_import_torch(redis_url, tmp_path):
    env = worker_env(redis_url)
    np.save(tmp_path / "x.npy", np.ones((1, 16), np.float32))
    enqueued = _probe(["enqueue", "--name", "q", "--input", str(tmp_path / "x.npy")], env)
    assert enqueued.returncode == 0, enqueued.stderr
    rid = enqueued.stdout.strip()
    runs = {"enqueue": enqueued,
            "result": _probe(["result", "--name", "q", "--timeout-s", "0.1", rid], env),
            "status": _probe(["status"], env),
            "status --json": _probe(["status", "--json"], env),
            "dead list": _probe(["dead", "list", "--name", "q"], env),
            "alerts": _probe(["alerts", "--name", "q"], env)}
    for command, ran in runs.items():
        assert ran.stderr.rstrip().endswith("NO-TORCH"), f"{command} imported torch:\n{ran.stderr}"
    assert runs["result"].returncode == 1 and "no worker has ever served queue 'q'" in runs["result"].stderr
    assert runs["status"].returncode == runs["dead list"].returncode == runs["alerts"].returncode == 0


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferfleet", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(("args", "status", "says"), [
    (["status", "--redis-url", "localhost:6379"], 2, "needs a scheme: redis://localhost:6379"),
    (["dead", "list", "--name", "q", "--redis-url", "localhost:6379"], 2, "needs a scheme"),
    (["dead", "list", "--name", "q", "--redis-url", "redis://127.0.0.1:1/0"], 1, "is redis-server running"),
    (["alerts", "--name", "q", "--redis-url", "redis://127.0.0.1:1/0"], 1, "is redis-server running"),
    (["swap", "--name", "q", "--rollback", "--redis-url", "redis://127.0.0.1:1/0"], 1, "is redis-server running"),
    (["status", "--redis-url", "redis://127.0.0.1:1/0"], 1, "is redis-server running"),
    (["result", "--name", "q", "r1", "--redis-url", "redis://127.0.0.1:1/0"], 1, "is redis-server running"),
    (["status", "--cluster"], 1, "not a cluster: drop --cluster"),
    (["dead", "list", "--name", "q", "--cluster"], 1, "not a cluster: drop --cluster"),
    (["worker", "--name", "q", "--model", "missing.pt"], 1, "model file 'missing.pt' does not exist"),
    (["worker", "--name", "q", "--model", "models/affine.pt", "--input-spec", "int64[N"], 1, "Forms: float32[N,16]"),
])
def test_common_mistakes_get_one_line_and_a_status(args, status, says, redis_url):
    ran = _cli(args, worker_env(redis_url))
    assert ran.returncode == status, ran.stderr
    assert says in ran.stderr
    assert "Traceback" not in ran.stderr
    assert len([line for line in ran.stderr.splitlines() if line.startswith("Error")]) == 1


def test_help_is_grouped_with_examples(redis_url):
    text = _cli(["--help"], worker_env(redis_url)).stdout
    for section in ("Serve a model:", "Send requests:", "Watch and manage a queue:", "Examples ("):
        assert section in text
    assert text.index("Serve a model:") < text.index("worker ") < text.index("Send requests:")
    assert "inferfleet enqueue --name ctr --input" in text


def test_status_and_dead_list_as_json_for_scripts(redis_url, tmp_path):
    env = worker_env(redis_url)
    np.save(tmp_path / "x.npy", np.ones((1, 16), np.float32))
    assert _cli(["enqueue", "--name", "q", "--input", str(tmp_path / "x.npy")], env).returncode == 0
    status = json.loads(_cli(["status", "--json"], env).stdout)
    assert [q["name"] for q in status["queues"]] == ["q"] and status["queues"][0]["length"] == 1
    dead = json.loads(_cli(["dead", "list", "--name", "q", "--json"], env).stdout)
    assert dead == {"queue": "q", "dead": []}


def test_enqueue_wait_prints_compact_json(redis_url, spawn_worker, models_dir, tmp_path):
    spawn_worker("affine", str(models_dir / "affine.pt"))
    np.save(tmp_path / "x.npy", np.ones((1, 16), np.float32))
    ran = _cli(["enqueue", "--name", "affine", "--input", str(tmp_path / "x.npy"), "--wait"], worker_env(redis_url))
    assert ran.returncode == 0, ran.stderr
    assert len(ran.stdout.strip().splitlines()) == 1  # one line of JSON
    reply = json.loads(ran.stdout)
    assert reply["ok"] and reply["outputs"]["shape"] == [1, 4]
