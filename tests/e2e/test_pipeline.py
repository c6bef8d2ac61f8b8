"""A split model served by ``inferfleet worker --pipeline DIR --stage K`` processes on a real
redis-server: the replies equal the unsplit model's, a bad split or manifest is refused at the
command line, and a stage worker SIGKILLed mid-run loses nothing and answers nothing twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from inferfleet.producer import Producer
from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.worker.keys import stage_keys
from tests.conftest import (
    ROOT,
    freeze_while_holding,
    stack_model,
    stop_process,
    wait_for_consumer,
    worker_env,
)
from tests.helpers import wait_until


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferfleet", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env or worker_env(""),
        timeout=300,
    )


@pytest.fixture
def spawn_stage(redis_url: str, redis_client: redis.Redis) -> Iterator:
    """``spawn_stage(name, split, stage, *args)``: a stage worker that reads its stage's stream."""
    procs: list[subprocess.Popen] = []

    def spawn(
        name: str, split: Path, stage: int, *args: str, wait: bool = True
    ) -> subprocess.Popen:
        consumer = f"{name}-s{stage}-{len(procs)}"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferfleet",
                "worker",
                "--name",
                name,
                "--pipeline",
                str(split),
                "--stage",
                str(stage),
                "--consumer",
                consumer,
                *args,
            ],
            env=worker_env(redis_url),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        procs.append(proc)
        proc.consumer = consumer  # type: ignore[attr-defined]
        if wait:
            stream = stage_keys(QueueKeys(name), stage).requests
            try:
                wait_for_consumer(redis_client, stream, consumer, proc, timeout_s=180)
            except (RuntimeError, TimeoutError) as exc:
                stop_process(proc)
                raise AssertionError(
                    f"{exc}\n{proc.stderr.read().decode(errors='replace')}"
                ) from exc
        return proc

    yield spawn
    for proc in procs:
        stop_process(proc)
        if proc.stderr:
            proc.stderr.close()


