"""The README's two command blocks, run line by line as written against a real redis-server.

Each line runs in bash from the repository root with ``REDIS_URL`` set to the test's private
server (the README says every command reads it). Short commands must exit 0, or the status their
comment names ("exit status 1"), and print what the ``#>`` lines under them show, numbers aside;
the long-running ones (``worker``, ``supervise``, ``--watch``, ``--follow``) are started, must come
up (a worker joins its stream's group; a watch keeps running), and are stopped at the end.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.keys import stage_keys
from inferfleet.worker.serving.lifecycle import read_published
from tests.conftest import ROOT, stop_process, worker_env
from tests.docs_blocks import FENCE, commands

README = ROOT / "README.md"


def _use_it_blocks() -> list[str]:
    """The bash blocks of the README's "Use it" section, in order."""
    text = README.read_text()
    start = text.index("## Use it")
    section = text[start : text.index("\n## ", start)]
    return [body for lang, body in FENCE.findall(section) if lang == "bash"]


def _usage_block() -> list[str]:
    return commands(_use_it_blocks()[0])


@dataclass
class Step:
    """One command of a block: the line, the exit status its comment names, the output its ``#>``
    lines show."""

    line: str
    status: int = 0
    shown: list[str] = field(default_factory=list)


def steps(block: str) -> list[Step]:
    found: list[Step] = []
    for raw in block.splitlines():
        if raw.startswith("#>"):
            found[-1].shown.append(raw[2:].strip())
            continue
        line, _, comment = raw.partition(" #")
        status = re.search(r"exit status (\d+)", comment)
        if line.strip() and not line.lstrip().startswith("#"):
            found.append(Step(line.strip(), int(status.group(1)) if status else 0))
    return found


def _second_block() -> str:
    return _use_it_blocks()[1]


def _long_running(line: str) -> bool:
    argv = shlex.split(line)
    return argv[:1] == ["inferfleet"] and (
        argv[1] in ("worker", "supervise") or "--watch" in argv or "--follow" in argv
    )


def _stream(argv: list[str]) -> str:
    """The stream a worker line reads: its queue's, or its pipeline stage's."""
    stage = int(argv[argv.index("--stage") + 1]) if "--stage" in argv else 0
    return stage_keys(QueueKeys(argv[argv.index("--name") + 1]), stage).requests


def _consumers(client: redis.Redis, stream: str) -> int:
    try:
        return len(client.xinfo_consumers(stream, "workers"))
    except redis.exceptions.ResponseError:
        return 0


def _start(line: str, env: dict[str, str], client: redis.Redis) -> subprocess.Popen:
    """Start a long-running line; return once it is up (a worker has joined, a watch is running)."""
    argv = shlex.split(line)
    stream = _stream(argv) if "--name" in argv else ""
    before = _consumers(client, stream) if stream else 0
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {line}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"{line!r} exited with {proc.returncode}:\n{proc.stderr.read().decode()}"
            )
        if argv[1] in ("worker", "supervise"):
            if _consumers(client, stream) > before:
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


def _normal(text: str) -> str:
    """Output with its numbers (counts, ratios, versions, ids) made one word: the README shows one
    run's."""
    hashes = re.sub(
        r"\b(?=[0-9a-f]*\d)[0-9a-f]{8,}\b", "N", text.strip()
    )  # versions, ids: a00a1fa9e4c3
    return re.sub(r"\d[0-9a-z.]*", "N", hashes)


def _run(step: Step, env: dict[str, str]) -> None:
    """A short line; an assignment (``rid=$(...)``) keeps its value for the lines after it."""
    line = step.line
    name, sep, _ = line.partition("=")
    if sep and name.isidentifier() and " " not in name:
        ran = subprocess.run(
            ["bash", "-c", f'{line} && printf %s "${name}"'],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        env[name] = ran.stdout
    else:
        ran = subprocess.run(
            ["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
    assert ran.returncode == step.status, (
        f"{line!r} exited with {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
    )
    assert "Traceback" not in ran.stderr, ran.stderr
    printed = [_normal(out) for out in (ran.stdout + ran.stderr).splitlines()]
    for shown in step.shown:
        assert _normal(shown) in printed, (
            f"{line!r} printed no line like {shown!r}:\n{ran.stdout}\n{ran.stderr}"
        )


def run_block(block: list[Step], env: dict[str, str], client: redis.Redis) -> int:
    """Run a block's steps in order; return how many long-running lines came up (all stopped by
    then)."""
    started: list[subprocess.Popen] = []
    try:
        for step in block:
            if _long_running(step.line):
                started.append(_start(step.line, env, client))
            else:
                _run(step, env)
    finally:
        for proc in reversed(started):
            _stop(proc)
    return len(started)


def _env(redis_url: str) -> dict[str, str]:
    env = worker_env(redis_url)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_usage_block_runs_as_written(redis_url, redis_client):
    lines = _usage_block()
    assert lines[0] == "./scripts/setup" and lines[1] == ". .venv/bin/activate"
    assert os.access(ROOT / "scripts" / "setup", os.X_OK)
    # set-up is what made this environment; the rest runs as written
    assert run_block([Step(line) for line in lines[2:]], _env(redis_url), redis_client) == 7
    assert (ROOT / "bench-out" / "report.md").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_rollout_lanes_and_pipeline_block_runs_as_written(redis_url, redis_client):
    block = steps(_second_block())
    refused = [s for s in block if s.status]
    assert [s.line for s in refused] == [
        "inferfleet shadow --name ctr --promote"
    ]  # refused, then --force
    assert any("not promoted" in shown for shown in refused[0].shown)
    assert run_block(block, _env(redis_url), redis_client) == 3
    published = read_published(redis_client, QueueKeys("ctr"))
    assert published is not None and published.version == "v2"  # the forced promotion went through


def test_the_readme_names_only_files_the_setup_builds():
    for line in _usage_block() + [s.line for s in steps(_second_block())]:
        for word in (w.rstrip(")") for w in shlex.split(line)):
            if word.startswith("models/") and not word.endswith(
                (".onnx", "-split")
            ):  # written by the block
                assert (ROOT / word).exists(), (
                    f"{word} (in {line!r}) is not built by ./scripts/setup"
                )


def test_the_protocol_example_says_its_version_is_the_files_hash():
    """torch stamps every save, so a fresh build's version differs: the page must say so, and agree
    with itself."""
    page = (ROOT / "docs" / "protocol.md").read_text()
    shown = "6d24718510d7"
    assert f"`model.version`, `{shown}` here, is the first 12 hex digits" in page
    assert "".join(f"{ord(c):02x}" for c in shown) in page.replace(
        " ", ""
    )  # the hexdump shows the same bytes
    assert "62f36a1e9f76" not in page
