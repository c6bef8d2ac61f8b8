"""The wire protocol as a foreign-language client speaks it (docs/protocol.md).

Only ``redis`` and ``msgpack`` talk to the fleet here, never the ``producer``
package: every key name, field and byte is written out as a Node or Go client
would write it from the doc. The worker is a real ``inferfleet worker``
subprocess serving models/affine.pt (float32[N,16] -> float32[N,4]), or, for
the streamed replies of contract 1.3, the example language model TinyLM on the
queue ``tokens`` (its tokens checked against the model's own greedy
recomputation).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from tests.conftest import ROOT, stop_process, wait_for_consumer, worker_env
from tests.helpers import wait_until

NAME = "affine"
STREAM = "inferfleet:{affine}:requests"
INBOX = "inferfleet:{affine}:inbox:client-7"
GROUP = "workers"
REPLY_TIMEOUT_S = 30
DEFAULT_TTL_MS = 300_000

#: The worked example of docs/protocol.md, byte for byte: {"inputs": float32[1,16] of 1.0}.
DOC_EXAMPLE_BODY = bytes.fromhex(
    "81"
    "a6696e70757473"  # map of 1: "inputs" ->
    "83"
    "a56474797065"
    "a7666c6f61743332"  # map of 3: "dtype" -> "float32"
    "a5736861706592"
    "0110"  # "shape" -> [1, 16]
    "a464617461"
    "c440" + "0000803f" * 16  # "data" -> bin 8 of 64 bytes  # 16 x float32 1.0, little-endian
)


def reply_key(rid: str) -> str:
    return f"inferfleet:{{{NAME}}}:reply:{rid}"


def tensor(arr: np.ndarray) -> dict[str, Any]:
    """A TENSOR map: dtype name, shape, little-endian C-order bytes."""
    arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return {"dtype": arr.dtype.name, "shape": list(arr.shape), "data": arr.tobytes()}


def body(inputs: Any, **extra: Any) -> bytes:
    return msgpack.packb({"inputs": inputs, **extra}, use_bin_type=True)


def from_tensor(obj: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"]).newbyteorder("<")).reshape(
        obj["shape"]
    )


def blpop(client: redis.Redis, key: str) -> dict[str, Any]:
    """BLPOP in 1 s rounds (shorter than the client's socket timeout) up to REPLY_TIMEOUT_S."""
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    popped = None
    while popped is None and time.monotonic() < deadline:
        popped = client.blpop([key], timeout=1)
    assert popped is not None, f"no reply on {key} within {REPLY_TIMEOUT_S} s"
    assert popped[0] == key.encode()
    return msgpack.unpackb(popped[1], raw=False)


def wait_for_key(client: redis.Redis, key: str, timeout_s: float = REPLY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not client.exists(key):
        assert time.monotonic() < deadline, f"{key} never appeared"
        time.sleep(0.01)


def assert_all_acked(client: redis.Redis) -> None:
    """Every delivered entry was acknowledged, and the queue reads as drained."""
    assert client.xpending(STREAM, GROUP)["pending"] == 0
    group = next(g for g in client.xinfo_groups(STREAM) if g["name"] == GROUP.encode())
    assert group["pending"] == 0
    if "lag" in group:  # Redis 7+: nothing left to deliver
        assert group["lag"] == 0


@pytest.fixture
def start_worker(
    redis_url: str, redis_client: redis.Redis, models_dir: Path, tmp_path: Path
) -> Iterator[Callable[[], subprocess.Popen]]:
    """``start_worker()`` runs ``inferfleet worker`` on affine.pt; it is always stopped after."""
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        consumer = f"raw-{len(procs)}"
        log_path = tmp_path / f"{consumer}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "inferfleet",
                    "worker",
                    "--name",
                    NAME,
                    "--model",
                    str(models_dir / "affine.pt"),
                    "--consumer",
                    consumer,
                ],
                env=worker_env(redis_url),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
        try:  # ready once it has joined the group (it loads and warms the model first)
            wait_for_consumer(redis_client, STREAM, consumer, proc, timeout_s=60)
        except (RuntimeError, TimeoutError) as exc:
            stop_process(proc)
            raise AssertionError(f"{exc}\n{log_path.read_text(errors='replace')}") from exc
        return proc

    yield start
    for proc in procs:
        stop_process(proc)


def test_requests_written_before_any_worker_are_served(redis_client, start_worker, affine):
    xs = {
        f"early-{i}": np.random.default_rng(i).standard_normal((i + 1, 16), dtype=np.float32)
        for i in range(3)
    }
    for rid, x in xs.items():
        redis_client.xadd(STREAM, {"id": rid, "body": body(tensor(x))})
    # no worker yet, so no group: the whole stream is backlog (the XLEN fallback)
    assert redis_client.xinfo_groups(STREAM) == []
    assert redis_client.xlen(STREAM) == 3

    worker = start_worker()  # creates the group at id 0
    for rid, x in xs.items():
        reply = blpop(redis_client, reply_key(rid))
        assert reply["id"] == rid and reply["ok"] is True, reply
        out = from_tensor(reply["outputs"])
        assert out.dtype == np.float32 and out.shape == (len(x), 4)
        np.testing.assert_allclose(out, affine(x), rtol=1e-6, atol=1e-6)
    assert_all_acked(redis_client)

    # with the group in place and no worker reading, lag counts what waits
    assert stop_process(worker) == 0
    for i in range(2):
        redis_client.xadd(STREAM, {"id": f"waiting-{i}", "body": body(tensor(xs["early-0"]))})
    group = redis_client.xinfo_groups(STREAM)[0]
    if "lag" in group:  # Redis 7+
        assert group["lag"] == 2
    assert redis_client.xlen(STREAM) >= 2  # the upper bound when lag is unknown


def test_doc_worked_example_bytes(redis_client, start_worker, affine):
    # the page's printf ... | xxd -r -p writes these bytes, and its wc -c counts them
    page = (ROOT / "docs" / "protocol.md").read_text()
    printed = re.search(r"\$ printf '%s' ([^|]*?)\| xxd -r -p > body\.bin", page)
    assert printed, "docs/protocol.md has no printf ... | xxd -r -p > body.bin"
    assert bytes.fromhex(re.sub(r"[\s\\]", "", printed.group(1))) == DOC_EXAMPLE_BODY
    assert re.search(rf"\$ wc -c < body\.bin\n\s+{len(DOC_EXAMPLE_BODY)}\n", page)
    start_worker()
    redis_client.xadd(STREAM, {"id": "demo-1", "body": DOC_EXAMPLE_BODY})
    reply = blpop(redis_client, reply_key("demo-1"))
    assert set(reply) == {"id", "ok", "outputs", "model", "timing"}
    assert reply["outputs"]["dtype"] == "float32" and reply["outputs"]["shape"] == [1, 4]
    assert isinstance(reply["outputs"]["data"], bytes) and len(reply["outputs"]["data"]) == 16
    np.testing.assert_allclose(
        from_tensor(reply["outputs"]), affine(np.ones((1, 16), np.float32)), rtol=1e-6, atol=1e-6
    )


def test_ok_reply_format_single_element_with_ttl(redis_client, start_worker, affine):
    start_worker()
    x = np.random.default_rng(2).standard_normal((2, 16), dtype=np.float32)
    redis_client.xadd(STREAM, {"id": "fmt-1", "body": body(tensor(x))})
    key = reply_key("fmt-1")
    wait_for_key(redis_client, key)
    # the push and the XACK are one atomic step: once the reply exists, nothing is pending
    assert redis_client.llen(key) == 1
    assert 0 < redis_client.pttl(key) <= DEFAULT_TTL_MS
    assert_all_acked(redis_client)

    reply = blpop(redis_client, key)
    assert reply["id"] == "fmt-1" and reply["ok"] is True and "error" not in reply
    np.testing.assert_allclose(from_tensor(reply["outputs"]), affine(x), rtol=1e-6, atol=1e-6)
    assert reply["model"]["name"] == NAME
    assert isinstance(reply["model"]["version"], str) and reply["model"]["version"]
    timing = reply["timing"]
    assert set(timing) == {"queued_ms", "infer_ms", "batch_rows"}
    assert isinstance(timing["queued_ms"], float) and timing["queued_ms"] >= 0
    assert isinstance(timing["infer_ms"], float) and timing["infer_ms"] > 0
    assert timing["batch_rows"] == 2
    assert not redis_client.exists(key)  # BLPOP took the only element


def test_malformed_requests_get_bad_request(redis_client, start_worker):
    start_worker()
    ones = np.ones((1, 16), np.float32)
    cases: dict[str, dict[str, Any]] = {
        "wrong-dtype": {"body": body(tensor(ones.astype(np.float64)))},
        "wrong-trailing-shape": {"body": body(tensor(np.ones((1, 8), np.float32)))},
        "zero-rows": {"body": body(tensor(np.ones((0, 16), np.float32)))},
        "list-form": {"body": body([tensor(ones)])},
        "short-data": {"body": body({"dtype": "float32", "shape": [1, 16], "data": b"\0" * 60})},
        "data-as-str": {"body": body({"dtype": "float32", "shape": [1, 1], "data": "abcd"})},
        "params-to-torchscript": {"body": body(tensor(ones), params={"t": 1})},
        "ext-type": {
            "body": msgpack.packb({"inputs": msgpack.ExtType(1, b"x")}, use_bin_type=True)
        },
        "not-msgpack": {"body": b"\xc1"},
        "extra-body-key": {"body": body(tensor(ones), extra=1)},
        "no-body": {},
        "bad-deadline": {"body": body(tensor(ones)), "deadline": "12.5"},
    }
    for rid, fields in cases.items():
        redis_client.xadd(STREAM, {"id": rid, **fields})
    # an entry with no readable id cannot be answered: acknowledged, logged, dropped
    redis_client.xadd(STREAM, {"id": "not a valid id!", "body": body(tensor(ones))})
    redis_client.xadd(STREAM, {"id": "ok-after", "body": body(tensor(ones))})

    # the page's demo-5: the refusal waits in a list of one element, under the reply TTL
    wait_until(lambda: redis_client.llen(reply_key("not-msgpack")) == 1, 30, "the refusal")
    assert 0 < redis_client.pttl(reply_key("not-msgpack")) <= DEFAULT_TTL_MS
    messages = {}
    for rid in cases:
        reply = blpop(redis_client, reply_key(rid))
        assert reply["id"] == rid and reply["ok"] is False and "outputs" not in reply, reply
        assert reply["error"]["code"] == "bad_request", (rid, reply)
        assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
        assert reply["model"]["name"] == NAME
        messages[rid] = reply["error"]["message"]
    assert "float32[N,16]" in messages["wrong-dtype"] and "float64" in messages["wrong-dtype"]
    assert "no params" in messages["params-to-torchscript"]
    assert blpop(redis_client, reply_key("ok-after"))["ok"] is True
    assert redis_client.keys("inferfleet:{affine}:reply:*") == []
    assert_all_acked(redis_client)


def test_reply_to_outside_the_inbox_prefix_is_refused_on_the_default_key(
    redis_client, start_worker
):
    start_worker()
    x = body(tensor(np.ones((1, 16), np.float32)))
    elsewhere = {
        "rt-plain": "victim",
        "rt-same-queue": "inferfleet:{affine}:requests",
        "rt-other-queue": "inferfleet:{other}:inbox:x",
        "rt-empty-suffix": "inferfleet:{affine}:inbox:",
    }
    for rid, target in elsewhere.items():
        redis_client.xadd(STREAM, {"id": rid, "body": x, "reply_to": target})
    for rid in elsewhere:
        reply = blpop(redis_client, reply_key(rid))
        assert reply["ok"] is False and reply["error"]["code"] == "bad_request", reply
        assert "reply_to" in reply["error"]["message"]
    assert not redis_client.exists(
        "victim", "inferfleet:{other}:inbox:x", "inferfleet:{affine}:inbox:"
    )
    assert redis_client.type(STREAM) == b"stream"
    assert_all_acked(redis_client)


def test_reply_to_an_inbox(redis_client, start_worker, affine):
    start_worker()
    xs = {f"inbox-{i}": np.full((i + 1, 16), i, np.float32) for i in range(3)}
    for rid, x in xs.items():
        redis_client.xadd(STREAM, {"id": rid, "body": body(tensor(x)), "reply_to": INBOX})
    got = {}
    while len(got) < len(xs):
        reply = blpop(redis_client, INBOX)
        got[reply["id"]] = reply
    assert set(got) == set(xs)
    for rid, x in xs.items():
        assert got[rid]["ok"] is True
        np.testing.assert_allclose(
            from_tensor(got[rid]["outputs"]), affine(x), rtol=1e-6, atol=1e-6
        )
        assert not redis_client.exists(reply_key(rid))  # nothing on the default key
    assert not redis_client.exists(INBOX)  # exactly one reply per request
    assert_all_acked(redis_client)


def test_deadline(redis_client, start_worker):
    start_worker()
    now_ms = int(time.time() * 1000)
    x = body(tensor(np.ones((1, 16), np.float32)))
    redis_client.xadd(STREAM, {"id": "late", "body": x, "deadline": str(now_ms - 60_000)})
    redis_client.xadd(STREAM, {"id": "in-time", "body": x, "deadline": str(now_ms + 60_000)})
    late = blpop(redis_client, reply_key("late"))
    assert late["ok"] is False and late["error"]["code"] == "expired", late
    assert "outputs" not in late and "timing" not in late  # not computed
    assert blpop(redis_client, reply_key("in-time"))["ok"] is True
    assert_all_acked(redis_client)


def test_body_over_the_size_limit_is_too_large(redis_client, start_worker):
    start_worker()
    size = 16 * 1024 * 1024  # the worker's default --max-body-bytes
    big = body({"dtype": "uint8", "shape": [size], "data": bytes(size)})
    assert len(big) > size
    redis_client.xadd(STREAM, {"id": "big", "body": big})
    reply = blpop(redis_client, reply_key("big"))
    assert reply["ok"] is False and reply["error"]["code"] == "too_large", reply
    assert_all_acked(redis_client)


# ---- streamed replies (contract 1.3), against a worker serving TinyLM ----

TOKENS = "tokens"
TOKENS_STREAM = "inferfleet:{tokens}:requests"
EOS = 256  # TinyLM's end token
STREAM_TIMING = {"queued_ms", "first_token_ms", "infer_ms", "tokens"}


def chunks_key(rid: str) -> str:
    return f"inferfleet:{{{TOKENS}}}:chunks:{rid}"


def tokens_reply_key(rid: str) -> str:
    return f"inferfleet:{{{TOKENS}}}:reply:{rid}"


def prompt_body(prompt: str, max_new_tokens: int) -> bytes:
    """A text prompt (a msgpack str, a raw input) and its ``max_new_tokens``."""
    return body(prompt, params={"max_new_tokens": max_new_tokens})


@pytest.fixture
def tokens_worker(spawn_worker, tinylm: Path) -> subprocess.Popen:
    """A real ``inferfleet worker`` serving TinyLM (models/tinylm.pt) on the queue ``tokens``."""
    return spawn_worker(TOKENS, "tests.fixtures.tiny_lm:TinyLM")


@pytest.fixture(scope="module")
def greedy(tinylm: Path) -> Callable[[str, int], list[int]]:
    """``greedy(prompt, max_new_tokens)``: TinyLM's greedy tokens for a text prompt, recomputed
    with no cache (``reference_generate``): what a worker's stream must hold."""
    import torch

    from tests.fixtures.tiny_lm import TinyLM

    model = TinyLM(tinylm)
    model.setup(torch.device("cpu"))

    def generate(prompt: str, max_new_tokens: int) -> list[int]:
        ids = np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int64)
        return [int(t) for t in model.reference_generate(ids, max_new_tokens)]

    return generate


