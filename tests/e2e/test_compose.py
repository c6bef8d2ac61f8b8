"""The operator's smoke test, for real: build, up, bench, stop, up (docker-compose.yml).

Builds the image from the repository's Dockerfile and runs the repository's compose file
(tests/compose_stack.py), then checks what an operator would:

1. the supervisor turns healthy (a worker has loaded and warmed up its model);
2. the demo producer's phases (200, 5,000, 200 requests/s; fewer requests than the demo)
   answer every request with 0 errors;
3. Prometheus scrapes the fleet's metrics (``inferfleet_workers``, the requests served);
4. ``stop`` while requests keep arriving: the supervisor drains within its grace period,
   exits 0 and leaves no entry pending;
5. ``stop`` everything and ``up`` again: the queue kept in Redis' AOF volume is still
   there, the fleet serves it, and every request sent since step 4 is answered.

Each figure is printed as it is measured (``compose:`` lines in the log). Where no Docker
engine can be used the test is skipped with the reason; under CI it fails instead
(.ci/run prepares an engine and stand-in base images with scripts/compose_env.sh).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest
import redis

from inferfleet.producer import Producer
from inferfleet.producer.protocol import GROUP, QueueKeys
from tests.ci import skip_unless_ci
from tests.compose_stack import (
    WHEELHOUSE_VARIABLE,
    ComposeStack,
    build_image,
    engine_problem,
    last_json,
    wheel_index,
)
from tests.fixtures.build_models import example_inputs
from tests.helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

QUEUE = "ctr"  # what docker-compose.yml serves
STREAM = QueueKeys(QUEUE).requests
BENCH_REQUESTS = 1000  # per phase; the compose file's 20,000 take minutes
GRACE_S = 45.0  # docker-compose.yml: stop_grace_period of the supervisor
Report = Callable[[str], None]


@pytest.fixture(scope="module")
def report(pytestconfig: pytest.Config) -> Report:
    """Print a figure to the terminal now, whatever pytest captures."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")

    def say(line: str) -> None:
        with capture.global_and_fixture_disabled() if capture else nullcontext():
            print(f"\ncompose: {line}", flush=True)

    return say


@pytest.fixture(scope="module")
def stack(report: Report) -> Iterator[ComposeStack]:
    problem = engine_problem()
    if problem:
        skip_unless_ci(f"{problem}: the compose test needs a Docker engine")
    env = {
        **os.environ,
        "INFERFLEET_IMAGE": "inferfleet:compose-test",
        # free ports of 127.0.0.1 instead of 9100 and 9090, which may be taken here
        "INFERFLEET_PUBLISH_ADDRESS": "127.0.0.1",
        "INFERFLEET_PUBLISH_METRICS_PORT": "",
        "INFERFLEET_PUBLISH_PROMETHEUS_PORT": "",
    }
    wheels = env.get(WHEELHOUSE_VARIABLE)
    with wheel_index(Path(wheels)) if wheels else nullcontext() as torch_index:
        seconds = build_image(env["INFERFLEET_IMAGE"], env, torch_index)
    report(
        f"image built in {seconds:.0f} s (base {env.get('PYTHON_IMAGE') or 'python:3.11-slim'}, "
        f"torch from {'a local index' if wheels else 'the PyTorch CPU index'})"
    )
    project = ComposeStack(f"ifcompose{os.getpid()}", env)
    project.down()
    try:
        yield project
    finally:
        project.down()


def queue_client(stack: ComposeStack) -> redis.Redis:
    host, port = stack.published("redis", 6379)
    return redis.Redis(host=host, port=port)


def group_state(client: redis.Redis) -> tuple[int, int, int]:
    """(entries in the stream, entries waiting for a worker, entries pending) of the workers' group.

    Waiting entries are counted past the group's last delivered id, not read from XINFO's
    ``lag``: a Redis restarted from its AOF reports the lag of a trimmed stream as nil."""
    group = next(g for g in client.xinfo_groups(STREAM) if g["name"] in (GROUP, GROUP.encode()))
    last = group["last-delivered-id"]
    waiting = len(
        client.xrange(STREAM, b"(" + (last if isinstance(last, bytes) else last.encode()), "+")
    )
    return int(client.xlen(STREAM)), waiting, int(group["pending"])


def bring_up(stack: ComposeStack, report: Report) -> None:
    start = time.monotonic()
    stack.compose("up", "-d", "redis", "supervisor", "prometheus", timeout_s=600)
    stack.wait_healthy("supervisor", timeout_s=300)
    report(f"supervisor healthy {time.monotonic() - start:.0f} s after `up`")


def run_producer(stack: ComposeStack, report: Report) -> None:
    out = stack.compose(
        "run",
        "--rm",
        "--no-deps",
        "-T",
        "-e",
        f"INFERFLEET_BENCH_REQUESTS={BENCH_REQUESTS}",
        "-e",
        "INFERFLEET_BENCH_WARMUP=100",
        "-e",
        "INFERFLEET_BENCH_JSON=true",
        "producer",
        timeout_s=600,
    )
    runs = last_json(out.stdout)["runs"]
    for run in runs:
        report(
            f"producer at {run['offered_qps']:,.0f} req/s: {run['requests']} requests answered, "
            f"{run['errors']} errors, p99 {run['p99_ms']:.1f} ms"
        )
    assert [r["offered_qps"] for r in runs] == [200.0, 5000.0, 200.0]  # the compose file's phases
    assert all(r["requests"] == BENCH_REQUESTS and r["errors"] == 0 for r in runs), runs


