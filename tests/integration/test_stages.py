"""Pipeline stages on a real redis-server: the forward script's exactly-once rule, and stage
consumers in this process forwarding, refusing and answering."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from inferfleet.producer.protocol import GROUP, QueueKeys, decode_body, decode_reply, encode_body
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.counters import Counters
from inferfleet.worker.keys import StageKeys
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.consumer import ensure_group
from inferfleet.worker.serving.intake import Answer
from inferfleet.worker.serving.stages import Forward, ForwardWriter, StageConsumer

META = ("q", "v1")
STAGE1, STAGE2 = StageKeys("q", stage=1), StageKeys("q", stage=2)


def writer(client: redis.Redis) -> ForwardWriter:
    return ForwardWriter(client, STAGE1, 300, META, Counters(), STAGE2.requests)


def forward(entry_id: bytes, rid: str) -> Forward:
    body = encode_body(np.ones((1, 4), np.float32))
    return Forward(
        entry_id,
        QueueKeys("q").reply(rid),
        body,
        True,
        rid=rid,
        fields=[b"id", rid, b"body", body, b"version", b"v1"],
    )


def test_a_request_computed_twice_by_a_stage_is_forwarded_once(redis_client: redis.Redis) -> None:
    ensure_group(redis_client, STAGE1.requests)
    entry_id = redis_client.xadd(STAGE1.requests, {"id": "r1", "body": b"x", "version": "v1"})
    redis_client.xreadgroup(GROUP, "slow", {STAGE1.requests: ">"})
    redis_client.xclaim(
        STAGE1.requests, GROUP, "taker", 0, [entry_id]
    )  # the slow one's entry taken over
    writer(redis_client).write([forward(entry_id, "r1")])  # the taker forwards first
    writer(redis_client).write(
        [forward(entry_id, "r1")]
    )  # the slow one finishes late: its XACK finds it done
    forwarded = redis_client.xrange(STAGE2.requests)
    assert (
        len(forwarded) == 1
        and forwarded[0][1][b"id"] == b"r1"
        and forwarded[0][1][b"version"] == b"v1"
    )
    assert redis_client.xpending(STAGE1.requests, GROUP)["pending"] == 0


def test_one_call_forwards_replies_and_acknowledges(redis_client: redis.Redis) -> None:
    ensure_group(redis_client, STAGE1.requests)
    ids = [redis_client.xadd(STAGE1.requests, {"id": f"r{i}"}) for i in range(3)]
    redis_client.xreadgroup(GROUP, "me", {STAGE1.requests: ">"})
    reply_key = QueueKeys("q").reply("r1")
    writer(redis_client).write(
        [
            forward(ids[0], "r0"),
            Answer(ids[1], reply_key, b"error reply", rid="r1"),
            Answer(ids[2], None, None),
        ]
    )
    assert redis_client.xlen(STAGE2.requests) == 1
    assert (
        redis_client.lrange(reply_key, 0, -1) == [b"error reply"]
        and redis_client.ttl(reply_key) > 0
    )
    assert redis_client.xpending(STAGE1.requests, GROUP)["pending"] == 0


def stage_consumer(split: Path, stage: int, client: redis.Redis, url: str) -> StageConsumer:
    settings = WorkerSettings(
        name="q",
        model=str(split),
        stage=stage,
        redis_url=url,
        warmup_iters=0,
        consumer=f"stage{stage}",
        max_wait_ms=0,
    )
    consumer = StageConsumer(settings, load_runtime(settings), client)
    consumer.prepare()
    return consumer


def test_stage_consumers_forward_refuse_other_versions_and_answer(
    stack_split: Path, redis_client: redis.Redis, redis_url: str
) -> None:
    middle = stage_consumer(stack_split, 1, redis_client, redis_url)
    last = stage_consumer(stack_split, 2, redis_client, redis_url)
    version = middle.runtime.version
    h = np.random.default_rng(1).standard_normal(
        (3, 64), dtype=np.float32
    )  # stage 1's input: 64 wide
    inbox = QueueKeys("q").inbox("c")
    redis_client.xadd(
        STAGE1.requests,
        {
            "id": "ok",
            "body": encode_body(h),
            "version": version,
            "reply_to": inbox,
            "deadline": "99999999999999",
        },
    )
    redis_client.xadd(
        STAGE1.requests, {"id": "old", "body": encode_body(h), "version": "0123456789ab"}
    )
    redis_client.xadd(
        STAGE1.requests, {"id": "bad", "body": encode_body(h[:, :5]), "version": version}
    )
    assert middle.run_once() == 3
    assert middle.counters.metrics.queue == "q/stage1"  # its metrics are labelled by stage
    ((_, fields),) = redis_client.xrange(STAGE2.requests)
    assert fields[b"version"] == version.encode() and fields[b"reply_to"] == inbox.encode()
    assert fields[b"deadline"] == b"99999999999999"
    old = decode_reply(redis_client.lpop(QueueKeys("q").reply("old")))
    bad = decode_reply(redis_client.lpop(QueueKeys("q").reply("bad")))
    assert (old.error_code, bad.error_code) == ("model_error", "bad_request")
    assert "pipeline version changed" in (old.error_message or "")
    assert last.run_once() == 1
    reply = decode_reply(redis_client.lpop(inbox))
    stage1 = torch.export.load(str(stack_split / "stage-1.pt2")).module()
    stage2 = torch.export.load(str(stack_split / "stage-2.pt2")).module()
    with torch.no_grad():
        expected = stage2(stage1(torch.from_numpy(h))).numpy()
    assert reply.ok and reply.model_version == version
    np.testing.assert_allclose(reply.outputs, expected, atol=1e-5)
    for keys in (STAGE1, STAGE2):
        assert redis_client.xpending(keys.requests, GROUP)["pending"] == 0
    assert decode_body(fields[b"body"])[0].shape == (3, 64)


def test_a_split_without_a_stage_is_refused_clearly(stack_split: Path) -> None:
    from inferfleet.worker.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"is a split model .* with --stage K"):
        load_runtime(WorkerSettings(name="q", model=str(stack_split)))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_stage_loads_its_program_with_the_splits_version(
    stack_split: Path, stage: int
) -> None:
    runtime = load_runtime(
        WorkerSettings(
            name="q", model=str(stack_split), stage=stage, warmup_iters=1, model_version="ignored"
        )
    )
    assert runtime.pipeline is not None and runtime.version == runtime.pipeline.version
    assert runtime.pipeline.stages[stage].file == f"stage-{stage}.pt2"


def test_status_shows_every_stage_of_a_pipeline(redis_client: redis.Redis) -> None:
    from inferfleet.worker.cli.status import gather, with_stages

    for keys in (QueueKeys("q"), STAGE1, STAGE2):
        ensure_group(redis_client, keys.requests)
    redis_client.xadd(STAGE2.requests, {"id": "r"})
    found = with_stages(redis_client, QueueKeys("q"))
    assert [k.requests for k in found] == [
        QueueKeys("q").requests,
        STAGE1.requests,
        STAGE2.requests,
    ]
    last = gather(redis_client, found[2])
    assert (last.name, last.lag, last.length) == ("q stage 2", 1, 1)


def test_a_hot_swap_moves_a_stage_to_the_same_stage_of_another_split(
    stack_split: Path, models_dir: Path, tmp_path: Path, redis_client: redis.Redis, redis_url: str
) -> None:
    from inferfleet.worker.runtime.split import split_model

    other = tmp_path / "other"
    split_model(
        str(models_dir / "stack.pt2"), np.load(models_dir / "stack.npy"), ["blocks.3"], str(other)
    )
    middle = stage_consumer(stack_split, 1, redis_client, redis_url)
    old = middle.runtime.version
    settings = WorkerSettings(name="q", model=str(other), stage=1, warmup_iters=0)
    middle.switch_runtime(
        load_runtime(settings), str(other)
    )  # stage 1 of a 2-stage split: now the last
    new = middle.runtime.version
    assert new != old
    h = np.ones((1, 64), np.float32)
    redis_client.xadd(STAGE1.requests, {"id": "before", "body": encode_body(h), "version": old})
    redis_client.xadd(STAGE1.requests, {"id": "after", "body": encode_body(h), "version": new})
    assert middle.run_once() == 2
    before = decode_reply(redis_client.lpop(QueueKeys("q").reply("before")))
    after = decode_reply(redis_client.lpop(QueueKeys("q").reply("after")))
    assert (
        before.error_code == "model_error" and before.model_version == new
    )  # never a mix of two splits
    assert after.ok and after.model_version == new and after.outputs.shape == (1, 8)
    assert redis_client.xlen(STAGE2.requests) == 0  # the last stage answers, it forwards nothing


def test_the_result_cache_is_refused_before_the_last_stage(
    stack_split: Path, redis_client: redis.Redis, redis_url: str
) -> None:
    from inferfleet.worker.errors import ConfigError

    settings = WorkerSettings(
        name="q",
        model=str(stack_split),
        stage=1,
        redis_url=redis_url,
        warmup_iters=0,
        cache_size=100,
    )
    with pytest.raises(ConfigError, match=r"use it on the last stage \(2\) only"):
        StageConsumer(settings, load_runtime(settings), redis_client)


def test_a_stage_supervisor_scales_on_its_own_stream(
    redis_client: redis.Redis, redis_url: str
) -> None:
    from inferfleet.worker.fleet.scaling import PolicySettings
    from inferfleet.worker.fleet.supervisor import Supervisor, SupervisorSettings, observe
    from inferfleet.worker.serving.consumer import ensure_group as create

    worker = WorkerSettings(name="q", model="/split", stage=1, redis_url=redis_url)
    supervisor = Supervisor(
        SupervisorSettings(worker=worker, policy=PolicySettings(kind="lag")),
        lambda *a: None,
        client=redis_client,
    )
    assert supervisor.keys.requests == STAGE1.requests
    create(redis_client, STAGE1.requests)
    create(redis_client, QueueKeys("q").requests)
    for i in range(7):
        redis_client.xadd(STAGE1.requests, {"id": f"r{i}"})
    redis_client.xadd(
        QueueKeys("q").requests, {"id": "other"}
    )  # stage 0's backlog is not stage 1's
    assert observe(redis_client, supervisor.shard_keys, 0, 0.0).lag == 7


def test_a_stage_dead_letters_an_entry_whose_workers_keep_dying(
    stack_split: Path, redis_client: redis.Redis, redis_url: str
) -> None:
    import time

    settings = WorkerSettings(
        name="q",
        model=str(stack_split),
        stage=1,
        redis_url=redis_url,
        warmup_iters=0,
        consumer="alive",
        claim_idle_s=0.1,
        housekeeping_s=0.01,
        max_deliveries=1,
    )
    consumer = StageConsumer(settings, load_runtime(settings), redis_client)
    consumer.prepare()
    body = encode_body(np.ones((1, 64), np.float32))
    redis_client.xadd(
        STAGE1.requests, {"id": "doomed", "body": body, "version": consumer.runtime.version}
    )
    redis_client.xreadgroup(
        GROUP, "crashed", {STAGE1.requests: ">"}
    )  # read by a worker that died (no heartbeat)
    time.sleep(0.3)
    for _ in range(3):  # housekeeping takes it over, then it is the next suspect
        consumer.run_once()
    reply = decode_reply(redis_client.lpop(QueueKeys("q").reply("doomed")))
    assert reply.error_code == "dead_letter"
    ((_, letter),) = redis_client.xrange(QueueKeys("q").dead)  # the queue's one dead stream
    assert letter[b"id"] == b"doomed"
    assert (
        redis_client.xpending(STAGE1.requests, GROUP)["pending"] == 0
        and redis_client.xlen(STAGE2.requests) == 0
    )
