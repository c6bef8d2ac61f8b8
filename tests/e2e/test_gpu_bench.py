"""The prepared GPU benchmark, run end to end on the CPU so it cannot rot before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.timeout(400)  # about 25 s of CPU; its wall time grows with the machine's load
def test_gpu_bench_runs_end_to_end_on_the_cpu_and_a_failed_row_loses_no_other(models_dir, tmp_path):
    """benchmarks/gpu_bench.sh --device cpu, small sizes: the cnn row measured (bare loop and fleet,
    like for like), a model that cannot be built marked failed in its own row, the table ready to
    paste."""
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    run = subprocess.run(
        [
            "bash",
            "benchmarks/gpu_bench.sh",
            "--device",
            "cpu",
            "--models",
            "cnn,nosuchmodel",
            "--precisions",
            "fp32",
            "--threads",
            "1",
            "--batches",
            "1,8",
            "--seconds",
            "0.2",
            "--requests",
            "cnn=200",
            "--concurrency",
            "16",
            "--max-batch-rows",
            "16",
            "--budget-s",
            "300",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 1, (
        run.stdout + run.stderr
    )  # 1: some step failed (the unbuildable model), not 2
    table = (out / "gpu.md").read_text().splitlines()
    assert table[1].startswith("| model | precision | bare loop best rows/s (batch) |")
    cnn, missing = table[3].split(" | "), table[4]
    assert cnn[0] == "| cnn" and cnn[1] == "fp32" and "failed" not in table[3]
    assert int(cnn[2].split(" (")[0].replace(",", "")) > 0  # bare loop rows/s (best batch)
    assert int(cnn[4].replace(",", "")) > 0  # fleet QPS
    assert missing.startswith("| nosuchmodel | fp32 | failed: build failed")
    results = json.loads((out / "results.json").read_text())
    fleet = results["rows"][0]["fleet"]["result"]
    assert fleet["requests"] == 200 and fleet["errors"] == 0
    assert "1 torch threads in both" in results["about"]
    assert (out / "logs" / "worker-cnn-fp32.txt").exists() and (out / "preflight.json").exists()
