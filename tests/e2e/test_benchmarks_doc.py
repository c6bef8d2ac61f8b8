"""docs/benchmarks.md's commands: every one parsed as its program takes it, a tiny few run.

**Parsed, all of them** (and docs/metrics.md's ``bench_metrics`` line, the page's own): each goes
through :func:`tests.docs_commands.check`, so a script's own argparse parser takes it as written
(options and their values, choices, subcommands, positionals; ``--worker-arg`` values as
``inferfleet worker`` options), ``./scripts/test``'s arguments go to pytest's parser, an
``inferfleet`` line to the click tree, and a shell script must exist and hand its arguments to
something that takes them.

**Run, as written at a tiny size** (:data:`SIZES` replaces the value of each size option the line
has, :data:`RUN` adds what a line leaves at a long default, and ``bench-out/`` becomes a folder
under ``tmp_path``; every Redis is one the script starts itself), one of each kind the page
measures, about 32 s on a quiet 2-core machine:

- ``bench_wakeup``: Redis round trips through redis-py, no worker;
- ``bench_lanes --part admission`` and ``--part read``: the SDK's admission (the Redis function,
  limits in force) and the worker's lane read, in the script's own process;
- ``bench_autoscale trace``, then ``replay`` on the file it wrote: the scaling policies on the
  replayer, no processes;
- ``bench_cpu --kind sdk --modes map`` and ``--kind drain --targets fleet``: the SDK against one
  spawned ``inferfleet worker``, and that worker draining a backlog: the script behind most of
  the page's commands;
- ``bench_streaming`` at one concurrency (32): a worker serving the tiny language model streams
  through Redis, every request's tokens checked against the in-process ``Generator``'s, one
  worker a chunk a token and one gathering its tokens for 20 ms (``--chunk-ms 0 20``).

**Only parsed, the rest**, since even at a tiny size each costs more than this test's minute on 2
cores allows, or needs what the suite's machines lack: a fleet of worker processes each
(``bench_fleet``, ``bench_burst``, ``bench_targets``, ``bench_cache``, ``bench_pipeline``,
``bench_online``, ``bench_rollout --part shadow``, ``soak``, ``bench_autoscale real`` and ``zero``,
``bench_lanes`` latency and cancel, the ``for`` loop of ``inferfleet bench --spawn``: 5 to 20 s of
start-up each before a single request), a fixed number of switched segments a pass whatever the size
(``bench_metrics`` and ``bench_rollout --part tracing``: 38 s each at 200 requests), more of a
script already run here (the other ``bench_cpu`` lines), ONNX exports and timing loops over every
runtime (``export_onnx --int8``, ``bench_runtimes``, ``accuracy_report``), a GPU or its offline
bundle (``gpu_bench.sh``, ``scripts.gpu_bundle``: tests/e2e/test_gpu_bench.py runs them), Docker
(``compose_env.sh``, ``./scripts/test tests/e2e/test_compose.py``), or the suite and the demo
themselves (``./scripts/test``, ``.ci/bare-machine``, ``./scripts/demo``: tests/e2e/test_readme.py
and tests/e2e/test_demo.py run those). tests/e2e/test_bench_scripts.py runs several of them at a
tiny size with arguments of its own.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.docs_commands import DocCommand, check, page_commands, use_pytest_config

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "benchmarks.md"
METRICS = ROOT / "docs" / "metrics.md"

#: A size option -> the value a run here gives it.
SIZES = {"--requests": "200", "--runs": "1", "--passes": "1", "-n": "100"}

#: The lines run (a pattern of the line) -> what is added to keep them tiny (and the output
#: under ``tmp_path``, where the page leaves it to the default, bench-out/).
RUN = {
    r"^python -m benchmarks\.bench_wakeup --requests \d+$": [],
    r"^python -m benchmarks\.bench_lanes --part (admission|read) ": [],
    r"^python -m benchmarks\.bench_autoscale trace ": ["--seconds", "60", "--peak-rps", "60"],
    r"^python -m benchmarks\.bench_autoscale replay ": [
        *("--seconds", "60", "--peak-rps", "60", "--out", "bench-out/autoscale")
    ],
    r"^python -m benchmarks\.bench_cpu --kind sdk --modes map --requests \d+ --runs 1$": [],
    r"^python -m benchmarks\.bench_cpu --kind drain --targets fleet --requests \d+ --runs 1$": [],
    r"^python -m benchmarks\.bench_streaming --concurrency 1 8 32 --requests \d+ --runs \d+ "
    r"--chunk-ms 0 20$": [
        *("--concurrency", "32")  # one of the three: the later --concurrency is the one taken
    ],
}


def commands() -> list[DocCommand]:
    """The page's block commands, and metrics.md's benchmark line."""
    found = [c for c in page_commands(PAGE) if c.in_block]
    found += [
        c for c in page_commands(METRICS) if c.in_block and c.text.startswith("python -m bench")
    ]
    return found


def tiny(line: str, out: Path) -> list[str]:
    """The line's argv at a tiny size, its outputs under ``out``."""
    extra = next(add for pattern, add in RUN.items() if re.search(pattern, line))
    argv = [w.replace("bench-out/", f"{out}/") for w in [*shlex.split(line), *extra]]
    sized = [SIZES.get(before, w) for before, w in zip(["", *argv], argv)]
    return [sys.executable, *sized[1:]]


@pytest.mark.timeout(300)
def test_every_benchmark_command_parses_and_a_tiny_few_run(
    pytestconfig: pytest.Config, tmp_path: Path, tinylm: Path
) -> None:
    # tinylm: models/tinylm.pt, built once a machine, is the model bench_streaming's worker serves
    use_pytest_config(pytestconfig)
    page = commands()
    assert len(page) >= 43 and any(c.page == "docs/metrics.md" for c in page)
    for command in page:
        check(command.text)
    chosen = [c for c in page if any(re.search(p, c.text) for p in RUN)]
    ran = {p: [c for c in chosen if re.search(p, c.text)] for p in RUN}
    assert all(ran.values()), f"no line of the page matches {[p for p, c in ran.items() if not c]}"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # each starts its own
    took = []
    for command in {c.text: c for c in chosen}.values():  # each distinct line once
        argv = tiny(command.text, tmp_path)
        start = time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        took.append(f"{time.monotonic() - start:.1f} s  {command}")
        assert done.returncode == 0, (
            f"{command}: {argv}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stdout.strip(), f"{command} printed nothing"
    print("\n".join(took))
