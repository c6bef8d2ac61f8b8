"""A generative model on the fleet (issue 34): real workers serving the example TinyLM, real
Redis, the SDK's streams. Every stream is checked against the model's own greedy output
recomputed without a cache (``TinyLM.reference_generate``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import redis
import torch

from inferfleet.producer import AsyncProducer, Producer, errors
from inferfleet.producer.protocol import encode_body, parse_chunk
from inferfleet.worker.connections import script
from tests.conftest import ROOT, worker_env
from tests.fixtures.tiny_lm import TinyLM, encode
from tests.helpers import wait_until

NAME = "tokens"
MODEL = "tests.fixtures.tiny_lm:TinyLM"
SLOW = "tests.handlers:SlowTinyLM"  # 4 slots, 20 ms a step
ENDLESS = "tests.handlers:EndlessTinyLM"  # the same, never making its end token
PROMPTS = ["docker compose", "inferfleet worker --name", "Redis", "the queue's lag", "P99", "a"]
#: A worker that dies is noticed within a second or two: short heartbeats and claims.
FAST_TAKEOVER = ("--heartbeat-s", "0.5", "--housekeeping-s", "0.5", "--claim-idle-s", "1")


@pytest.fixture(scope="module")
def reference(tinylm):
    """The model's direct greedy output for a prompt: what every stream must equal."""
    model = TinyLM(path=tinylm)
    model.setup(torch.device("cpu"))
    return lambda prompt, new: [int(t) for t in model.reference_generate(encode(prompt), new)]


def _chunks(client: redis.Redis, rid: str) -> list:
    return [parse_chunk(i, f) for i, f in client.xrange(f"inferfleet:{{{NAME}}}:chunks:{rid}")]


def test_concurrent_streams_and_plain_requests_equal_the_model_token_for_token(
    spawn_worker, redis_url, redis_client, reference
):
    """More requests than slots (4), mixed lengths, streamed and not: continuous batching
    changes no token, every stream is numbered 0.. with its final chunk last and a TTL."""
    spawn_worker(NAME, SLOW)
    lengths = [5, 40, 12, 60, 3, 25]
    with Producer(redis_url, NAME) as producer:
        streams = [producer.stream(p, {"max_new_tokens": n}) for p, n in zip(PROMPTS, lengths)]
        plain = producer.submit(PROMPTS[1], {"max_new_tokens": 40})
        for stream, prompt, n in zip(streams, PROMPTS, lengths):
            assert [int(t) for t in stream.tokens()] == reference(prompt, n)
        reply = producer.result(plain, 30)
        assert [int(t) for t in reply.outputs] == reference(PROMPTS[1], 40)
    for stream, prompt, n in zip(streams, PROMPTS, lengths):
        chunks = _chunks(redis_client, stream.request_id)
        assert [c.n for c in chunks] == list(range(len(chunks)))
        assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert {c.attempt for c in chunks} == {1}
        expected = "stop" if len(reference(prompt, n)) < n else "length"
        assert chunks[-1].finish_reason == expected
        assert 0 < redis_client.pttl(f"inferfleet:{{{NAME}}}:chunks:{stream.request_id}") <= 300_000
    # a plain request leaves no stream behind
    assert not redis_client.exists(f"inferfleet:{{{NAME}}}:chunks:{plain}")


def test_the_async_producer_streams_the_same_tokens(spawn_worker, redis_url, reference):
    spawn_worker(NAME, MODEL)

    async def run() -> list[list[int]]:
        async with AsyncProducer(redis_url, NAME) as producer:
            streams = [await producer.stream(p, {"max_new_tokens": 30}) for p in PROMPTS[:3]]
            return [[int(t) for t in await s.tokens()] for s in streams]

    assert asyncio.run(run()) == [reference(p, 30) for p in PROMPTS[:3]]


