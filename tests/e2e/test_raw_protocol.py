"""The wire protocol as a foreign-language client speaks it (docs/protocol.md).

Only ``redis`` and ``msgpack`` talk to the fleet here, never the ``producer``
package: every key name, field and byte is written out as a Node or Go client
would write it from the doc. The worker is a real ``inferfleet worker``
subprocess serving models/affine.pt (float32[N,16] -> float32[N,4]).
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
    printed = re.search(r"\$ printf '%s' (.*?)\| xxd -r -p > body\.bin", page, re.DOTALL)
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