def xread_to_final(
    client: redis.Redis, key: str, last_id: str = "0"
) -> list[tuple[str, dict[bytes, bytes]]]:
    """The doc's reader: ``XREAD BLOCK`` from ``last_id``, then from the last id seen, until a
    chunk with ``final`` 1; every entry it got, (id, fields), in order."""
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    entries: list[tuple[str, dict[bytes, bytes]]] = []
    while not entries or entries[-1][1][b"final"] != b"1":
        assert time.monotonic() < deadline, f"no final chunk in {key} within {REPLY_TIMEOUT_S} s"
        for _key, found in client.xread({key: last_id}, block=1000) or []:
            for entry_id, fields in found:
                last_id = entry_id.decode()
                entries.append((last_id, fields))
    return entries


def check_stream(
    entries: list[tuple[str, dict[bytes, bytes]]], rid: str, first_n: int = 0
) -> tuple[list[int], dict[str, Any]]:
    """The chunks numbered ``first_n``, ``first_n`` + 1, ... (no gap, none twice) of attempt 1,
    final only the last, each body as the doc shows it: (their tokens, the final body)."""
    assert [int(f[b"n"]) for _, f in entries] == list(range(first_n, first_n + len(entries)))
    assert {f[b"attempt"] for _, f in entries} == {b"1"}
    assert [f[b"final"] for _, f in entries] == [b"0"] * (len(entries) - 1) + [b"1"]
    tokens: list[int] = []
    bodies = [msgpack.unpackb(f[b"body"], raw=False) for _, f in entries]
    for chunk in bodies:
        assert chunk["id"] == rid and chunk["ok"] is True, chunk
        out = from_tensor(chunk["outputs"])
        assert out.dtype == np.int64 and out.ndim == 1
        tokens += [int(t) for t in out]
    for chunk in bodies[:-1]:
        assert set(chunk) == {"id", "ok", "outputs"}
    return tokens, bodies[-1]