def test_a_reader_that_comes_back_resumes_after_the_last_chunk_it_saw(
    spawn_worker, redis_url, reference
):
    spawn_worker(NAME, MODEL)
    with Producer(redis_url, NAME) as producer:
        stream = producer.stream(PROMPTS[0], {"max_new_tokens": 30})
        first = [next(stream) for _ in range(3)]
        again = producer.read_stream(stream.request_id, after=first[-1].entry_id)
        rest = list(again)
    assert rest[0].n == 3 and rest[-1].final
    tokens = [int(t) for c in first + rest for t in c.tokens]
    assert tokens == reference(PROMPTS[0], 30)


def test_cancel_ends_a_live_stream_at_its_next_step_and_frees_its_slot(
    spawn_worker, redis_url, redis_client, reference
):
    spawn_worker(NAME, ENDLESS)
    with Producer(redis_url, NAME) as producer:
        stream = producer.stream("a", {"max_new_tokens": 200, "temperature": 1.0, "seed": 3})
        next(stream)
        assert producer.cancel(stream.request_id) == "cancelled"
        with pytest.raises(errors.Cancelled):
            list(stream)
        chunks = _chunks(redis_client, stream.request_id)
        assert chunks[-1].final and chunks[-1].reply.error_code == "cancelled"
        assert len(chunks) < 150  # stopped, not run to its end
        # the slot is free again: a new request is served in full
        again = producer.stream(PROMPTS[0], {"max_new_tokens": 20})
        assert [int(t) for t in again.tokens()] == reference(PROMPTS[0], 20)


def test_a_deadline_ends_a_live_stream_with_expired(spawn_worker, redis_url, redis_client):
    spawn_worker(NAME, ENDLESS)
    with Producer(redis_url, NAME) as producer:
        stream = producer.stream("a", {"max_new_tokens": 200, "temperature": 1.0}, deadline_s=1.0)
        with pytest.raises(errors.Expired):
            list(stream)
    chunks = _chunks(redis_client, stream.request_id)
    assert chunks[-1].reply.error_code == "expired" and len(chunks) > 1
    # the model never ends a sequence itself: fewer than 200 tokens is the deadline's doing
    assert sum(len(c.tokens) for c in chunks) < 200


def test_bad_prompts_and_params_end_their_stream_with_bad_request(spawn_worker, redis_url):
    spawn_worker(NAME, MODEL)
    with Producer(redis_url, NAME) as producer:
        for inputs, params, said in [
            (np.zeros((2, 3), np.float32), {}, "one row of integer token ids"),
            ("x", {"max_new_tokens": 0}, "max_new_tokens"),
            ("x", {"beam": 4}, "unknown generation params"),
            (np.array([300], np.int64), {}, "token ids must be 0 to 256"),
        ]:
            with pytest.raises(errors.BadRequest, match=said):
                list(producer.stream(inputs, params))
        # the worker lives on
        assert len(producer.stream("x", {"max_new_tokens": 4}).tokens()) == 4


def test_a_stream_on_the_high_lane_is_served(spawn_worker, redis_url, reference):
    spawn_worker(NAME, MODEL)
    with Producer(redis_url, NAME) as producer:
        stream = producer.stream(PROMPTS[2], {"max_new_tokens": 16}, priority="high")
        assert [int(t) for t in stream.tokens()] == reference(PROMPTS[2], 16)


def test_a_worker_killed_mid_generation_is_taken_over_and_its_stream_goes_on(
    spawn_worker, redis_url, redis_client, reference
):
    """SIGKILL the worker generating: another takes the request over, reads the chunks sent,
    continues numbering under attempt 2; the whole stream still equals the model's output."""
    first = spawn_worker(NAME, SLOW, *FAST_TAKEOVER, consumer="gen-a")
    with Producer(redis_url, NAME) as producer:
        stream = producer.stream(PROMPTS[0], {"max_new_tokens": 150})
        seen = [next(stream) for _ in range(10)]
        os.kill(first.pid, signal.SIGKILL)
        spawn_worker(NAME, SLOW, *FAST_TAKEOVER, consumer="gen-b")
        rest = list(stream)
    chunks = seen + rest
    assert [c.n for c in chunks] == list(range(len(chunks)))
    attempts = [c.attempt for c in chunks]
    assert attempts[0] == 1 and attempts[-1] == 2 and attempts == sorted(attempts)
    tokens = [int(t) for c in chunks for t in c.tokens]
    assert tokens == reference(PROMPTS[0], 150)
    stored = _chunks(redis_client, stream.request_id)
    assert [c.n for c in stored] == list(range(len(stored)))  # no number written twice
    requests = f"inferfleet:{{{NAME}}}:requests"
    wait_until(lambda: not redis_client.xpending(requests, "workers")["pending"], 10, "the XACK")


