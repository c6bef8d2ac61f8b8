"""``./scripts/demo``, the README's first command, run literally: the fleet end to end on its own
Redis."""

from __future__ import annotations

import os
import re
import socket
import subprocess

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_the_demo_runs_as_written_answers_every_request_and_stops_what_it_started():
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # the demo's own embedded Redis
    env["COLUMNS"] = "120"
    out = subprocess.run(
        ["./scripts/demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"requests\s+\S\s+5,000\s", text), (
        text
    )  # the report's rows, as the README shows them
    assert re.search(r"errors\s+\S\s+0\s", text), text
    assert re.search(r"max \|fleet - direct torch\|\s+\S\s+0\.00e\+00", text), text
    assert "every process the demo started has stopped" in text
    url = re.search(r"embedded Redis on redis://127\.0\.0\.1:(\d+)/0: \S*redis-server", text)
    assert url, text  # a real redis-server, not the fakeredis fallback
    with (
        pytest.raises(OSError),
        socket.create_connection(("127.0.0.1", int(url.group(1))), timeout=1),
    ):
        pass  # the embedded server is gone with the demo