def test_streamed_reply_worked_example(redis_client, tokens_worker, greedy):
    # the page's prompt.bin: {"inputs": "./scripts/", "params": {"max_new_tokens": 8}}, 43 bytes
    page = (ROOT / "docs" / "protocol.md").read_text()
    printed = re.search(r"\$ printf '%s' ([^|]*?)\| xxd -r -p > prompt\.bin", page)
    assert printed, "docs/protocol.md has no printf ... | xxd -r -p > prompt.bin"
    doc_body = bytes.fromhex(re.sub(r"[\s\\]", "", printed.group(1)))
    assert doc_body == prompt_body("./scripts/", 8)
    assert re.search(rf"\$ wc -c < prompt\.bin\n\s+{len(doc_body)}\n", page)

    requests = {"gen-1": ("./scripts/", 8), "gen-long": ("inferfleet ", 12)}
    for rid, (prompt, max_new) in requests.items():
        redis_client.xadd(
            TOKENS_STREAM, {"id": rid, "stream": "1", "body": prompt_body(prompt, max_new)}
        )
    for rid, (prompt, max_new) in requests.items():
        expected = greedy(prompt, max_new)
        entries = xread_to_final(redis_client, chunks_key(rid))
        tokens, final = check_stream(entries, rid)
        assert tokens == expected
        stopped = expected[-1] == EOS
        assert final["finish_reason"] == ("stop" if stopped else "length"), final
        assert final["model"] == {"name": TOKENS, "version": "1"}
        assert set(final["timing"]) == STREAM_TIMING
        assert final["timing"]["tokens"] == len(expected)
        # the key has the reply TTL from its last chunk; the final chunk acknowledged the entry
        assert 0 < redis_client.pttl(chunks_key(rid)) <= DEFAULT_TTL_MS
    assert redis_client.xpending(TOKENS_STREAM, GROUP)["pending"] == 0

    # a reader that resumes from chunk 2's id gets chunks 3.. only
    entries = redis_client.xrange(chunks_key("gen-long"))
    assert len(entries) == len(greedy("inferfleet ", 12)) >= 4  # one token a chunk
    resumed = xread_to_final(redis_client, chunks_key("gen-long"), entries[2][0].decode())
    tokens, _ = check_stream(resumed, "gen-long", first_n=3)
    assert tokens == greedy("inferfleet ", 12)[3:]

    # without stream: one ordinary reply in the reply list, with every token
    redis_client.xadd(TOKENS_STREAM, {"id": "gen-2", "body": prompt_body("inferfleet ", 12)})
    reply = blpop(redis_client, tokens_reply_key("gen-2"))
    assert reply["id"] == "gen-2" and reply["ok"] is True, reply
    out = from_tensor(reply["outputs"])
    assert out.dtype == np.int64 and out.tolist() == greedy("inferfleet ", 12)
    assert set(reply["timing"]) == STREAM_TIMING
    assert not redis_client.exists(chunks_key("gen-2"))
    assert redis_client.xpending(TOKENS_STREAM, GROUP)["pending"] == 0