def _script_round(client: redis.Redis, items: list[tuple], rids: tuple[str, ...] = ()) -> list:
    """One call of worker/lua/chunks.lua as the worker makes it: (kind, key, entry id, n,
    attempt, body) per item; its (refused indexes, cancel marks)."""
    keys, args = [f"inferfleet:{{{NAME}}}:cancels"], ["workers", 300_000, len(items)]
    for kind, key, entry_id, n, attempt, body in items:
        keys += [key, f"inferfleet:{{{NAME}}}:requests"]
        args += [kind, entry_id, n, attempt, body]
    return script(client, "chunks")(keys=keys, args=[*args, *rids])


def test_the_chunk_script_writes_only_its_streams_next_chunk(redis_client):
    """The fence behind "never two chunks of one number": a chunk out of turn, one of an
    older attempt after a newer one, one after the final one, or to a key of another type,
    is refused and nothing is written; a final chunk acknowledges its entry exactly once."""
    requests = f"inferfleet:{{{NAME}}}:requests"
    redis_client.xgroup_create(requests, "workers", id="0", mkstream=True)
    entry = redis_client.xadd(requests, {"id": "r1", "body": b"x", "stream": "1"})
    redis_client.xreadgroup("workers", "w", {requests: ">"})
    key = f"inferfleet:{{{NAME}}}:chunks:r1"
    assert _script_round(redis_client, [("c", key, entry, 1, 1, b"a")]) == [[1], []]
    assert _script_round(redis_client, [("c", key, entry, 0, 2, b"a")]) == [[], []]
    assert _script_round(redis_client, [("c", key, entry, 1, 1, b"b")]) == [[1], []]  # older
    assert _script_round(redis_client, [("c", key, entry, 1, 2, b"b")]) == [[], []]
    assert _script_round(redis_client, [("f", key, entry, 2, 2, b"c")]) == [[], []]
    assert redis_client.xpending(requests, "workers")["pending"] == 0
    assert _script_round(redis_client, [("c", key, entry, 3, 2, b"d")]) == [[1], []]  # final
    stored = redis_client.xrange(key)
    assert [(f[b"n"], f[b"attempt"], f[b"body"]) for _, f in stored] == [
        (b"0", b"2", b"a"),
        (b"1", b"2", b"b"),
        (b"2", b"2", b"c"),
    ]
    assert 0 < redis_client.pttl(key) <= 300_000
    other = redis_client.xadd(requests, {"id": "r2", "body": b"x", "stream": "1"})
    redis_client.xreadgroup("workers", "w", {requests: ">"})
    redis_client.rpush(f"inferfleet:{{{NAME}}}:chunks:r2", b"a client's list")
    wrong = [("f", f"inferfleet:{{{NAME}}}:chunks:r2", other, 0, 1, b"e")]
    assert _script_round(redis_client, wrong) == [[1], []]
    assert redis_client.xpending(requests, "workers")["pending"] == 0  # not retried forever


def test_a_prompt_longer_than_the_model_holds_is_a_bad_request(spawn_worker, redis_url):
    spawn_worker(NAME, MODEL)
    with Producer(redis_url, NAME) as producer:
        with pytest.raises(errors.BadRequest, match="a prompt holds 1 to 255 tokens"):
            producer.infer("x" * 300)
        with pytest.raises(errors.BadRequest, match="a prompt holds 1 to 255 tokens"):
            list(producer.stream("x" * 300))
        assert len(producer.infer("x", {"max_new_tokens": 3})) <= 3  # the worker lives on


