"""docs/handlers.md, run as written: its handlers saved as files, workers started from that
directory."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, stop_process, wait_for_consumer, worker_env
from tests.docs_blocks import code_blocks, commands

PAGE = ROOT / "docs" / "handlers.md"
INFERFLEET = str(Path(sys.executable).parent / "inferfleet")


def _examples() -> list[tuple[str, str, str, str]]:
    """(file name, its source, the worker command, the client) of each example on the page."""
    python, shell = code_blocks(PAGE, "python"), code_blocks(PAGE, "bash")
    files = [b for b in python if b.startswith("# file: ")]
    clients = [b for b in python if b.startswith("# client:")]
    assert len(files) == len(clients) == len(shell) == 2, "the page has two complete examples"
    return [
        (f.splitlines()[0].removeprefix("# file: ").strip(), f, commands(s)[0], c)
        for f, s, c in zip(files, shell, clients)
    ]


@pytest.mark.parametrize("index", [0, 1], ids=["tuple-outputs", "variable-length-text"])
def test_each_handler_example_runs_as_written(index, tmp_path, redis_url, redis_client):
    filename, source, command, client = _examples()[index]
    (tmp_path / filename).write_text(source)
    argv = shlex.split(command)
    assert argv[0] == "inferfleet" and "--model" in argv
    name = argv[argv.index("--name") + 1]
    env = worker_env(
        redis_url
    )  # the handler module is found in the current directory, not on PYTHONPATH
    proc = subprocess.Popen(
        [INFERFLEET, *argv[1:], "--consumer", "doc"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        try:
            wait_for_consumer(redis_client, f"inferfleet:{{{name}}}:requests", "doc", proc)
        except (RuntimeError, TimeoutError) as exc:
            stop_process(proc)
            raise AssertionError(f"{exc}\n{proc.stderr.read().decode(errors='replace')}") from exc
        ran = subprocess.run(
            [sys.executable, "-c", client],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr
        if (
            index == 1
        ):  # four raw texts of four lengths: answered from shared batches, not one batch each
            rows = [
                int(line.split("rows in batch: ")[1].split()[0]) for line in ran.stdout.splitlines()
            ]
            assert len(rows) == 4 and max(rows) > 1, ran.stdout
    finally:
        stop_process(proc)
        proc.stderr.close()


def test_the_worker_finds_no_handler_outside_its_directory(tmp_path, redis_url):
    (tmp_path / "elsewhere").mkdir()
    filename, source, _, _ = _examples()[0]
    (tmp_path / filename).write_text(source)
    ran = subprocess.run(
        [INFERFLEET, "worker", "--name", "t", "--model", "tabular_handler:TabularHandler"],
        cwd=tmp_path / "elsewhere",
        env=worker_env(redis_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 1
    assert "cannot import handler 'tabular_handler:TabularHandler'" in ran.stderr
    assert "Traceback" not in ran.stderr