def test_a_cancel_ends_a_stream_being_generated(redis_client, tokens_worker, greedy):
    # 245 greedy tokens (up to the model's 256 positions): long enough to cancel mid-way
    redis_client.xadd(
        TOKENS_STREAM,
        {"id": "long-1", "stream": "1", "body": prompt_body("inferfleet ", 250)},
    )
    got = redis_client.xread({chunks_key("long-1"): "0"}, count=1, block=REPLY_TIMEOUT_S * 1000)
    assert got, "no first chunk"
    lanes = [f"{TOKENS_STREAM}:high", TOKENS_STREAM, f"{TOKENS_STREAM}:low"]
    answer = redis_client.fcall(
        "inferfleet_cancel",
        5,
        "inferfleet:{tokens}:cancels",
        *lanes,
        tokens_reply_key("long-1"),  # the default reply key, never the chunks key
        3_600_000,
        "long-1",
    )
    assert answer == [b"cancelled"]
    entries = xread_to_final(redis_client, chunks_key("long-1"))
    assert [int(f[b"n"]) for _, f in entries] == list(range(len(entries)))
    assert {f[b"attempt"] for _, f in entries} == {b"1"}
    bodies = [msgpack.unpackb(f[b"body"], raw=False) for _, f in entries]
    *made, final = bodies
    assert final["ok"] is False and final["error"]["code"] == "cancelled", final
    assert all(chunk["ok"] is True for chunk in made)
    tokens = [int(t) for chunk in made for t in from_tensor(chunk["outputs"])]
    expected = greedy("inferfleet ", 250)
    assert tokens == expected[: len(tokens)] and len(tokens) < len(expected)
    assert redis_client.xpending(TOKENS_STREAM, GROUP)["pending"] == 0


def test_a_one_reply_model_ignores_stream(redis_client, start_worker, affine):
    start_worker()
    x = np.ones((1, 16), np.float32)
    redis_client.xadd(STREAM, {"id": "st-1", "stream": "1", "body": body(tensor(x))})
    reply = blpop(redis_client, reply_key("st-1"))
    assert reply["ok"] is True, reply
    np.testing.assert_allclose(from_tensor(reply["outputs"]), affine(x), rtol=1e-6, atol=1e-6)
    assert not redis_client.exists(f"inferfleet:{{{NAME}}}:chunks:st-1")
    assert_all_acked(redis_client)