def test_enqueue_stream_answers_bad_use_with_a_usage_error_and_a_failed_stream_with_status_1(
    spawn_worker, redis_url
):
    spawn_worker(NAME, MODEL)

    def enqueue(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "inferfleet", "enqueue", "--name", NAME, *args],
            env=worker_env(redis_url),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    neither = enqueue("--stream")
    assert neither.returncode == 2 and "give one of --input FILE or --text TEXT" in neither.stderr
    alone = enqueue("--text", "x", "--as-text")
    assert alone.returncode == 2 and "--as-text goes with --stream" in alone.stderr
    failed = enqueue("--text", "x", "--param", "top_k=-1", "--stream")
    assert failed.returncode == 1
    said = json.loads(failed.stdout.splitlines()[-1])
    assert said["error"]["code"] == "bad_request" and "top_k" in said["error"]["message"]


def test_a_tenants_quota_refuses_streams_through_the_sdk_and_from_a_raw_producer(
    spawn_worker, redis_url, redis_client
):
    """The fleet-wide limits apply to streamed requests: the SDK's admission refuses one over
    the tenant's bucket before it is written; a raw XADD that bypasses it is answered
    ``rate_limited`` by the worker, as a final chunk."""
    limit = [sys.executable, "-m", "inferfleet", "limit", "--name", NAME, "--tenant", "nightly"]
    subprocess.run(
        [*limit, "--rate", "0.001", "--burst", "1"],
        env=worker_env(redis_url),
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    spawn_worker(NAME, MODEL)  # it reads the limits in force as it starts
    with Producer(redis_url, NAME, tenant="nightly") as producer:
        assert len(producer.stream("a", {"max_new_tokens": 3}).tokens()) <= 3
        with pytest.raises(errors.RateLimited):
            producer.stream("a", {"max_new_tokens": 3})
    body = encode_body("a", {"max_new_tokens": 3})
    redis_client.xadd(
        f"inferfleet:{{{NAME}}}:requests",
        {"id": "raw-1", "body": body, "stream": "1", "tenant": "nightly"},
    )
    with Producer(redis_url, NAME) as reader, pytest.raises(errors.Throttled):
        list(reader.read_stream("raw-1"))


def test_a_model_that_fails_mid_generation_ends_its_streams_and_every_slot_serves_again(
    spawn_worker, redis_url, redis_client, tmp_path, monkeypatch
):
    flag = tmp_path / "fail"
    monkeypatch.setenv("FLAKY_FLAG", str(flag))
    spawn_worker(NAME, "tests.handlers:FlakyTinyLM")
    with Producer(redis_url, NAME) as producer:
        live = [producer.stream("a", {"max_new_tokens": 200}) for _ in range(2)]
        for stream in live:
            next(stream)
        flag.touch()
        for stream in live:
            with pytest.raises(errors.ModelError, match="the device fell over"):
                list(stream)
        flag.unlink()
        again = [producer.stream("b", {"max_new_tokens": 30}) for _ in range(4)]  # 4 slots
        assert [len(stream.tokens()) for stream in again] == [30] * 4


def test_with_chunk_ms_tokens_go_out_in_fewer_chunks_the_first_alone(
    spawn_worker, redis_url, redis_client, reference
):
    spawn_worker(NAME, SLOW, "--chunk-ms", "70")  # a pass takes 20 ms or more
    with Producer(redis_url, NAME) as producer:
        stream = producer.stream(PROMPTS[1], {"max_new_tokens": 40})
        tokens = [int(t) for t in stream.tokens()]
    assert tokens == reference(PROMPTS[1], 40)
    chunks = _chunks(redis_client, stream.request_id)
    assert len(chunks[0].tokens) == 1  # the first token is not held back
    assert len(chunks) < len(tokens) / 2 and [c.n for c in chunks] == list(range(len(chunks)))
