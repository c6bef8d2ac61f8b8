"""docs/generation.md's "Try it", run as written: the example language model built, served by
``inferfleet worker``, its tokens streamed by ``inferfleet enqueue --stream`` and by the page's
Python, each checked against the model's own greedy output."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

from tests.conftest import ROOT, stop_process, worker_env
from tests.docs_blocks import code_blocks, commands
from tests.fixtures.tiny_lm import TinyLM, decode, encode
from tests.helpers import wait_until

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "generation.md"


def _env(redis_url: str) -> dict[str, str]:
    env = worker_env(redis_url)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    return env


def _serving(client: redis.Redis, worker: subprocess.Popen) -> bool:
    assert worker.poll() is None, worker.stderr.read().decode() if worker.stderr else ""
    try:
        return bool(client.xinfo_consumers("inferfleet:{tokens}:requests", "workers"))
    except redis.exceptions.ResponseError:
        return False  # no group yet


def test_the_generation_page_runs_as_written(tinylm, redis_url, redis_client, monkeypatch):
    """The block's build line is what the ``tinylm`` fixture runs (once a machine); the
    worker, both enqueues and the Python example then run literally."""
    build, serve, as_text, as_json = commands(code_blocks(PAGE, "bash")[0])
    assert build == "python -m tests.fixtures.build_models --only tinylm"
    model = TinyLM(path=tinylm)
    model.setup(torch.device("cpu"))
    expected = model.reference_generate(encode("docker compose"), 40)
    env = _env(redis_url)
    worker = subprocess.Popen(
        shlex.split(serve), cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: _serving(redis_client, worker), 60, "the worker to join the group")
        text = subprocess.run(
            shlex.split(as_text), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert text.returncode == 0, text.stderr
        assert text.stdout == decode(expected) + "\n"
        assert text.stderr.strip() == "[length, 40 chunks]"
        lines = subprocess.run(
            shlex.split(as_json), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        chunks = [json.loads(line) for line in lines.stdout.splitlines()]
        assert [c["n"] for c in chunks] == [0, 1, 2, 3, 4]
        assert [t for c in chunks for t in c["tokens"]] == [int(t) for t in expected[:5]]
        assert chunks[-1]["final"] and chunks[-1]["finish_reason"] == "length"
        monkeypatch.setenv("REDIS_URL", redis_url)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(code_blocks(PAGE, "python")[0], {})  # the page's own example
        assert printed.getvalue() == decode(expected) + " [length]\n"
    finally:
        stop_process(worker)
        if worker.stderr:
            worker.stderr.close()
