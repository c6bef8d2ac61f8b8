"""Start ``inferfleet worker`` subprocesses and wait until they joined the group (demo and benchmarks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent


def start_workers(
    url: str,
    name: str,
    model: str,
    count: int,
    label: str,
    extra: list[str] | tuple[str, ...] = (),
    timeout_s: float = 120.0,
) -> list[subprocess.Popen]:
    """``count`` workers named LABEL-0.. on queue ``name``; raises SystemExit if they do not come up."""
    env = dict(os.environ, REDIS_URL=url, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferfleet",
                "worker",
                "--name",
                name,
                "--model",
                str(model),
                "--consumer",
                f"{label}-{i}",
                "--log-level",
                "warning",
                *extra,
            ],
            env=env,
            cwd=ROOT,
        )
        for i in range(count)
    ]
    client = redis.Redis.from_url(url)
    stream = f"inferfleet:{{{name}}}:requests"
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise SystemExit("a worker exited during start-up; see its log above")
            try:
                if len(client.xinfo_consumers(stream, "workers")) >= count:
                    return procs
            except redis.exceptions.ResponseError:
                pass  # the group does not exist yet
            time.sleep(0.1)
    finally:
        client.close()
    for proc in procs:
        proc.kill()
    raise SystemExit(f"workers did not become ready within {timeout_s:.0f} s")
