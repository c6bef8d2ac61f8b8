"""The consumer loop against a real redis-server, in-process, with real models."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import redis
import torch

from inferfleet.producer import Producer
from inferfleet.producer.protocol import GROUP, QueueKeys, decode_reply, encode_body, pack
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.consumer import Consumer
from tests.handlers import POISON
from tests.helpers import drain


def make_consumer(redis_url: str, model: str, name: str = "q", **overrides) -> Consumer:
    overrides.setdefault("warmup_iters", 1)
    settings = WorkerSettings(
        name=name,
        model=model,
        redis_url=redis_url,
        consumer=overrides.pop("consumer", "c1"),
        **overrides,
    )
    consumer = Consumer(settings, load_runtime(settings), redis.Redis.from_url(redis_url))
    consumer.prepare()
    return consumer


def pending(client: redis.Redis, keys: QueueKeys) -> int:
    return int(client.xpending(keys.requests, GROUP)["pending"])


@pytest.fixture
def affine_consumer(redis_url: str, redis_client: redis.Redis, models_dir) -> Consumer:
    """A consumer of queue q serving models/affine.pt (``affine``, tests/conftest.py, is the
    model's direct forward pass)."""
    return make_consumer(redis_url, str(models_dir / "affine.pt"), idle_block_ms=50)


def test_batches_queued_requests_and_matches_direct_forward(
    affine_consumer, redis_url, redis_client, models_dir
):
    producer = Producer(redis_url, "q")
    inputs = [
        np.random.default_rng(i).standard_normal((i % 3 + 1, 16), dtype=np.float32)
        for i in range(10)
    ]
    rids = producer.submit_many(inputs)
    drain(affine_consumer)
    replies = producer.results(rids, timeout_s=5)
    model = torch.jit.load(str(models_dir / "affine.pt"))
    with torch.no_grad():
        for x, reply in zip(inputs, replies):
            assert reply.ok
            np.testing.assert_allclose(
                reply.outputs, model(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6
            )
    assert {r.timing["batch_rows"] for r in replies} == {sum(x.shape[0] for x in inputs)}
    assert pending(redis_client, affine_consumer.keys) == 0


def test_bad_entries_are_answered_acked_and_never_block(affine_consumer, redis_url, redis_client):
    keys = affine_consumer.keys
    good = encode_body(np.ones((1, 16), np.float32))
    redis_client.xadd(keys.requests, {"id": "garbage", "body": b"\xc1\xc1not msgpack"})
    redis_client.xadd(
        keys.requests, {"id": "dtype", "body": encode_body(np.ones((1, 16), np.float64))}
    )
    redis_client.xadd(
        keys.requests, {"id": "shape", "body": encode_body(np.ones((1, 3), np.float32))}
    )
    redis_client.xadd(keys.requests, {"id": "nobody"})
    redis_client.xadd(keys.requests, {"body": good})  # no id: acknowledged, logged, no reply
    redis_client.xadd(keys.requests, {"id": "x" * 200, "body": good})  # unreadable id
    redis_client.xadd(
        keys.requests, {"id": "big", "body": pack({"inputs": b"x" * (17 * 1024 * 1024)})}
    )
    redis_client.xadd(keys.requests, {"id": "ok", "body": good})
    drain(affine_consumer)
    codes = {}
    for rid in ("garbage", "dtype", "shape", "nobody", "big", "ok"):
        raw = redis_client.lpop(keys.reply(rid))
        reply = decode_reply(raw)
        codes[rid] = reply.error_code if not reply.ok else "ok"
    assert codes == {
        "garbage": "bad_request",
        "dtype": "bad_request",
        "shape": "bad_request",
        "nobody": "bad_request",
        "big": "too_large",
        "ok": "ok",
    }
    assert pending(redis_client, keys) == 0
    assert redis_client.keys(keys.base + "reply:*") == []  # nothing else was answered


def test_model_error_fails_only_the_guilty_requests(redis_url, redis_client):
    consumer = make_consumer(redis_url, "tests.handlers:Scale", idle_block_ms=50)
    producer = Producer(redis_url, "q")
    inputs = [np.full((1, 4), float(i), np.float32) for i in range(8)]
    inputs[3] = np.full((1, 4), POISON, np.float32)
    inputs[6] = np.full((1, 4), POISON, np.float32)
    rids = producer.submit_many(inputs)
    drain(consumer)
    replies = producer.results(rids, timeout_s=5)
    assert [r.ok for r in replies] == [i not in (3, 6) for i in range(8)]
    assert replies[3].error_code == "model_error" and "poison" in replies[3].error_message
    np.testing.assert_array_equal(replies[5].outputs, inputs[5] * 2)


def test_handler_params_split_batches(redis_url, redis_client):
    consumer = make_consumer(redis_url, "tests.handlers:Scale", idle_block_ms=50)
    producer = Producer(redis_url, "q")
    x = np.ones((1, 4), np.float32)
    rids = [
        producer.submit(x, {"factor": 3}),
        producer.submit(x),
        producer.submit(x, {"factor": 5}),
    ]
    drain(consumer)
    outs = [r.outputs[0, 0] for r in producer.results(rids, timeout_s=5)]
    assert outs == [3.0, 2.0, 5.0]


def test_wrong_output_rows_is_model_error(redis_url, redis_client):
    consumer = make_consumer(redis_url, "tests.handlers:WrongRows", idle_block_ms=50)
    producer = Producer(redis_url, "q")
    rids = producer.submit_many([np.ones((2, 4), np.float32)] * 3)
    drain(consumer)
    replies = producer.results(rids, timeout_s=5)
    assert {r.error_code for r in replies} == {"model_error"}


def test_computed_twice_answered_once(affine_consumer, redis_url, redis_client, models_dir):
    """A slow consumer whose entry was reclaimed and computed elsewhere does not answer again."""
    keys = affine_consumer.keys
    rid = Producer(redis_url, "q").submit(np.ones((1, 16), np.float32))
    # consumer c1 reads the entry but stalls before answering
    entries = affine_consumer._read(1, None)
    assert len(entries) == 1
    # consumer c2 reclaims it and answers
    other = make_consumer(
        redis_url, str(models_dir / "affine.pt"), consumer="c2", idle_block_ms=50, claim_idle_s=0.1
    )
    time.sleep(0.15)
    other.recovery.reclaim()
    drain(other)
    # c1 now finishes its stale batch
    affine_consumer._answer(entries)
    assert redis_client.llen(keys.reply(rid)) == 1
    assert pending(redis_client, keys) == 0


def test_restarted_consumer_replays_its_own_pending(redis_url, redis_client, models_dir):
    keys = QueueKeys("q")
    producer = Producer(redis_url, "q")
    rids = producer.submit_many([np.ones((1, 16), np.float32)] * 5)
    first = make_consumer(
        redis_url, str(models_dir / "affine.pt"), consumer="slot-0", idle_block_ms=50
    )
    first.recovery.replay_own = False
    assert len(first._read(5, None)) == 5  # read, then "crash" before answering
    assert pending(redis_client, keys) == 5
    second = make_consumer(
        redis_url, str(models_dir / "affine.pt"), consumer="slot-0", idle_block_ms=50
    )
    drain(second)
    assert all(r.ok for r in producer.results(rids, timeout_s=5))
    assert pending(redis_client, keys) == 0


def test_acknowledged_entries_are_trimmed_but_pending_kept(
    affine_consumer, redis_url, redis_client
):
    keys = affine_consumer.keys
    producer = Producer(redis_url, "q")
    producer.submit_many([np.ones((1, 16), np.float32)] * 20)
    drain(affine_consumer)
    held = producer.submit(np.ones((1, 16), np.float32))
    other = make_consumer(
        redis_url, affine_consumer.settings.model, consumer="holder", idle_block_ms=50
    )
    other.recovery.replay_own = False
    assert len(other._read(1, None)) == 1  # pending on "holder"
    producer.submit_many([np.ones((1, 16), np.float32)] * 3)  # undelivered
    affine_consumer.recovery._trim()
    assert redis_client.xlen(keys.requests) == 4  # the held entry and the three undelivered
    drain(affine_consumer)
    ((entry_id, fields),) = redis_client.xrange(keys.requests, "-", "+", count=1)
    other._answer([other.intake.admit(entry_id, fields, time.time() * 1000)])
    assert producer.result(held, 5).ok


def test_worker_serves_until_stopped(affine_consumer, redis_url, redis_client):
    stop = threading.Event()
    thread = threading.Thread(target=affine_consumer.run, args=(stop,))
    thread.start()
    try:
        replies = Producer(redis_url, "q").map([np.ones((1, 16), np.float32)] * 500, timeout_s=10)
        assert len(replies) == 500 and all(r.ok for r in replies)
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_out_of_memory_splits_the_batch_and_lowers_the_row_limit(
    redis_url, redis_client, monkeypatch
):
    monkeypatch.setenv("OOM_ROWS", "8")
    consumer = make_consumer(
        redis_url,
        "tests.handlers:OutOfMemoryOverRows",
        idle_block_ms=50,
        max_batch_rows=32,
        warmup_iters=0,
    )
    producer = Producer(redis_url, "q")
    inputs = [np.full((1, 4), i, np.float32) for i in range(32)]
    rids = producer.submit_many(inputs)
    drain(consumer)
    replies = producer.results(rids, timeout_s=5)
    assert all(r.ok for r in replies)  # every request answered despite the OOM
    for x, r in zip(inputs, replies):
        np.testing.assert_array_equal(r.outputs, x * 2)
    assert consumer.row_limit.rows == 8  # halved twice: 32 -> 16 -> 8
    more = producer.submit_many(inputs)
    drain(consumer)
    assert max(r.timing["batch_rows"] for r in producer.results(more, timeout_s=5)) <= 8


@pytest.mark.parametrize("columnar", [True, False], ids=["columnar-path", "general-path"])
def test_out_of_memory_frees_the_failed_pass_before_the_retries(
    redis_url, redis_client, monkeypatch, columnar
):
    """Issue 31: when the cache is emptied after an out-of-memory error, nothing of the failed
    pass may still be alive (its frames, kept by a traceback, held its device tensors)."""
    from tests.handlers import ACTIVATIONS

    monkeypatch.setenv("OOM_ROWS", "8")
    consumer = make_consumer(
        redis_url,
        "tests.handlers:OutOfMemoryHoldingActivations",
        idle_block_ms=50,
        max_batch_rows=32,
        warmup_iters=0,
    )
    consumer.columnar = columnar
    alive_at_release: list[int] = []
    monkeypatch.setattr(
        consumer.runtime,
        "release_memory",
        lambda: alive_at_release.append(sum(ref() is not None for ref in ACTIVATIONS)),
    )
    ACTIVATIONS.clear()
    producer = Producer(redis_url, "q")
    inputs = [np.full((1, 4), i, np.float32) for i in range(32)]
    rids = producer.submit_many(inputs)
    drain(consumer)
    replies = producer.results(rids, timeout_s=5)
    assert all(r.ok for r in replies) and consumer.row_limit.rows == 8
    assert alive_at_release  # the cache was emptied after each failed pass...
    assert set(alive_at_release) == {0}  # ...and each time the failed passes were already gone


def test_out_of_memory_in_the_warm_up_caps_the_batches_instead_of_failing_the_load(
    redis_url, redis_client, monkeypatch, caplog
):
    """Issue 31: a GPU too small for --max-batch-rows used to fail the warm-up (exit 3, restarted
    in a loop by the supervisor); the worker now serves batches of the largest size that fit."""
    monkeypatch.setenv("OOM_ROWS", "8")
    with caplog.at_level("WARNING"):
        consumer = make_consumer(
            redis_url, "tests.handlers:OutOfMemoryOverRows", idle_block_ms=50, max_batch_rows=32
        )
    assert consumer.runtime.fits_rows == 8  # 16 rows ran out of memory, 8 fitted
    assert consumer.row_limit.rows == 8 and consumer.row_limit.max_rows == 8
    assert "batches are limited to 8 rows" in caplog.text
    producer = Producer(redis_url, "q")
    inputs = [np.full((1, 4), i, np.float32) for i in range(32)]
    rids = producer.submit_many(inputs)
    drain(consumer)
    replies = producer.results(rids, timeout_s=5)
    assert all(r.ok for r in replies) and max(r.timing["batch_rows"] for r in replies) == 8
    for x, r in zip(inputs, replies):
        np.testing.assert_array_equal(r.outputs, x * 2)


def test_a_model_whose_smallest_warm_up_batch_runs_out_of_memory_fails_to_load(
    redis_url, monkeypatch
):
    from inferfleet.worker.errors import ModelLoadError

    monkeypatch.setenv("OOM_ROWS", "0")
    with pytest.raises(ModelLoadError, match="out of memory on a batch of 1 rows, the smallest"):
        make_consumer(redis_url, "tests.handlers:OutOfMemoryOverRows", max_batch_rows=32)


def test_dead_letter_commands(redis_url, redis_client, models_dir):
    import subprocess
    import sys

    from inferfleet.worker.serving.deadletter import dead_fields
    from tests.conftest import worker_env

    keys = QueueKeys("q")
    body = encode_body(np.ones((1, 16), np.float32))
    fields = {b"id": b"victim-1", b"body": body}
    redis_client.xadd(keys.dead, dead_fields(b"1-0", fields, "delivered 4 times", 4, "c9"))
    cli = [sys.executable, "-m", "inferfleet", "dead"]
    env = {**worker_env(redis_url), "COLUMNS": "200"}  # rich wraps tables to the terminal width
    listed = subprocess.run(
        [*cli, "list", "--name", "q"], env=env, capture_output=True, text=True, check=True
    )
    assert "victim-1" in listed.stdout and "delivered 4 times" in listed.stdout
    shown = subprocess.run(
        [*cli, "show", "--name", "q", "victim-1"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert '"deliveries": 4' in shown.stdout
    subprocess.run(
        [*cli, "replay", "--name", "q", "victim-1"], env=env, check=True, capture_output=True
    )
    assert redis_client.xlen(keys.dead) == 0
    consumer = make_consumer(redis_url, str(models_dir / "affine.pt"), idle_block_ms=50)
    drain(consumer)
    assert Producer(redis_url, "q").result("victim-1", timeout_s=5).ok  # replayed and answered
    redis_client.xadd(keys.dead, dead_fields(b"2-0", fields, "x", 4, "c9"))
    purged = subprocess.run(
        [*cli, "purge", "--name", "q", "--yes"], env=env, capture_output=True, text=True, check=True
    )
    assert "purged 1" in purged.stdout and redis_client.xlen(keys.dead) == 0
    missing = subprocess.run(
        [*cli, "show", "--name", "q", "nope"], env=env, capture_output=True, text=True
    )
    assert missing.returncode == 1 and "no dead letter" in missing.stderr


def test_read_ahead_answers_everything_once(redis_url, redis_client, models_dir):
    consumer = make_consumer(
        redis_url, str(models_dir / "cnn.pt"), idle_block_ms=50, max_batch_rows=8, prefetch="on"
    )
    assert consumer.prefetch
    producer = Producer(redis_url, "q")
    inputs = [
        np.random.default_rng(i).standard_normal((1, 3, 32, 32), dtype=np.float32)
        for i in range(50)
    ]
    rids = producer.submit_many(inputs)
    drain(consumer)
    assert consumer._prefetched == []
    model = torch.jit.load(str(models_dir / "cnn.pt"))
    for x, rid in zip(inputs, rids):
        assert redis_client.llen(affine_keys().reply(rid)) == 1
        with torch.no_grad():
            np.testing.assert_allclose(
                producer.result(rid, 5).outputs,
                model(torch.from_numpy(x)).numpy(),
                rtol=1e-4,
                atol=1e-5,
            )
    assert pending(redis_client, consumer.keys) == 0


def test_stopping_answers_what_was_read_ahead(redis_url, redis_client, models_dir):
    consumer = make_consumer(
        redis_url, str(models_dir / "affine.pt"), idle_block_ms=50, max_batch_rows=4, prefetch="on"
    )
    producer = Producer(redis_url, "q")
    rids = producer.submit_many([np.ones((1, 16), np.float32)] * 8)
    consumer.run_once()  # answers 4, reads the next 4 ahead
    assert len(consumer._prefetched) == 4
    stop = threading.Event()
    stop.set()
    consumer.run(stop)  # stops at once, but answers the read-ahead first
    assert all(r.ok for r in producer.results(rids, timeout_s=5))
    assert pending(redis_client, consumer.keys) == 0


def affine_keys() -> QueueKeys:
    return QueueKeys("q")


def test_reply_key_of_the_wrong_type_is_answered_on_the_default_key(
    affine_consumer, redis_url, redis_client
):
    keys = affine_consumer.keys
    inbox = keys.inbox("broken")
    redis_client.set(inbox, "not a list")
    producer = Producer(redis_url, "q")
    x = np.ones((1, 16), np.float32)
    before = producer.submit(x)
    broken = producer.submit(x, reply_to=inbox)
    after = producer.submit(x)
    drain(affine_consumer)
    assert producer.result(before, 5).ok and producer.result(after, 5).ok
    reply = producer.result(broken, 5, raise_errors=False)
    assert reply.error_code == "bad_request" and "not a list" in reply.error_message
    assert redis_client.get(inbox) == b"not a list"  # untouched
    assert pending(redis_client, keys) == 0


def test_replies_survive_a_script_flush(affine_consumer, redis_url, redis_client):
    """The reply script is loaded again when Redis forgot it (SCRIPT FLUSH, or a restart without
    AOF)."""
    producer = Producer(redis_url, "q")
    x = np.ones((1, 16), np.float32)
    first = producer.submit_many([x] * 3)
    drain(affine_consumer)
    redis_client.script_flush()
    assert redis_client.script_exists(affine_consumer.replies._script.sha) == [False]
    second = producer.submit_many([x] * 3)
    drain(affine_consumer)
    assert all(r.ok for r in producer.results(first + second, timeout_s=5))
    assert pending(redis_client, affine_consumer.keys) == 0


@pytest.mark.parametrize("limit", [2, 4])
def test_dead_letters_at_the_limit_and_not_one_delivery_before(
    redis_url, redis_client, models_dir, limit
):
    """--max-deliveries N: an entry delivered N-1 times is computed once more (its Nth delivery,
    still within the limit); one delivered N times is dead-lettered (its next would be the
    N+1th)."""
    from inferfleet.worker.serving.consumer import ensure_group
    from inferfleet.worker.serving.deadletter import list_dead

    keys = affine_keys()
    producer = Producer(redis_url, "q")
    x = np.ones((1, 16), np.float32)
    below, at = producer.submit(x), producer.submit(x)
    ensure_group(redis_client, keys.requests)
    ((_, entries),) = redis_client.xreadgroup(
        GROUP, "c1", {keys.requests: ">"}, count=2
    )  # then c1 "crashes"
    (below_id, _), (at_id, _) = entries
    redis_client.xclaim(
        keys.requests, GROUP, "c1", 0, [below_id], retrycount=limit - 1, justid=True
    )
    redis_client.xclaim(keys.requests, GROUP, "c1", 0, [at_id], retrycount=limit, justid=True)
    restarted = make_consumer(
        redis_url,
        str(models_dir / "affine.pt"),
        consumer="c1",
        idle_block_ms=50,
        max_deliveries=limit,
    )
    drain(restarted)  # replays c1's own pending entries, one at a time, counting a delivery each
    assert producer.result(below, 5).ok
    dead = producer.result(at, 5, raise_errors=False)
    assert dead.error_code == "dead_letter", dead
    assert f"delivery {limit + 1} is over the limit of {limit}" in dead.error_message
    (letter,) = list_dead(redis_client, keys)
    assert (letter.request_id, letter.deliveries) == (at, limit + 1)
    assert pending(redis_client, keys) == 0


def test_a_broken_device_stops_the_consumer_without_answering_or_acknowledging(
    redis_url, redis_client, monkeypatch
):
    """A sticky CUDA error: no bisection, no model_error replies, nothing acknowledged. The entries
    stay pending for the restarted worker (tests/integration/test_supervisor.py follows them
    there)."""
    from inferfleet.worker.errors import DeviceBroken
    from tests.handlers import BreaksDevice

    monkeypatch.setattr(BreaksDevice, "broken", False)
    monkeypatch.setattr(BreaksDevice, "calls", 0)
    consumer = make_consumer(
        redis_url,
        "tests.handlers:BreaksDevice",
        idle_block_ms=50,
        max_batch_rows=16,
        warmup_iters=0,
    )
    producer = Producer(redis_url, "q")
    inputs = [np.full((1, 4), POISON if i == 2 else i, np.float32) for i in range(4)]
    producer.submit_many(inputs)
    with pytest.raises(DeviceBroken, match="device-side assert"):
        consumer.run_once()
    assert BreaksDevice.calls == 1  # the failed batch was not retried in halves on a dead device
    assert (
        pending(redis_client, consumer.keys) == 4
    )  # nothing acknowledged: all four will be replayed
    assert consumer.counters.requests == 0 and consumer.counters.errors == 0  # and nothing answered
    assert not redis_client.keys("*inbox*")