def prometheus_value(stack: ComposeStack, query: str) -> float | None:
    host, port = stack.published("prometheus", 9090)
    url = f"http://{host}:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as response:
        result = json.loads(response.read())["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def check_prometheus(stack: ComposeStack, report: Report) -> None:
    served = 3 * BENCH_REQUESTS
    ok = 'sum(inferfleet_requests_total{code="ok"})'
    start = time.monotonic()
    wait_until(
        lambda: (prometheus_value(stack, ok) or 0) >= served,
        120,
        f"Prometheus to scrape {served} requests served",
        every_s=1.0,
    )
    waited = time.monotonic() - start
    workers = prometheus_value(stack, "max(inferfleet_workers)")
    report(
        f"Prometheus scraped inferfleet_workers={workers:g} and {prometheus_value(stack, ok):g} "
        f"requests served ({waited:.0f} s after the bench)"
    )
    assert workers is not None and workers >= 1


class Trickle:
    """Submits one ctr request every 10 ms from a thread until stopped; keeps the ids."""

    def __init__(self, client: redis.Redis) -> None:
        self.producer = Producer(name=QUEUE, client=client, default_deadline_s=None)
        self.ids: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        inputs = example_inputs(QUEUE, rows=1)
        while not self._stop.wait(0.01):
            self.ids.append(self.producer.submit(inputs))

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(10)
        return self.ids


def reply_codes(replies: list) -> list[str]:
    return sorted({"ok" if r.ok else str(r.error_code) for r in replies})


def collect_answered(client: redis.Redis, ids: list[str]) -> tuple[list[str], list[str]]:
    """Pop the replies already written (before they could expire, 300 s on): (their codes, ids still
    unanswered)."""
    producer = Producer(name=QUEUE, client=client)
    pipe = client.pipeline(transaction=False)
    for rid in ids:
        pipe.exists(producer.keys_for(rid).reply(rid))
    written = pipe.execute()
    done = [rid for rid, there in zip(ids, written) if there]
    return reply_codes(producer.results(done, timeout_s=30)), [
        rid for rid, there in zip(ids, written) if not there
    ]


def stop_under_load(stack: ComposeStack, client: redis.Redis, report: Report) -> list[str]:
    trickle = Trickle(client)
    wait_until(lambda: len(trickle.ids) >= 200, 60, "200 requests sent")
    seconds = stack.stop("supervisor", timeout_s=GRACE_S + 60)
    # requests keep arriving with no worker left: they must wait in the queue
    sent = len(trickle.ids)
    wait_until(lambda: len(trickle.ids) >= sent + 100, 60, "100 requests sent after the stop")
    ids = trickle.stop()
    code = stack.inspect("supervisor", "{{.State.ExitCode}}")
    _, lag, pending = group_state(client)
    codes, unanswered = collect_answered(client, ids)
    report(
        f"stop under load: supervisor stopped in {seconds:.1f} s (grace {GRACE_S:g} s), exit "
        f"{code}, {pending} pending, {lag} waiting; {len(ids)} requests sent, "
        f"{len(ids) - len(unanswered)} answered "
        f"{codes}"
    )
    # exit status 0: it left by itself, within the grace period (past it, Docker kills: 137)
    assert code == "0", stack.logs("supervisor")
    assert pending == 0, "the drain left entries pending"
    assert codes in (["ok"], []), codes
    assert lag > 0 and len(unanswered) == lag, (
        "the requests not answered are not the ones waiting in the queue"
    )
    return unanswered


def restart(
    stack: ComposeStack, before: tuple[int, int, int], ids: list[str], report: Report
) -> None:
    stack.compose("stop", timeout_s=GRACE_S + 120)
    stack.compose("up", "-d", "redis", timeout_s=300)
    stack.wait_healthy("redis", timeout_s=120)
    client = queue_client(stack)  # a new port: published ports are chosen again
    after = group_state(client)
    report(
        f"after stop and up: {after[0]} entries, {after[1]} waiting (before: {before[0]}, "
        f"{before[1]})"
    )
    assert after == before, "the queue did not survive the restart (AOF volume)"
    start = time.monotonic()
    stack.compose("up", "-d", "supervisor", "prometheus", timeout_s=600)
    stack.wait_healthy("supervisor", timeout_s=300)
    wait_until(
        lambda: group_state(client)[1:] == (0, 0),
        120,
        "the fleet to serve the queue it found",
        every_s=1.0,
    )
    replies = Producer(name=QUEUE, client=client).results(ids, timeout_s=30)
    codes = reply_codes(replies)
    report(
        f"the restarted fleet served the queue in {time.monotonic() - start:.0f} s; "
        f"the {len(ids)} requests waiting answered {codes}"
    )
    assert codes == ["ok"]


def test_build_up_bench_stop_up(stack: ComposeStack, report: Report) -> None:
    bring_up(stack, report)
    run_producer(stack, report)
    check_prometheus(stack, report)
    client = queue_client(stack)
    waiting = stop_under_load(stack, client, report)
    restart(stack, group_state(client), waiting, report)
