"""Drive docker-compose.yml for real, for tests/e2e/test_compose.py: build, up, health, stop.

``ComposeStack`` runs ``docker compose`` (v2) or ``docker-compose`` (v1) on the repository's
own compose file under a private project name, with the variables the file reads (images,
published ports) and one test override (``tests/e2e/compose-test.yml``: Redis published on a
free port of 127.0.0.1, so the test reads the queue from here). Every port is published on
127.0.0.1 only; nothing here leaves the machine.

Where the public registries cannot be reached, ``scripts/compose_env.sh`` builds stand-ins
for the base images and gathers torch's wheels; ``wheel_index`` serves those wheels on
127.0.0.1 as a package index for the image build (``TORCH_INDEX_URL``).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_OVERRIDE = ROOT / "tests" / "e2e" / "compose-test.yml"
# The variables docker-compose.yml and the Dockerfile read for their base images; unset, the
# official images (python:3.11-slim, redis:7, prom/prometheus).
IMAGE_VARIABLES = ("PYTHON_IMAGE", "REDIS_IMAGE", "PROMETHEUS_IMAGE")
WHEELHOUSE_VARIABLE = "INFERFLEET_TEST_WHEELHOUSE"
INDEX_PORT = 38117  # where wheel_index serves, if free


class ComposeError(RuntimeError):
    """A docker or compose command failed; the message carries its output."""


def compose_cli() -> list[str] | None:
    """``docker compose`` (v2 plugin) if it works, else ``docker-compose`` (v1), else None."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def engine_problem() -> str | None:
    """Why no Docker engine can be used here, or None if one answers."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker client on PATH"
    if compose_cli() is None:
        return "neither `docker compose` nor `docker-compose` is installed"
    out = subprocess.run(
        [docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True
    )
    if out.returncode != 0:
        return f"no Docker engine answers (`docker info`: {out.stderr.strip()[:200]})"
    return None


def run(
    argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 600.0, check: bool = True
) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if check and out.returncode != 0:
        raise ComposeError(
            f"{' '.join(argv)} exited {out.returncode}\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        )
    return out


@contextmanager
def wheel_index(wheelhouse: Path) -> Iterator[str]:
    """Serve the wheels in ``wheelhouse`` as a PEP 503 index on 127.0.0.1; yield its URL."""
    root = wheelhouse.parent / f".index-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    for wheel in wheelhouse.glob("*.whl"):
        project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
        (root / "simple" / project).mkdir(parents=True, exist_ok=True)
        (root / "simple" / project / wheel.name).symlink_to(wheel.resolve())
    server = _index_server(partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(root, ignore_errors=True)


def _index_server(
    handler: Callable[..., http.server.BaseHTTPRequestHandler],
) -> http.server.ThreadingHTTPServer:
    """On INDEX_PORT when it is free: the index URL is a build argument of the torch layer, so
    the same URL on every run lets Docker reuse that layer from its cache. Else any free port."""
    try:
        return http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
    except OSError:
        return http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def build_image(tag: str, env: dict[str, str], torch_index: str | None) -> float:
    """``docker build`` the repository's Dockerfile as ``tag``; returns the seconds it took.

    With a local torch index the build joins the host's network (to reach 127.0.0.1)."""
    argv = ["docker", "build", "-t", tag]
    if env.get("PYTHON_IMAGE"):
        argv += ["--build-arg", f"PYTHON_IMAGE={env['PYTHON_IMAGE']}"]
    if torch_index:
        argv += ["--network", "host", "--build-arg", f"TORCH_INDEX_URL={torch_index}"]
    start = time.monotonic()
    # the classic builder: BuildKit would fetch the `# syntax=` frontend from the public registry
    run([*argv, "."], env={**env, "DOCKER_BUILDKIT": "0"}, timeout_s=1800)
    return time.monotonic() - start


class ComposeStack:
    """One compose project of docker-compose.yml (plus the test override) and its containers."""

    def __init__(self, project: str, env: dict[str, str]) -> None:
        cli = compose_cli()
        if cli is None:
            raise ComposeError("no docker compose CLI")
        self.project = project
        self.env = env
        self.base = [
            *cli,
            "-p",
            project,
            "-f",
            str(ROOT / "docker-compose.yml"),
            "-f",
            str(TEST_OVERRIDE),
        ]

    def compose(
        self, *args: str, timeout_s: float = 300.0, check: bool = True
    ) -> subprocess.CompletedProcess:
        return run([*self.base, *args], env=self.env, timeout_s=timeout_s, check=check)

    def container(self, service: str) -> str:
        """The id of the service's container (it may be stopped)."""
        ids = self.compose("ps", "-q", service).stdout.split()
        if not ids:
            raise ComposeError(f"service {service} has no container")
        return ids[0]

    def inspect(self, service: str, template: str) -> str:
        return run(["docker", "inspect", "-f", template, self.container(service)]).stdout.strip()

    def wait_healthy(self, service: str, timeout_s: float) -> float:
        """Seconds until the service's healthcheck passes (raises if it fails or the time runs
        out)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            state = self.inspect(
                service, "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}"
            )
            if state == "running healthy":
                return time.monotonic() - start
            if state.startswith(("exited", "dead")) or state.endswith("unhealthy"):
                break
            time.sleep(1.0)
        raise ComposeError(
            f"{service} is not healthy after {time.monotonic() - start:.0f} s "
            f"({state})\n{self.logs(service)}"
        )

    def published(self, service: str, port: int) -> tuple[str, int]:
        """Where the service's ``port`` is published on this machine: (host, port)."""
        text = self.compose("port", service, str(port)).stdout.strip()
        host, _, number = text.rpartition(":")
        return host, int(number)

    def stop(self, service: str, timeout_s: float) -> float:
        """``compose stop`` the service; returns the seconds it took."""
        start = time.monotonic()
        self.compose("stop", service, timeout_s=timeout_s)
        return time.monotonic() - start

    def logs(self, service: str) -> str:
        out = self.compose("logs", "--no-color", "--tail", "200", service, check=False)
        return out.stdout[-6000:] + out.stderr[-2000:]

    def down(self) -> None:
        """Remove the project's containers, network and volumes (best effort)."""
        self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout_s=180, check=False)


def last_json(text: str) -> dict:
    """The JSON document a command printed last (its log lines may come before it)."""
    start = text.rfind("\n{")
    return json.loads(text[start + 1 if start >= 0 else text.index("{") :])
