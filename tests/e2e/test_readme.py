"""The README's usage block, run line by line as written against a real redis-server.

Each line runs in bash from the repository root with ``REDIS_URL`` set to the test's private
server (the README says every command reads it). Short commands must exit 0; the long-running
ones (``worker``, ``supervise``, ``--watch``, ``--follow``) are started, must come up (a worker
joins the group; a watch keeps running), and are stopped at the end.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.conftest import ROOT, stop_process, worker_env
from tests.docs_blocks import commands

README = ROOT / "README.md"


def _usage_block() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Use it"):text.index("## ", text.index("## Use it") + 3)]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    return commands(block[:block.index("```")])


def _long_running(line: str) -> bool:
    argv = shlex.split(line)
    return argv[:1] == ["inferfleet"] and (argv[1] in ("worker", "supervise") or "--watch" in argv
                                            or "--follow" in argv)


def _consumers(client: redis.Redis, name: str) -> int:
    try:
        return len(client.xinfo_consumers(f"inferfleet:{{{name}}}:requests", "workers"))
    except redis.exceptions.ResponseError:
        return 0


def _start(line: str, env: dict[str, str], client: redis.Redis) -> subprocess.Popen:
    """Start a long-running line; return once it is up (a worker has joined, a watch is running)."""
    argv = shlex.split(line)
    name = argv[argv.index("--name") + 1] if "--name" in argv else ""
    before = _consumers(client, name) if name else 0
    proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{line!r} exited with {proc.returncode}:\n{proc.stderr.read().decode()}")
        if argv[1] in ("worker", "supervise"):
            if _consumers(client, name) > before:
                return proc
        elif time.monotonic() > deadline - 237:  # a watch: still running after 3 s
            return proc
        time.sleep(0.1)
    raise AssertionError(f"{line!r} did not come up within 240 s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    stop_process(proc, timeout_s=30)
    if proc.stderr:
        proc.stderr.close()


def _run(line: str, env: dict[str, str]) -> None:
    """A short line; an assignment (``rid=$(...)``) keeps its value for the lines after it."""
    name, sep, _ = line.partition("=")
    if sep and name.isidentifier() and " " not in name:
        ran = subprocess.run(["bash", "-c", f'{line} && printf %s "${name}"'], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        env[name] = ran.stdout
    else:
        ran = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, f"{line!r} exited with {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
    assert "Traceback" not in ran.stderr, ran.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_usage_block_runs_as_written(redis_url, redis_client):
    env = worker_env(redis_url)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    lines = _usage_block()
    assert lines[0] == "./scripts/setup" and lines[1] == ". .venv/bin/activate"
    assert os.access(ROOT / "scripts" / "setup", os.X_OK)
    started: list[subprocess.Popen] = []
    try:
        for line in lines[2:]:  # set-up is what made this environment; the rest runs as written
            if _long_running(line):
                started.append(_start(line, env, redis_client))
            else:
                _run(line, env)
    finally:
        for proc in reversed(started):
            _stop(proc)
    assert len(started) == 7
    assert (ROOT / "bench-out" / "report.md").exists()


def test_the_readme_names_only_files_the_setup_builds():
    for line in _usage_block():
        for word in (w.rstrip(")") for w in shlex.split(line)):
            if word.startswith("models/") and not word.endswith(".onnx"):  # .onnx: export_onnx.py writes them
                assert (ROOT / word).exists(), f"{word} (in {line!r}) is not built by ./scripts/setup"


def test_the_protocol_example_says_its_version_is_the_files_hash():
    """torch stamps every save, so a fresh build's version differs: the page must say so, and agree with itself."""
    page = (ROOT / "docs" / "protocol.md").read_text()
    shown = "6d24718510d7"
    assert f"`model.version`, `{shown}` here, is the first 12 hex digits" in page
    assert "".join(f"{ord(c):02x}" for c in shown) in page.replace(" ", "")  # the hexdump shows the same bytes
    assert "62f36a1e9f76" not in page
