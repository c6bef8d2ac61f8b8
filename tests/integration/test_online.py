"""Many concurrent callers on one producer, against a real worker and a real redis-server.

Every input differs, so a reply handed to the wrong call shows: each output is
checked against the model's direct forward pass of that call's own input.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from inferfleet.producer import AsyncProducer, Producer, errors
from inferfleet.producer.protocol import decode_body, encode_reply_ok, parse_entry

pytestmark = pytest.mark.timeout(300)


def inputs(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(count)]


@pytest.fixture
def served(spawn_worker, models_dir: Path, redis_url: str) -> str:
    """A queue served by one real worker of the affine model."""
    name = f"online-{os.urandom(3).hex()}"
    spawn_worker(name, str(models_dir / "affine.pt"), "--max-wait-ms", "1")
    return name


def test_threads_calling_infer_on_one_producer_each_get_their_own_outputs(
    served: str, redis_url: str, affine
) -> None:
    """16 threads x 60 infer calls on one Producer: every output is its own input's."""
    producer = Producer(redis_url, served)
    wrong: list[int] = []

    def call(thread: int) -> None:
        for x in inputs(thread, 60):
            if not np.allclose(producer.infer(x, timeout_s=60), affine(x), atol=1e-5):
                wrong.append(thread)

    threads = [threading.Thread(target=call, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    assert wrong == [] and not any(t.is_alive() for t in threads)
    assert producer._replies.waiting == 0 and producer._replies.dropped == 0
    producer.close()


def test_two_threads_running_map_on_one_producer_both_get_every_reply(
    served: str, redis_url: str, affine
) -> None:
    producer = Producer(redis_url, served)
    results: dict[int, list] = {}

    def run(seed: int) -> None:
        results[seed] = producer.map(inputs(seed, 2000), timeout_s=60, window=500)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    for seed in (1, 2):
        xs = inputs(seed, 2000)
        assert len(results[seed]) == 2000 and all(r.ok for r in results[seed])
        outputs = np.concatenate([r.outputs for r in results[seed]])
        assert np.allclose(outputs, affine(np.concatenate(xs)), atol=1e-5)
    producer.close()


def _child(producer: Producer, seed: int, expected: np.ndarray, out: Path) -> None:
    """In a forked child: imap and infer on the parent's producer; write what it saw."""
    xs = inputs(seed, 500)
    replies = list(producer.imap(xs, timeout_s=60, window=100, ordered=True))
    outputs = np.concatenate([r.outputs for r in replies])
    singles = [producer.infer(x, timeout_s=60) for x in xs[:20]]
    out.write_text(
        json.dumps(
            {
                "inbox": producer.inbox,
                "rid": producer.new_request_id(),
                "imap_ok": bool(np.allclose(outputs, expected, atol=1e-5)),
                "infer_ok": bool(np.allclose(np.concatenate(singles), expected[:20], atol=1e-5)),
            }
        )
    )


def test_forked_children_of_one_producer_never_see_each_others_replies(
    served: str, redis_url: str, affine, tmp_path: Path
) -> None:
    """A Producer used before fork() (gunicorn --preload): 4 children each run imap and infer on
    it at once; each gets its own outputs, under an inbox and ids of its own."""
    producer = Producer(redis_url, served)
    assert np.allclose(producer.infer(inputs(99, 1)[0]), affine(inputs(99, 1)[0]), atol=1e-5)
    expected = {seed: affine(np.concatenate(inputs(seed, 500))) for seed in range(4)}
    pids = []
    for seed in range(4):
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                _child(producer, seed, expected[seed], tmp_path / f"{seed}.json")
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitpid(pid, 0)[1] for pid in pids]
    assert codes == [0] * 4
    seen = [json.loads((tmp_path / f"{seed}.json").read_text()) for seed in range(4)]
    assert all(s["imap_ok"] and s["infer_ok"] for s in seen)
    inboxes = {s["inbox"] for s in seen} | {producer.inbox}
    bases = {s["rid"].split("-")[0] for s in seen} | {producer.new_request_id().split("-")[0]}
    assert len(inboxes) == 5 and len(bases) == 5
    producer.close()


def test_hundreds_of_tasks_share_one_async_producer_and_a_cancelled_one_harms_none(
    served: str, redis_url: str, affine
) -> None:
    xs = inputs(7, 400)

    async def main() -> tuple[list, int]:
        producer = AsyncProducer(redis_url, served)
        tasks = [asyncio.ensure_future(producer.infer(x, timeout_s=60)) for x in xs]
        await asyncio.sleep(0)
        for task in tasks[::10]:
            task.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        again = await producer.infer(xs[0], timeout_s=60)  # the reader still serves
        left = producer._replies.waiting
        await producer.close()
        return [*done, again], left

    done, left = asyncio.run(main())
    for i, (x, got) in enumerate(zip([*xs, xs[0]], done)):
        if i % 10 == 0 and i < len(xs):
            assert isinstance(got, asyncio.CancelledError)
        else:
            assert np.allclose(got, affine(x), atol=1e-5), i
    assert left == 0


def test_a_call_without_a_reply_times_out_and_leaves_nothing_waiting(redis_url: str) -> None:
    producer = Producer(redis_url, f"nobody-{os.urandom(3).hex()}")
    with pytest.raises(errors.ReplyTimeout, match="no worker has ever served"):
        producer.infer(np.zeros((1, 16), np.float32), timeout_s=0.3)
    assert producer._replies.waiting == 0
    producer.close()


def _answer(client: redis.Redis, stream: str, rid: str, factor: float) -> None:
    """Answer request ``rid`` of ``stream`` by hand, as a worker would: inputs * ``factor``."""
    for _, fields in client.xrange(stream):
        env = parse_entry(fields)
        if env.rid == rid:
            reply = encode_reply_ok(rid, decode_body(env.body)[0] * factor, ("q", "1"), {})
            client.rpush(env.reply_to, reply)
            return
    raise AssertionError(f"no request {rid} in {stream}")


def test_two_threads_answered_at_different_times_each_get_their_own(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """Two threads' infer calls, answered by hand one after the other (the second after the
    reader's blocked read has ended and begun again): each gets its own reply."""
    name = f"hand-{os.urandom(3).hex()}"
    producer = Producer(redis_url, name)
    stream = producer.lanes[0][1]
    got: dict[int, np.ndarray] = {}

    def call(i: int) -> None:
        got[i] = producer.infer(np.full((1, 4), i, np.float32), timeout_s=30)

    threads = [threading.Thread(target=call, args=(i,)) for i in (1, 2)]
    for thread in threads:
        thread.start()
    while producer._replies.waiting < 2 or redis_client.xlen(stream) < 2:
        time.sleep(0.01)
    rids = {
        int(decode_body(parse_entry(f).body)[0][0, 0]): parse_entry(f).rid
        for _, f in redis_client.xrange(stream)
    }
    for first in (1, 2):  # answer one, let it return, then the other
        _answer(redis_client, stream, rids[first], 10.0)
        threads[first - 1].join(10)
        assert not threads[first - 1].is_alive()
        time.sleep(1.2)  # past the reader's 1 s BLPOP: the one left is read for by a new one
    assert {i: float(out[0, 0]) for i, out in got.items()} == {1: 10.0, 2: 20.0}
    assert producer._replies.waiting == 0
    producer.close()


@pytest.mark.parametrize("answer_after_s", [0.1, 1.3], ids=["in-its-read", "after-its-read"])
@pytest.mark.parametrize("cancelled", [1, 2])
def test_cancelling_one_task_s_infer_loses_no_other_reply(
    redis_url: str, redis_client: redis.Redis, cancelled: int, answer_after_s: float
) -> None:
    """Two tasks' infer calls, one cancelled mid-wait: the other still gets its own reply,
    answered by hand after the cancellation, while the reader's read still blocks or once it
    has ended (up to 1 s) and a new one began."""
    name = f"ahand-{os.urandom(3).hex()}"

    async def main() -> float:
        producer = AsyncProducer(redis_url, name)
        stream = producer.lanes[0][1]
        tasks = {
            i: asyncio.create_task(producer.infer(np.full((1, 4), i, np.float32), timeout_s=30))
            for i in (1, 2)
        }
        while producer._replies.waiting < 2 or redis_client.xlen(stream) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # one of them blocks in the inbox's BLPOP now
        tasks[cancelled].cancel()
        await asyncio.sleep(answer_after_s)
        kept = 3 - cancelled
        for _, fields in redis_client.xrange(stream):
            if decode_body(parse_entry(fields).body)[0][0, 0] == kept:
                _answer(redis_client, stream, parse_entry(fields).rid, 10.0)
        out = await asyncio.wait_for(tasks[kept], 10)
        with pytest.raises(asyncio.CancelledError):
            await tasks[cancelled]
        assert producer._replies.waiting == 0
        await producer.close()
        return float(out[0, 0])

    assert asyncio.run(main()) == 10.0 * (3 - cancelled)


def _reader_connection(client: redis.Redis, name: str, timeout_s: float = 10) -> int:
    """The id of the connection named ``name`` blocked in BLPOP (other tests share the server)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for one in client.client_list():
            if one.get("cmd") == "blpop" and one.get("name") == name:
                return int(one["id"])
        time.sleep(0.01)
    raise AssertionError(f"no connection named {name} blocked in BLPOP")


def test_a_dropped_reader_connection_ends_every_wait_with_what_was_lost(
    redis_url: str, redis_client: redis.Redis
) -> None:
    name = f"unserved-{os.urandom(3).hex()}"
    producer = Producer(f"{redis_url}?client_name={name}", name)
    failures: list[BaseException] = []

    def call() -> None:
        try:
            producer.infer(np.zeros((1, 16), np.float32), timeout_s=60)
        except errors.InferfleetError as exc:
            failures.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    while producer._replies.waiting < 3:
        time.sleep(0.01)
    redis_client.client_kill_filter(_id=_reader_connection(redis_client, name))
    for thread in threads:
        thread.join(30)
    assert len(failures) == 3
    assert all(isinstance(f, errors.ConnectionError) and "lost" in str(f) for f in failures)
    assert producer._replies.waiting == 0
    producer.close()


def test_a_full_redis_is_queue_full_on_every_sending_path(
    redis_url: str, redis_client: redis.Redis
) -> None:
    """At maxmemory (noeviction) every call that sends raises QueueFull, and nothing is sent."""
    name = f"full-{os.urandom(3).hex()}"
    x = np.zeros((1, 16), np.float32)
    producer = Producer(redis_url, name)
    used = int(redis_client.info("memory")["used_memory"])
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", used // 2)
    try:
        for send in (
            lambda: producer.submit(x),
            lambda: producer.infer(x, timeout_s=5),
            lambda: producer.submit_many([x, x]),
            lambda: producer.map([x, x], timeout_s=5),
            lambda: list(producer.imap([x], timeout_s=5)),
        ):
            with pytest.raises(errors.QueueFull, match="out of memory"):
                send()

        async def sends() -> int:
            aproducer = AsyncProducer(redis_url, name)
            refused = 0
            for send in (
                lambda: aproducer.submit(x),
                lambda: aproducer.infer(x, timeout_s=5),
                lambda: aproducer.submit_many([x]),
                lambda: aproducer.map([x], timeout_s=5),
            ):
                with pytest.raises(errors.QueueFull, match="out of memory"):
                    await send()
                refused += 1
            await aproducer.close()
            return refused

        assert asyncio.run(sends()) == 4
    finally:
        redis_client.config_set("maxmemory", 0)
    assert redis_client.xlen(producer.lanes[0][1]) == 0  # nothing was enqueued
    assert producer._replies.waiting == 0
    producer.close()