def expected(models_dir: Path, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return stack_model(models_dir)(torch.from_numpy(x)).numpy()


def nothing_pending(client: redis.Redis, name: str, stages: int) -> list[int]:
    return [
        client.xpending(stage_keys(QueueKeys(name), k).requests, GROUP)["pending"]
        for k in range(stages)
    ]


def settled(client: redis.Redis, name: str, stages: int) -> bool:
    """Every stage's stream delivered to its end and nothing pending: no entry is in flight.

    What waits is read past the group's last delivered id, not from XINFO's ``lag``, which a
    trimmed stream may report as nil."""
    for k in range(stages):
        stream = stage_keys(QueueKeys(name), k).requests
        group = next(g for g in client.xinfo_groups(stream) if g["name"] in (GROUP, GROUP.encode()))
        last = group["last-delivered-id"]
        last = last if isinstance(last, bytes) else last.encode()
        if group["pending"] or client.xrange(stream, b"(" + last, "+", count=1):
            return False
    return True


def leftover_replies(client: redis.Redis, name: str) -> int:
    """Replies nobody collected: a request answered twice leaves its second reply behind."""
    keys = client.keys(f"inferfleet:{{{name}}}:reply:*") + client.keys(
        f"inferfleet:{{{name}}}:inbox:*"
    )
    return sum(client.llen(key) for key in keys)


def test_split_cli_prints_the_stages_and_refuses_bad_points(
    models_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "split"
    done = run_cli(
        "split",
        "--model",
        "tests.fixtures.build_models:stack",
        "--example",
        str(models_dir / "stack.npy"),
        "--split-at",
        "blocks.3",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert (
        "into 2 stages" in done.stdout and "blocks.3" in done.stdout and "parameters" in done.stdout
    )
    manifest = json.loads((out / "pipeline.json").read_text())
    assert [s["starts_at"] for s in manifest["stages"]] == ["", "blocks.3"]
    assert sum(s["parameters"] for s in manifest["stages"]) == sum(
        p.numel() for p in stack_model(models_dir).parameters()
    )
    bad = run_cli(
        "split",
        "--model",
        "tests.fixtures.build_models:stack",
        "--example",
        str(models_dir / "stack.npy"),
        "--split-at",
        "blocks.3,blocks.99",
        "--out",
        str(tmp_path / "other"),
    )
    assert (
        bad.returncode == 1
        and "blocks.99 is not a submodule" in bad.stderr
        and "candidates:" in bad.stderr
    )
    assert not (tmp_path / "other").exists()


def test_a_worker_refuses_a_bad_manifest_clearly(
    stack_split: Path, tmp_path: Path, redis_url: str
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in stack_split.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / "stage-1.pt2").write_bytes(b"not this split's stage")
    done = run_cli(
        "worker",
        "--name",
        "q",
        "--pipeline",
        str(broken),
        "--stage",
        "1",
        env=worker_env(redis_url),
    )
    assert done.returncode == 1 and "SHA-256 differs" in done.stderr, done.stderr
    done = run_cli(
        "worker",
        "--name",
        "q",
        "--pipeline",
        str(stack_split),
        "--stage",
        "3",
        env=worker_env(redis_url),
    )
    assert done.returncode == 1 and "has stages 0 to 2, not 3" in done.stderr, done.stderr


@pytest.mark.timeout(300)  # the split fixture and three CLI starts on 2 busy cores
def test_swap_checks_a_split_and_takes_its_digest_as_the_version(
    stack_split: Path, tmp_path: Path, redis_url: str, redis_client: redis.Redis
) -> None:
    version = json.loads((stack_split / "pipeline.json").read_text())["version"]
    args = ["swap", "--name", "q", "--model", str(stack_split), "--wait-s", "0"]
    done = run_cli(*args, "--version", "other", env=worker_env(redis_url))
    assert done.returncode == 2 and f"a split's version is its digest {version}" in done.stderr, (
        done.stderr
    )
    done = run_cli(*args, env=worker_env(redis_url))
    assert done.returncode == 0, done.stderr
    assert (
        redis_client.hget("inferfleet:{q}:model", "version") == version.encode()
    )  # every stage reads this key
    altered = tmp_path / "altered"
    altered.mkdir()
    for path in stack_split.iterdir():
        (altered / path.name).write_bytes(
            path.read_bytes() if path.name != "stage-2.pt2" else b"other"
        )
    done = run_cli(
        "swap", "--name", "q", "--model", str(altered), "--wait-s", "0", env=worker_env(redis_url)
    )
    assert done.returncode == 2 and "SHA-256 differs" in done.stderr, done.stderr


@pytest.mark.timeout(600)
@pytest.mark.slow  # three workers load torch and their stage: a minute or more on 2 busy cores
def test_three_stages_answer_like_the_unsplit_model(
    stack_split: Path, models_dir: Path, spawn_stage, redis_url: str, redis_client: redis.Redis
) -> None:
    procs = [
        spawn_stage(
            "stack", stack_split, k, "--max-wait-ms", "20", "--max-batch-rows", "32", wait=False
        )
        for k in range(3)
    ]  # loading in parallel
    for stage, proc in enumerate(procs):
        wait_for_consumer(
            redis_client,
            stage_keys(QueueKeys("stack"), stage).requests,
            proc.consumer,
            proc,
            timeout_s=240,
        )
    producer = Producer(redis_url, "stack")
    inputs = [
        np.random.default_rng(i).standard_normal((1 + i % 5, 32), dtype=np.float32)
        for i in range(60)
    ]
    replies = producer.map(inputs, timeout_s=240)
    version = json.loads((stack_split / "pipeline.json").read_text())["version"]
    model = stack_model(models_dir)
    for x, reply in zip(inputs, replies):
        assert reply.ok, reply.error_message
        assert reply.model_version == version
        with torch.no_grad():
            np.testing.assert_allclose(
                reply.outputs, model(torch.from_numpy(x)).numpy(), atol=1e-5, rtol=0
            )
    bad = producer.result(
        producer.submit(np.zeros((1, 7), np.float32)), timeout_s=30, raise_errors=False
    )
    assert bad.error_code == "bad_request"  # refused at stage 0, never forwarded
    assert nothing_pending(redis_client, "stack", 3) == [0, 0, 0]
    assert leftover_replies(redis_client, "stack") == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stage_worker_killed_mid_run_loses_nothing_and_answers_nothing_twice(
    stack_split: Path, models_dir: Path, spawn_stage, redis_url: str, redis_client: redis.Redis
) -> None:
    fast = ("--claim-idle-s", "0.5", "--housekeeping-s", "0.2", "--heartbeat-s", "0.2")
    # the victim fills big batches slowly, so it always holds entries it has read and not answered
    victim = spawn_stage(
        "chaos",
        stack_split,
        1,
        *fast,
        "--max-wait-ms",
        "300",
        "--max-batch-rows",
        "256",
        wait=False,
    )
    others = [
        spawn_stage("chaos", stack_split, k, *fast, "--max-wait-ms", "5", wait=False)
        for k in (0, 1, 2)
    ]
    for proc, stage in [(victim, 1), (others[0], 0), (others[1], 1), (others[2], 2)]:
        wait_for_consumer(
            redis_client,
            stage_keys(QueueKeys("chaos"), stage).requests,
            proc.consumer,
            proc,
            timeout_s=240,
        )
    producer = Producer(redis_url, "chaos")
    inputs = [
        np.random.default_rng(i).standard_normal((1, 32), dtype=np.float32) for i in range(1500)
    ]
    ids: list[str] = []
    sender = threading.Thread(target=lambda: ids.extend(_trickle(producer, inputs)))
    sender.start()
    stream = stage_keys(QueueKeys("chaos"), 1).requests
    freeze_while_holding(redis_client, stream, victim.consumer, victim.pid)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    held = redis_client.xpending_range(
        stream, GROUP, "-", "+", 10_000, consumername=victim.consumer
    )
    assert held, "the victim held no entries when it was killed: the kill did not land mid-run"
    sender.join()
    replies = producer.results(ids, timeout_s=240)
    want = expected(models_dir, np.concatenate(inputs))  # one forward pass for every row
    for i, reply in enumerate(replies):
        assert reply.ok, reply.error_message
        np.testing.assert_allclose(reply.outputs, want[i : i + 1], atol=1e-5, rtol=0)
    # a late duplicate comes from an entry still in flight: wait until none is (every stage's
    # stream read to its end and acknowledged), then count the replies left over
    wait_until(lambda: settled(redis_client, "chaos", 3), 120, "every stage to settle")
    assert leftover_replies(redis_client, "chaos") == 0
    assert nothing_pending(redis_client, "chaos", 3) == [0, 0, 0]
    # what the victim held was taken over and answered by the others (the duplicates' source)
    assert not redis_client.xpending_range(
        stream, GROUP, "-", "+", 10_000, consumername=victim.consumer
    )
    assert all(proc.poll() is None for proc in others)


def _trickle(producer: Producer, inputs: list[np.ndarray]) -> list[str]:
    """Submit in small groups, so requests keep arriving while the victim dies."""
    ids = []
    for i, x in enumerate(inputs):
        ids.append(producer.submit(x))
        if i % 25 == 24:
            time.sleep(0.01)
    return ids
