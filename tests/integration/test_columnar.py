"""The columnar fast path against a real redis-server: taken for the common case, same guarantees.

A consumer on the worker's own client (:func:`worker_client`, raw XREADGROUP
replies, as ``inferfleet worker`` runs) admits uniform reads as Columns,
computes them in one pass and answers them in one packed script call. These
tests check that path is taken, that its replies are what the general path
writes, and that its edge cases keep the contract: exactly one reply per
request when a batch is answered twice, a failing request isolated, a
non-finite output refused, a reply inbox that holds another type, the
script flushed from Redis.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import redis
import torch

from inferfleet.producer import Producer
from inferfleet.producer.protocol import GROUP, decode_reply, encode_body
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.connections import worker_client
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.compute import BatchComputer
from inferfleet.worker.serving.consumer import Consumer
from tests.handlers import POISON
from tests.helpers import drain, warmed


def consumer_on(redis_url: str, model: str, **overrides) -> Consumer:
    settings = WorkerSettings(
        name="q",
        model=model,
        redis_url=redis_url,
        consumer="c1",
        warmup_iters=1,
        **{"idle_block_ms": 50, **overrides},
    )
    consumer = Consumer(settings, load_runtime(settings), worker_client(redis_url))
    consumer.prepare()
    return consumer


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the batches each path computes."""
    calls = {"general": 0, "columnar": 0}
    general, columnar = BatchComputer.infer, BatchComputer.infer_columns

    def count_general(self, batch):
        calls["general"] += 1
        return general(self, batch)

    def count_columnar(self, cols):
        calls["columnar"] += 1
        return columnar(self, cols)

    monkeypatch.setattr(BatchComputer, "infer", count_general)
    monkeypatch.setattr(BatchComputer, "infer_columns", count_columnar)
    return calls


def test_sdk_requests_take_the_columnar_path_and_get_the_model_outputs(
    redis_url, redis_client, models_dir, paths
):
    consumer = consumer_on(redis_url, str(models_dir / "affine.pt"))
    producer = Producer(redis_url, "q")
    inputs = np.random.default_rng(0).standard_normal((300, 16), dtype=np.float32)
    warm = producer.submit(inputs[:1])  # the general path learns the body template and the intake
    drain(consumer)
    assert producer.result(warm, timeout_s=5).ok and paths == {"general": 1, "columnar": 0}
    rids = producer.submit_many(list(inputs[:, None, :]))
    drain(consumer)
    replies = producer.results(rids, timeout_s=10)
    model = torch.jit.load(str(models_dir / "affine.pt"))
    with torch.no_grad():
        want = model(torch.from_numpy(inputs)).numpy()
    for i, reply in enumerate(replies):
        assert reply.ok and reply.model_version == consumer.runtime.version
        np.testing.assert_allclose(reply.outputs, want[i : i + 1], rtol=1e-5, atol=1e-6)
        assert reply.timing["batch_rows"] >= 1 and reply.timing["queued_ms"] >= 0
    assert paths["columnar"] >= 1 and paths["general"] == 1
    assert int(redis_client.xpending(consumer.keys.requests, GROUP)["pending"]) == 0
    assert consumer.counters.requests == 301


