"""The example web apps, started as docs/operations.md starts them, against a real fleet.

gunicorn (``--preload``, 4 processes x 8 threads, one module-level Producer made before the fork)
and uvicorn (one AsyncProducer made at start-up) each answer 5,000 HTTP requests from concurrent
clients. Every input differs, so a reply handed to the wrong caller shows: each response is
checked against the model's direct forward pass of that request's own input.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, stop_process, worker_env
from tests.docs_blocks import code_blocks, commands

pytestmark = pytest.mark.timeout(300)

REQUESTS = 5_000
CLIENTS = 16


def doc_commands() -> list[list[str]]:
    """The argv of each line of operations.md's "From a web service" block."""
    block = next(
        b for b in code_blocks(ROOT / "docs" / "operations.md", "bash") if "wsgi_app:app" in b
    )
    return [shlex.split(line) for line in commands(block.replace("\\\n", " "))]


def doc_command(program: str) -> list[str]:
    """The argv of the block's line that runs ``program``."""
    return next(argv for argv in doc_commands() if argv[0] == program)


def on_port(argv: list[str], port: int) -> tuple[list[str], int]:
    """``argv`` with its ``--bind``/``--port`` value moved to ``port`` (a free one), and the port
    the doc gave."""
    out, doc_port = list(argv), 0
    for option in ("--bind", "--port"):
        if option in out:
            at = out.index(option) + 1
            doc_port = int(out[at].rpartition(":")[2])
            out[at] = f"127.0.0.1:{port}" if option == "--bind" else str(port)
    return out, doc_port


def run_doc_curls(doc_port: int, port: int, affine) -> int:
    """Run the block's curl lines for the app the doc put on ``doc_port``; how many ran."""
    ran = 0
    for argv in doc_commands():
        if argv[0] == "curl" and any(f"localhost:{doc_port}/" in a for a in argv):
            argv = [a.replace(f"localhost:{doc_port}/", f"localhost:{port}/") for a in argv]
            got = json.loads(subprocess.run(argv, capture_output=True, check=True).stdout)
            if "-d" in argv:
                sent = np.array(json.loads(argv[argv.index("-d") + 1])["inputs"], np.float32)
                assert np.allclose(got["outputs"], affine(sent), atol=1e-4), got
            else:
                assert got["backlog"] >= 0, got
            ran += 1
    return ran


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def connection(port: int, timeout_s: float) -> Iterator[http.client.HTTPConnection]:
    """A kept-alive HTTP connection to the app, closed after use."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        yield conn
    finally:
        conn.close()


def request(conn: http.client.HTTPConnection, method: str, path: str, body: bytes = b""):
    """(status, body: decoded if JSON, else bytes) of one request on a kept-alive connection."""
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    body = response.read()
    is_json = response.getheader("Content-Type", "").startswith("application/json")
    return response.status, json.loads(body) if is_json else body


@pytest.fixture
def web_app(spawn_worker, models_dir: Path, redis_url: str):
    """``web_app(program)`` starts the docs' gunicorn or uvicorn line on a free port, with a real
    worker behind it, and returns (that port, the doc's) once ``/healthz`` answers."""
    assert doc_command("inferfleet")[1:] == [
        "worker",
        "--name",
        "affine",
        "--model",
        "models/affine.pt",
    ]
    queue = f"web-{os.urandom(3).hex()}"
    spawn_worker(queue, str(models_dir / "affine.pt"))
    env = {**worker_env(redis_url), "INFERFLEET_QUEUE": queue}
    started: list[subprocess.Popen] = []

    def start(program: str) -> tuple[int, int]:
        port = free_port()
        argv, doc_port = on_port(doc_command(program), port)
        proc = subprocess.Popen(
            [sys.executable, "-m", *argv], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
        )
        started.append(proc)
        wait_healthy(proc, port)
        return port, doc_port

    yield start
    for proc in started:
        code = stop_process(proc, 30)
        assert proc.stderr is not None
        with proc.stderr:
            said = proc.stderr.read()
        # uvicorn re-raises the SIGTERM once its shutdown (the producer's close) is done
        assert code in (0, -signal.SIGTERM) and "Traceback" not in said, said


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        try:
            with connection(port, 5) as conn:
                status, body = request(conn, "GET", "/healthz")
        except OSError:
            time.sleep(0.1)
            continue
        assert status == 200 and body["backlog"] >= 0, body
        return
    raise AssertionError(f"nothing answered /healthz on port {port} within {timeout_s} s")


def inputs(client: int) -> Iterator[np.ndarray]:
    """This client's inputs: 1 to 3 rows each, all different."""
    rng = np.random.default_rng(client)
    for i in range(REQUESTS // CLIENTS + (client < REQUESTS % CLIENTS)):
        yield rng.standard_normal((1 + i % 3, 16)).astype(np.float32)


def serve_all(port: int, affine) -> tuple[int, list[str]]:
    """Send every client's requests; (responses checked, what was wrong)."""
    checked, wrong = [0] * CLIENTS, list[str]()

    def client(n: int) -> None:
        with connection(port, 60) as conn:
            for x in inputs(n):
                body = json.dumps({"inputs": x.tolist()}).encode()
                status, got = request(conn, "POST", "/predict", body)
                if status != 200 or not np.allclose(got["outputs"], affine(x), atol=1e-4):
                    wrong.append(f"client {n}: {status} {str(got)[:200]}")
                checked[n] += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    return sum(checked), wrong


def bad_requests_answer_4xx(port: int) -> None:
    with connection(port, 10) as conn:
        bad_requests_on(conn)


def bad_requests_on(conn: http.client.HTTPConnection) -> None:
    status, body = request(conn, "POST", "/predict", b"not json")
    assert status == 400 and "not JSON" in body["detail"]
    status, body = request(conn, "POST", "/predict", b'{"inputs": [[1, 2], [3]]}')
    assert status == 400 and "one length" in body["detail"]
    status, body = request(conn, "POST", "/predict", json.dumps({"inputs": [[0.0] * 5]}).encode())
    assert status == 400 and body["error"] == "BadRequest", body  # the model wants 16 columns
    assert request(conn, "GET", "/predict")[0] == 405


def a_huge_body_is_refused_unread(port: int) -> None:
    """Refused on its declared length: the app answers before the client sends the body."""
    with connection(port, 10) as conn:
        conn.putrequest("POST", "/predict")
        conn.putheader("Content-Length", str(2 << 20))
        conn.endheaders()
        response = conn.getresponse()
        body = json.loads(response.read())
    assert response.status == 413 and body["error"] == "BodyTooLarge", body


@pytest.mark.parametrize("program", ["gunicorn", "uvicorn"])
def test_the_example_app_answers_every_request_with_its_own_output(
    web_app, program: str, affine
) -> None:
    port, doc_port = web_app(program)
    assert run_doc_curls(doc_port, port, affine) >= 1
    checked, wrong = serve_all(port, affine)
    assert wrong == [] and checked == REQUESTS
    bad_requests_answer_4xx(port)
    a_huge_body_is_refused_unread(port)
