"""``inferfleet bench`` as a whole process: it spawns workers and the naive baseline, measures,
stops them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import redis

from tests.conftest import ROOT, worker_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(redis_url: str, *args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferfleet", "bench", "--redis-url", redis_url, *args],
        env=worker_env(redis_url),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_spawned_fleet_and_naive_baseline_side_by_side(redis_url, models_dir, tmp_path):
    # --max-wait-ms=0: a lone request then never waits on a short XREADGROUP BLOCK, which an idle
    # Redis (hz 10) ends up to 100 ms late; the fleet's first request measures the warm model only.
    out = bench(
        redis_url,
        "--name",
        "e2e-bench",
        "--spawn",
        "1",
        "--model",
        str(models_dir / "affine.pt"),
        "--worker-arg=--max-wait-ms=0",
        "--baseline",
        "naive",
        "-n",
        "300",
        "--concurrency",
        "16",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    rows = [
        line
        for line in out.stdout.splitlines()
        if line.startswith("| fleet |") or line.startswith("| naive |")
    ]
    assert [row.split("|")[1].strip() for row in rows] == ["fleet", "naive"]
    assert "| closed, 16 in flight |" in out.stdout and "QPS fleet/naive" in out.stdout
    assert (tmp_path / "report.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "report.md").read_text() == out.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    fleet, naive = report["runs"]
    assert (fleet["target"], naive["target"]) == ("fleet", "naive")
    assert fleet["qps"] > 0 and naive["qps"] > 0 and fleet["errors"] == naive["errors"] == 0
    assert fleet["requests"] == naive["requests"] == 300
    assert naive["mean_batch_rows"] == 1.0  # one request at a time
    assert (
        naive["first_ms"] > fleet["first_ms"]
    )  # the naive server loads the model on its first request
    client = redis.Redis.from_url(redis_url)
    assert (
        client.xinfo_consumers("inferfleet:{e2e-bench}:requests", "workers") == []
    )  # the worker left
    assert not client.exists(
        "inferfleet:{e2e-bench-naive}:requests"
    )  # the naive queue is cleaned up


def test_open_loop_sweep_reports_each_offered_rate(redis_url, models_dir):
    out = bench(
        redis_url,
        "--name",
        "e2e-open",
        "--spawn",
        "1",
        "--model",
        str(models_dir / "affine.pt"),
        "--rates",
        "100,300",
        "--arrival",
        "fixed",
        "-n",
        "150",
        "--warmup",
        "20",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    runs = json.loads(out.stdout)["runs"]
    assert [(r["mode"], r["arrival"], r["offered_qps"]) for r in runs] == [
        ("open", "fixed", 100.0),
        ("open", "fixed", 300.0),
    ]
    for run in runs:
        assert run["requests"] == 150 and run["errors"] == 0
        # paced, never early: request i is due i/R s after the first, so the 150th cannot go out,
        # nor be
        # answered, before 149/R s (a loaded machine only delays them). Whether a fleet keeps up
        # with R
        # is a throughput figure: docs/benchmarks.md, not an assertion on a shared machine's clock.
        assert run["seconds"] >= 149 / run["offered_qps"]
        assert 0 < run["sent_qps"] <= run["offered_qps"] * (1 + 1e-6)
    assert runs[0]["first_ms"] is not None and runs[1]["first_ms"] is None


def test_a_worker_that_cannot_start_is_reported_and_nothing_is_left(redis_url, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((1, 16), np.float32))
    out = bench(
        redis_url,
        "--name",
        "e2e-broken",
        "--spawn",
        "1",
        "--model",
        str(tmp_path / "missing.pt"),
        "--input",
        str(tmp_path / "x.npy"),
        "-n",
        "10",
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "worker 0 exited with status" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--name", "q", "--rate", "100", "--concurrency", "8"], "contradicts"),
        (["--spawn", "1"], "--spawn needs --model"),
        (["--name", "q", "--rates", "100,0"], "positive"),
        (["--name", "q", "--concurrency", "0"], "--concurrency must be at least 1"),
    ],
)
def test_bad_options_exit_2_with_a_message_and_no_traceback(args, message):
    out = subprocess.run(
        [sys.executable, "-m", "inferfleet", "bench", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


def test_the_naive_servers_batched_mode_answers_each_request_with_the_models_rows(
    redis_url, models_dir
):
    """``naive --batch N``, bench_cpu's plain yardstick: a pre-filled stream is read N at a
    time and each request gets its own rows of one forward pass."""
    import torch

    from inferfleet import Producer

    x = np.random.default_rng(0).standard_normal((120, 16)).astype(np.float32)
    with Producer(redis_url, "plain-yardstick") as producer:
        ids = producer.submit_many([row[None] for row in x])  # queued before the server reads
        cmd = [sys.executable, "-m", "inferfleet.worker.bench.naive", "--batch", "32"]
        cmd += ["--name", "plain-yardstick", "--model", str(models_dir / "affine.pt")]
        server = subprocess.Popen([*cmd, "--redis-url", redis_url], cwd=ROOT)
        try:
            replies = producer.results(ids, timeout_s=60)
        finally:
            server.terminate()
            assert server.wait(timeout=30) == 0
    want = torch.jit.load(str(models_dir / "affine.pt"))(torch.from_numpy(x)).detach().numpy()
    got = np.concatenate([r.outputs for r in replies])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert max(r.timing["batch_rows"] for r in replies) == 32


def test_the_naive_server_refuses_a_batch_under_one():
    out = subprocess.run(
        [sys.executable, "-m", "inferfleet.worker.bench.naive", "--name", "q", "--model", "m.pt"]
        + ["--batch", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--batch must be 1 or more, not 0" in out.stderr