def test_map_replies_to_the_inbox_through_the_columnar_path(redis_url, models_dir, paths):
    consumer = consumer_on(redis_url, str(models_dir / "affine.pt"))
    producer = Producer(redis_url, "q")
    inputs = [np.full((1, 16), i, np.float32) for i in range(200)]
    stop = threading.Event()
    worker = threading.Thread(target=consumer.run, args=(stop,))
    worker.start()
    try:
        replies = producer.map(inputs, timeout_s=30)
    finally:
        stop.set()
        worker.join(10)
    assert [r.ok for r in replies] == [True] * 200
    assert paths["columnar"] >= 1
    model = torch.jit.load(str(models_dir / "affine.pt"))
    with torch.no_grad():
        for x, reply in zip(inputs, replies):
            np.testing.assert_allclose(
                reply.outputs, model(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6
            )


def test_a_batch_answered_twice_is_replied_once(redis_url, redis_client, models_dir):
    """A slow worker whose entries were taken over and answered: its own replies are dropped."""
    consumer = consumer_on(redis_url, str(models_dir / "affine.pt"))
    keys = consumer.keys
    body = encode_body(np.ones((1, 16), np.float32))
    warmed(consumer, body)
    for i in range(20):
        redis_client.xadd(keys.requests, {"id": f"r{i}", "body": body})
    items = consumer._read(64, 0.0)
    consumer._answer(items)  # answered and acknowledged
    consumer._answer(items)  # again: every XACK finds the entry answered, every reply is taken back
    consumer.replies.settle()  # the call a round holds for the next read goes out now
    assert [redis_client.llen(keys.reply(f"r{i}")) for i in range(20)] == [1] * 20
    assert consumer.counters.skipped == 20


def answers_of(
    redis_url: str, redis_client: redis.Redis, handler: str, rows: list[np.ndarray]
) -> list:
    consumer = consumer_on(redis_url, handler)
    keys = consumer.keys
    warmed(consumer, encode_body(np.ones((1, 4), np.float32)))
    for i, x in enumerate(rows):
        redis_client.xadd(keys.requests, {"id": f"r{i}", "body": encode_body(x)})
    drain(consumer)
    return [decode_reply(redis_client.lpop(keys.reply(f"r{i}"))) for i in range(len(rows))]


def test_a_failing_request_is_isolated(redis_url, redis_client, paths):
    rows = [np.full((1, 4), v, np.float32) for v in (1.0, 2.0, POISON, 3.0, 4.0)]
    replies = answers_of(redis_url, redis_client, "tests.handlers:Scale", rows)
    assert [r.ok for r in replies] == [True, True, False, True, True]
    assert replies[2].error_code == "model_error" and "poison" in replies[2].error_message
    np.testing.assert_array_equal(replies[4].outputs, rows[4] * 2)
    assert (
        paths["columnar"] == 1
    )  # the read was one Columns batch; its failure went to the bisection


def test_a_non_finite_output_is_refused_alone(redis_url, redis_client):
    rows = [np.full((1, 4), v, np.float32) for v in (1.0, -1.0, 3.0)]
    replies = answers_of(redis_url, redis_client, "tests.handlers:NanOnNegative", rows)
    assert [r.ok for r in replies] == [True, False, True]
    assert replies[1].error_code == "model_error" and "NaN" in replies[1].error_message
    np.testing.assert_array_equal(replies[2].outputs, rows[2] * 2)


def test_an_inbox_holding_another_type_gets_bad_request_at_the_default_key(
    redis_url, redis_client, models_dir
):
    consumer = consumer_on(redis_url, str(models_dir / "affine.pt"))
    keys = consumer.keys
    body = encode_body(np.ones((1, 16), np.float32))
    inbox, broken = keys.inbox("good"), keys.inbox("broken")
    for key, rid in ((inbox, "warm1"), (broken, "warm2")):
        redis_client.xadd(keys.requests, {"id": rid, "body": body, "reply_to": key})
    drain(consumer)
    redis_client.delete(inbox, broken)
    redis_client.set(broken, "not a list")
    for i in range(6):
        redis_client.xadd(
            keys.requests, {"id": f"r{i}", "body": body, "reply_to": broken if i == 3 else inbox}
        )
    drain(consumer)
    assert redis_client.llen(inbox) == 5
    refused = decode_reply(redis_client.lpop(keys.reply("r3")))
    assert refused.error_code == "bad_request" and "not a list" in refused.error_message
    assert int(redis_client.xpending(keys.requests, GROUP)["pending"]) == 0


def test_the_packed_call_reloads_a_flushed_script(redis_url, redis_client, models_dir):
    consumer = consumer_on(redis_url, str(models_dir / "affine.pt"))
    keys = consumer.keys
    body = encode_body(np.ones((1, 16), np.float32))
    warmed(consumer, body)
    redis_client.script_flush()
    for i in range(5):
        redis_client.xadd(keys.requests, {"id": f"r{i}", "body": body})
    drain(consumer)
    assert all(decode_reply(redis_client.lpop(keys.reply(f"r{i}"))).ok for i in range(5))
    assert redis_client.ttl(keys.reply("warm")) > 0


def test_the_plain_redis_client_still_serves_through_the_general_path(redis_url, models_dir, paths):
    settings = WorkerSettings(
        name="q",
        model=str(models_dir / "affine.pt"),
        redis_url=redis_url,
        consumer="c2",
        warmup_iters=1,
        idle_block_ms=50,
    )
    consumer = Consumer(settings, load_runtime(settings), redis.Redis.from_url(redis_url))
    consumer.prepare()
    producer = Producer(redis_url, "q")
    rids = producer.submit_many([np.ones((1, 16), np.float32)] * 10)
    drain(consumer)
    assert all(r.ok for r in producer.results(rids, timeout_s=5))
    assert paths["columnar"] == 0 and paths["general"] >= 1


def test_columns_read_ahead_count_as_held_not_as_lost(
    redis_url, redis_client, models_dir, monkeypatch
):
    """Housekeeping compares the entries pending on us with those we hold: a Columns batch read
    ahead holds many. Counted as one, its entries would look lost and be replayed."""
    consumer = consumer_on(
        redis_url, str(models_dir / "affine.pt"), max_batch_rows=4, prefetch="on"
    )
    keys = consumer.keys
    body = encode_body(np.ones((1, 16), np.float32))
    warmed(consumer, body)
    for i in range(8):
        redis_client.xadd(keys.requests, {"id": f"r{i}", "body": body})
    monkeypatch.setattr(consumer.recovery, "housekeeping_due", lambda now: True)
    consumer.run_once()  # answers 4, reads the next 4 ahead as one Columns batch, then housekeeps
    assert [len(item) for item in consumer._prefetched] == [4]
    assert int(redis_client.xpending(keys.requests, GROUP)["pending"]) == 4
    assert not consumer.recovery.replay_own
    drain(consumer)
    assert [redis_client.llen(keys.reply(f"r{i}")) for i in range(8)] == [1] * 8


@pytest.mark.parametrize(
    "read",
    [
        ["ab\ncd"],  # alone
        ["r0", "ab\ncd", "r1"],  # among valid ids
        ["r0", "ab\ncd", "\n", "r1"],  # beside another invalid id
    ],
)
def test_an_id_with_a_newline_is_refused_whatever_else_is_in_its_read(
    redis_url, redis_client, models_dir, read
):
    """Such an id is no request id: acknowledged, never answered, while its batch-mates are."""
    consumer = consumer_on(redis_url, str(models_dir / "affine.pt"))
    keys = consumer.keys
    body = encode_body(np.ones((1, 16), np.float32))
    redis_client.xadd(keys.requests, {"id": "warm", "body": body})
    drain(consumer)  # the general path learns the body template: the next read is columnar
    for rid in read:
        redis_client.xadd(keys.requests, {"id": rid, "body": body})
    drain(consumer)
    consumer.replies.settle()
    valid = [rid for rid in read if "\n" not in rid]
    replies = [decode_reply(redis_client.lpop(keys.reply(rid))) for rid in valid]
    assert [reply.ok for reply in replies] == [True] * len(valid)
    written = set(redis_client.scan_iter(match=keys.reply("*")))
    assert written == {keys.reply("warm").encode()}
    assert redis_client.xpending(keys.requests, GROUP)["pending"] == 0
