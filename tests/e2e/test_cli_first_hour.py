"""The command line a new user meets: no torch where no model is served, one-line errors, docs that
run."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import worker_env

#: Runs the inferfleet command line in-process and reports, at exit, whether torch was ever
#: imported.
_PROBE = """
import atexit, sys
said = lambda: "\\nTORCH-IMPORTED\\n" if "torch" in sys.modules else "\\nNO-TORCH\\n"
atexit.register(lambda: sys.stderr.write(said()))
from inferfleet.worker.cli import main
main(sys.argv[1:], prog_name="inferfleet")
"""


def _probe(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_commands_that_serve_no_model_never_import_torch(redis_url, redis_client, tmp_path):
    env = worker_env(redis_url)
    np.save(tmp_path / "x.npy", np.ones((1, 16), np.float32))
    enqueued = _probe(["enqueue", "--name", "q", "--input", str(tmp_path / "x.npy")], env)
    assert enqueued.returncode == 0, enqueued.stderr
    rid = enqueued.stdout.strip()
    runs = {
        "enqueue": enqueued,
        "result": _probe(["result", "--name", "q", "--timeout-s", "0.1", rid], env),
        "status": _probe(["status"], env),
        "status --json": _probe(["status", "--json"], env),
        "dead list": _probe(["dead", "list", "--name", "q"], env),
        "alerts": _probe(["alerts", "--name", "q"], env),
    }
    for command, ran in runs.items():
        assert ran.stderr.rstrip().endswith("NO-TORCH"), f"{command} imported torch:\n{ran.stderr}"
    assert (
        runs["result"].returncode == 1
        and "no worker has ever served queue 'q'" in runs["result"].stderr
    )
    assert (
        runs["status"].returncode == runs["dead list"].returncode == runs["alerts"].returncode == 0
    )


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferfleet", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["status", "--redis-url", "localhost:6379"], 2, "needs a scheme: redis://localhost:6379"),
        (["dead", "list", "--name", "q", "--redis-url", "localhost:6379"], 2, "needs a scheme"),
        (
            ["dead", "list", "--name", "q", "--redis-url", "redis://127.0.0.1:1/0"],
            1,
            "is redis-server running",
        ),
        (
            ["alerts", "--name", "q", "--redis-url", "redis://127.0.0.1:1/0"],
            1,
            "is redis-server running",
        ),
        (
            ["swap", "--name", "q", "--rollback", "--redis-url", "redis://127.0.0.1:1/0"],
            1,
            "is redis-server running",
        ),
        (["status", "--redis-url", "redis://127.0.0.1:1/0"], 1, "is redis-server running"),
        (
            ["result", "--name", "q", "r1", "--redis-url", "redis://127.0.0.1:1/0"],
            1,
            "is redis-server running",
        ),
        (["status", "--cluster"], 1, "not a cluster: drop --cluster"),
        (["dead", "list", "--name", "q", "--cluster"], 1, "not a cluster: drop --cluster"),
        (
            ["worker", "--name", "q", "--model", "missing.pt"],
            1,
            "model file 'missing.pt' does not exist",
        ),
        (
            ["worker", "--name", "q", "--model", "models/affine.pt", "--input-spec", "int64[N"],
            1,
            "Forms: float32[N,16]",
        ),
    ],
)
def test_common_mistakes_get_one_line_and_a_status(args, status, says, redis_url, redis_client):
    ran = _cli(args, worker_env(redis_url))
    assert ran.returncode == status, ran.stderr
    assert says in ran.stderr
    assert "Traceback" not in ran.stderr
    assert len([line for line in ran.stderr.splitlines() if line.startswith("Error")]) == 1


def test_help_is_grouped_with_examples(redis_url, redis_client):
    text = _cli(["--help"], worker_env(redis_url)).stdout
    for section in ("Serve a model:", "Send requests:", "Watch and manage a queue:", "Examples ("):
        assert section in text
    assert text.index("Serve a model:") < text.index("worker ") < text.index("Send requests:")
    assert "inferfleet enqueue --name ctr --input" in text


def test_status_and_dead_list_as_json_for_scripts(redis_url, redis_client, tmp_path):
    env = worker_env(redis_url)
    np.save(tmp_path / "x.npy", np.ones((1, 16), np.float32))
    assert _cli(["enqueue", "--name", "q", "--input", str(tmp_path / "x.npy")], env).returncode == 0
    status = json.loads(_cli(["status", "--json"], env).stdout)
    assert [q["name"] for q in status["queues"]] == ["q"] and status["queues"][0]["length"] == 1
    dead = json.loads(_cli(["dead", "list", "--name", "q", "--json"], env).stdout)
    assert dead == {"queue": "q", "dead": []}
    long_name = "a-queue-name-long-enough-that-an-80-column-table-would-cut-or-fold-it"[:64]
    assert (
        _cli(["enqueue", "--name", long_name, "--input", str(tmp_path / "x.npy")], env).returncode
        == 0
    )
    piped = _cli(["status"], env).stdout  # captured: not a terminal
    assert long_name in piped  # on one line, whole


def test_enqueue_wait_prints_compact_json(
    redis_url, redis_client, spawn_worker, models_dir, tmp_path
):
    spawn_worker("affine", str(models_dir / "affine.pt"))
    np.save(tmp_path / "x.npy", np.ones((1, 16), np.float32))
    ran = _cli(
        ["enqueue", "--name", "affine", "--input", str(tmp_path / "x.npy"), "--wait"],
        worker_env(redis_url),
    )
    assert ran.returncode == 0, ran.stderr
    assert len(ran.stdout.strip().splitlines()) == 1  # one line of JSON
    reply = json.loads(ran.stdout)
    assert reply["ok"] and reply["outputs"]["shape"] == [1, 4]


def _embedding_model(path) -> None:
    """Token ids into a 10-row embedding, shipped with an example whose ids span 0..9."""
    import torch

    from inferfleet.worker import save_model

    class Bag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.embed(ids).sum(1)

    save_model(Bag(), np.arange(10, dtype=np.int64).reshape(1, 10), str(path))


def test_bench_draws_integer_inputs_from_the_example_range_and_a_failing_run_ends_in_one_line(
    redis_url, redis_client, tmp_path
):
    model = tmp_path / "bag.pt2"
    _embedding_model(model)
    env = worker_env(redis_url)
    ran = _cli(
        ["bench", "--name", "bag", "--spawn", "1", "--model", str(model), "-n", "200", "--json"],
        env,
    )
    assert ran.returncode == 0, ran.stderr
    run = json.loads(ran.stdout)["runs"][0]
    assert (
        run["requests"] == 200 and run["errors"] == 0
    )  # ids drawn in 0..9, never past the embedding
    np.save(tmp_path / "far.npy", np.full((1, 10), 1000, np.int64))  # ids the model cannot take
    failed = _cli(
        [
            "bench",
            "--name",
            "bag2",
            "--spawn",
            "1",
            "--model",
            str(model),
            "--input",
            str(tmp_path / "far.npy"),
            "-n",
            "50",
        ],
        env,
    )
    assert failed.returncode == 1
    assert "Traceback" not in failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("Error: bench run failed, nothing measured: ModelError")
        and "index out of range" in last
    )


def test_save_model_command_writes_a_file_the_worker_serves_with_its_spec(
    tmp_path, redis_url, redis_client
):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\n\nclass Bag(torch.nn.Module):\n    def __init__(self):\n        "
        "super().__init__()\n        self.embed = torch.nn.Embedding(10, 2)\n\n    def "
        "forward(self, ids):\n"
        "        return self.embed(ids).sum(1)\n\n\ndef build():\n    return Bag()\n"
    )
    np.save(tmp_path / "example.npy", np.arange(4, dtype=np.int64).reshape(1, 4))
    env = worker_env(redis_url)
    argv = [
        sys.executable,
        "-m",
        "inferfleet",
        "save-model",
        "mymodels:build",
        "--example",
        "example.npy",
        "--out",
        "bag.pt2",
        "--input-spec",
        "int64[N,L]",
    ]
    ran = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert "inputs int64[N,L]" in ran.stdout
    from inferfleet.worker.config import WorkerSettings
    from inferfleet.worker.runtime.loading import load_runtime
    from inferfleet.worker.runtime.signature import describe_spec

    runtime = load_runtime(
        WorkerSettings(name="q", model=str(tmp_path / "bag.pt2"), device="cpu", warmup_iters=1)
    )
    assert describe_spec(runtime.input_spec) == "int64[N,L]"
    assert runtime.predict(np.zeros((2, 9), np.int64), {}).shape == (
        2,
        2,
    )  # another length: it varies
    bad = subprocess.run(
        [*argv[:-1], "int64[N,L"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        bad.returncode == 2
        and "Forms: float32[N,16]" in bad.stderr
        and "Traceback" not in bad.stderr
    )


def test_status_and_dead_list_keep_full_columns_when_piped_to_a_narrow_reader(
    redis_url, redis_client
):
    """Piped (not a terminal) with COLUMNS=40, every cell stays whole on its line: nothing cut,
    folded or elided."""
    from inferfleet.producer.protocol import QueueKeys
    from inferfleet.worker.serving.deadletter import dead_fields

    name = "queue-" + "n" * 50
    keys = QueueKeys(name)
    request_id = "request-" + "r" * 60
    reason = "poison: the model raised on every one of 3 deliveries, " + "x" * 40
    redis_client.xadd(
        keys.dead,
        dead_fields(
            b"1-0", {b"id": request_id.encode(), b"body": b"?"}, reason, 3, "consumer-" + "c" * 40
        ),
    )
    consumer = "a-consumer-whose-name-is-far-wider-than-forty-columns"
    redis_client.xgroup_create(keys.requests, "workers", id="0", mkstream=True)
    redis_client.xadd(keys.requests, {"id": "r1", "body": b"?"})
    redis_client.xreadgroup("workers", consumer, {keys.requests: ">"}, count=1)
    env = {**worker_env(redis_url), "COLUMNS": "40", "LINES": "10"}
    dead = _cli(["dead", "list", "--name", name], env)
    status = _cli(["status", "--name", name], env)
    assert dead.returncode == status.returncode == 0, dead.stderr + status.stderr
    assert any(request_id in line and reason in line for line in dead.stdout.splitlines()), (
        dead.stdout
    )  # one row
    assert f"dead letters of {name}" in dead.stdout
    assert any(consumer in line for line in status.stdout.splitlines()), status.stdout
    assert name in status.stdout and "…" not in status.stdout + dead.stdout
