"""The fast path's reply call held for the next read (worker/serving/behind.py), on a real
redis-server.

``Consumer.run`` lets a Columns round's EVALSHA go out in the same write as
the next read. These tests check that the loop really does so, that a held
call never waits on an idle queue, that a held call lost with its connection
still ends in exactly one reply per request, and that a script Redis lost
while the call was out is loaded and sent again.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import redis
import torch

from inferfleet.producer import Producer
from inferfleet.producer.protocol import GROUP, decode_reply, encode_body
from inferfleet.worker.serving.behind import BehindRead
from inferfleet.worker.serving.replies import ReplyWriter
from tests.helpers import wait_until, warmed
from tests.integration.test_columnar import consumer_on

BODY = encode_body(np.ones((1, 16), np.float32))


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the reads that carried a held reply call."""
    calls: list[int] = []
    send_with = BehindRead.send_with

    def counted(self, before, answers):
        calls.append(answers)
        return send_with(self, before, answers)

    monkeypatch.setattr(BehindRead, "send_with", counted)
    return calls


def serve(consumer):
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def test_the_loop_sends_replies_behind_reads(redis_url, redis_client, models_dir, sends):
    consumer = consumer_on(redis_url, str(models_dir / "affine.pt"), max_batch_rows=16)
    inputs = [np.full((1, 16), i, np.float32) for i in range(400)]
    stop, thread = serve(consumer)
    try:
        with Producer(redis_url, "q") as producer:
            replies = producer.map(inputs, timeout_s=30)
    finally:
        stop.set()
        thread.join(10)
    assert [r.ok for r in replies] == [True] * 400
    model = torch.jit.load(str(models_dir / "affine.pt"))
    with torch.no_grad():
        for x, reply in zip(inputs, replies):
            np.testing.assert_allclose(
                reply.outputs, model(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6
            )
    assert len(sends) >= 5, "rounds under load send their replies with the next read"
    assert int(redis_client.xpending(consumer.keys.requests, GROUP)["pending"]) == 0


def test_a_held_call_never_waits_for_new_entries(redis_url, redis_client, models_dir, monkeypatch):
    """The loop blocks 5 s on an idle queue: a lone request's reply must not wait for that block to
    end, and neither must the script's answer (the round's counts, an error) be left unread.

    Checked on state, not on time: each time the loop starts a blocking read, what every earlier
    lone request left must be done (acknowledged, its reply written, the script's answer read)."""
    settled: list[int] = []
    columns_done = ReplyWriter._columns_done

    def counted(self, cols, pushed, failed):
        settled.append(pushed)
        return columns_done(self, cols, pushed, failed)

    monkeypatch.setattr(ReplyWriter, "_columns_done", counted)
    consumer = warmed(
        consumer_on(redis_url, str(models_dir / "affine.pt"), idle_block_ms=5000), BODY
    )
    assert consumer.replies.behind is not None
    keys = consumer.keys
    observer = redis.Redis.from_url(redis_url)  # the loop thread's own view, at each idle read
    idle_reads: list[tuple[int, int, int]] = []  # (pending, answers settled, lone replies)
    read = consumer.lanes.read

    def blocking_read(client, name, count, block):
        if block:
            lone = observer.exists(*(keys.reply(f"lone{i}") for i in range(3)))
            pending = int(observer.xpending(keys.requests, GROUP)["pending"])
            idle_reads.append((pending, len(settled), lone))
        return read(client, name, count, block)

    monkeypatch.setattr(consumer.lanes, "read", blocking_read)
    stop, thread = serve(consumer)
    try:
        for i in range(3):
            wait_until(lambda: idle_reads, 30, "the loop to block in its idle read")
            redis_client.xadd(keys.requests, {"id": f"lone{i}", "body": BODY})
            wait_until(
                lambda: idle_reads[-1][2] == i + 1, 30, f"an idle read after lone{i}'s reply"
            )
    finally:
        stop.set()
        thread.join(10)
        observer.close()
    assert set(idle_reads) >= {(0, k, k) for k in range(4)}, idle_reads
    assert all(state == (0, state[1], state[1]) for state in idle_reads), (
        "the loop blocked with a reply held or the script's answer unread",
        idle_reads,
    )
    assert settled == [1, 1, 1]
    for i in range(3):
        assert decode_reply(redis_client.lpop(keys.reply(f"lone{i}"))).ok


def test_a_held_call_lost_with_its_connection_is_answered_once(redis_url, redis_client, models_dir):
    consumer = warmed(consumer_on(redis_url, str(models_dir / "affine.pt")), BODY)
    keys = consumer.keys
    for i in range(30):
        redis_client.xadd(keys.requests, {"id": f"a{i}", "body": BODY})
    assert consumer._round() == 30  # answered, the call held
    assert redis_client.exists(keys.reply("a0")) == 0
    for i in range(30):
        redis_client.xadd(keys.requests, {"id": f"b{i}", "body": BODY})
    assert consumer._round() == 30  # a's call went out behind b's read; b's is held
    redis_client.client_kill_filter(
        _type="normal", skipme=True
    )  # the worker's connections, mid-flight
    stop, thread = serve(consumer)
    try:
        wait_until(
            lambda: int(redis_client.xpending(keys.requests, GROUP)["pending"]) == 0,
            20,
            "the lost call's entries to be answered",
        )
    finally:
        stop.set()
        thread.join(10)
    lengths = [redis_client.llen(keys.reply(f"{p}{i}")) for p in "ab" for i in range(30)]
    assert lengths == [1] * 60
    assert int(redis_client.xpending(keys.requests, GROUP)["pending"]) == 0


def test_a_script_lost_while_the_call_was_out_is_sent_again(redis_url, redis_client, models_dir):
    consumer = warmed(consumer_on(redis_url, str(models_dir / "affine.pt")), BODY)
    keys = consumer.keys
    for i in range(10):
        redis_client.xadd(keys.requests, {"id": f"a{i}", "body": BODY})
    assert consumer._round() == 10
    assert redis_client.exists(keys.reply("a0")) == 0  # held
    redis_client.script_flush()  # the held call will find no script
    redis_client.xadd(keys.requests, {"id": "b0", "body": BODY})
    consumer._round()  # a's call out behind the read (NOSCRIPT), loaded and sent again when settled
    consumer.replies.settle()
    assert [redis_client.llen(keys.reply(f"a{i}")) for i in range(10)] == [1] * 10
    assert redis_client.llen(keys.reply("b0")) == 1
    assert int(redis_client.xpending(keys.requests, GROUP)["pending"]) == 0


def test_run_once_writes_its_replies_before_returning(redis_url, redis_client, models_dir):
    consumer = consumer_on(redis_url, str(models_dir / "affine.pt"))
    for i in range(5):
        redis_client.xadd(consumer.keys.requests, {"id": f"r{i}", "body": BODY})
    assert consumer.run_once() == 5
    assert [redis_client.llen(consumer.keys.reply(f"r{i}")) for i in range(5)] == [1] * 5


def test_a_prefetching_consumer_holds_nothing(redis_url, models_dir):
    """The read-ahead thread reads while the main thread writes: no call may be held between
    them."""
    assert (
        consumer_on(redis_url, str(models_dir / "affine.pt"), prefetch="on").replies.behind is None
    )


def test_behind_read_reports_a_sent_call_once_and_closes_a_dropped_ones_connection(
    redis_url, redis_client
):
    client = redis.Redis.from_url(redis_url)
    done: list = []  # each held call's answer, as Redis gave it
    behind = BehindRead(
        client, lambda packed: client.execute_command("EVAL", "return {1, {}}", 0), lambda: None
    )
    behind.hold(
        b"*3\r\n$4\r\nEVAL\r\n$14\r\nreturn {2, {}}\r\n$1\r\n0\r\n",
        done.append,
    )
    assert behind.unsent
    (pong,) = behind.send_with(b"*1\r\n$4\r\nPING\r\n", 1)
    assert pong in (b"PONG", "PONG", True) and not behind.unsent
    behind.settle()
    assert done == [[2, []]]
    behind.hold(
        b"*3\r\n$4\r\nEVAL\r\n$14\r\nreturn {3, {}}\r\n$1\r\n0\r\n",
        done.append,
    )
    behind.send_with(b"*1\r\n$4\r\nPING\r\n", 1)
    conn = behind._held.conn
    behind.drop()
    assert conn._sock is None, (
        "its answer is still on the way: the connection must not be read again"
    )
    behind.settle()  # nothing held any more
    assert done == [[2, []]]
    client.close()


def test_a_held_call_refused_by_a_full_redis_leaves_its_entries_pending(
    redis_url, redis_client, models_dir
):
    """maxmemory (noeviction) below what Redis holds: the held script is refused when it goes out,
    nothing of it is acknowledged, and the replay answers every entry once Redis has room."""
    consumer = warmed(consumer_on(redis_url, str(models_dir / "affine.pt")), BODY)
    keys = consumer.keys
    for i in range(10):
        redis_client.xadd(keys.requests, {"id": f"a{i}", "body": BODY})
    assert consumer._round() == 10  # held
    used = int(redis_client.info("memory")["used_memory"])
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", used // 2)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            consumer.replies.settle()
        assert int(redis_client.xpending(keys.requests, GROUP)["pending"]) == 10
        assert redis_client.exists(*(keys.reply(f"a{i}") for i in range(10))) == 0
    finally:
        redis_client.config_set("maxmemory", 0)
    consumer.work.replay_own()  # what the loop does after an outage: its own pending entries again
    assert sum(consumer.run_once() for _ in range(20)) == 10
    assert [redis_client.llen(keys.reply(f"a{i}")) for i in range(10)] == [1] * 10
    assert int(redis_client.xpending(keys.requests, GROUP)["pending"]) == 0
