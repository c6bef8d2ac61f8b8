"""The SDK's fast paths of the wire format: template bodies, peeked and lazily decoded replies, bulk
id checks.

Each is held to the general function it stands in for: the same bytes as
encode_body, the same fields as decode_reply, the same verdicts as
validate_request_id.
"""

from __future__ import annotations

import dataclasses
import pickle

import msgpack
import numpy as np
import pytest

from inferfleet.producer.errors import ModelError, ProtocolError
from inferfleet.producer.protocol import (
    DTYPES,
    BodyEncoder,
    LazyReply,
    Reply,
    decode_reply,
    encode_body,
    encode_reply_error,
    encode_reply_ok,
    lazy_reply,
    peek_reply,
    validate_request_ids,
)

TIMING = {"queued_ms": 1.5, "infer_ms": 2.0, "batch_rows": 3}


# --------------------------------------------------------------------------- BodyEncoder


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "shape", [(1, 16), (3,), (2, 1, 5), (1, 300), (1, 20000)]
)  # fixbin, bin8, bin16, bin32
@pytest.mark.parametrize("params", [None, {}, {"t": 0.5, "name": "x", "n": [1, 2]}])
def test_template_bodies_are_the_bytes_encode_body_writes(
    dtype: str, shape: tuple, params: dict | None
) -> None:
    rng = np.random.default_rng(0)
    encoder = BodyEncoder(params)
    for _ in range(3):  # the first learns the template, the others use it
        x = (
            (rng.standard_normal(shape) * 50).astype(DTYPES[dtype])
            if dtype != "bool"
            else rng.random(shape) > 0.5
        )
        assert encoder.encode(x) == encode_body(x, params)


@pytest.mark.parametrize(
    "inputs",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # not contiguous
        np.arange(4, dtype=">f4").reshape(1, 4),  # big-endian: converted, as encode_body does
        np.zeros((0, 4), np.float32),  # empty
        [np.ones((1, 2), np.int64), np.zeros((1, 3), np.uint8)],
        {"a": np.ones((2, 2), np.float16)},
        [[1.0, 2.0]],  # a nested list becomes a tensor
    ],
)
def test_other_inputs_take_encode_body(inputs: object) -> None:
    encoder = BodyEncoder({"k": 1})
    assert encoder.encode(inputs) == encode_body(inputs, {"k": 1})
    assert encoder.encode(inputs) == encode_body(inputs, {"k": 1})


@pytest.mark.parametrize("params", [None, {"t": 0.5}])
@pytest.mark.parametrize(
    "layout",
    [
        {"dense": ("float32", (1, 13)), "sparse": ("int64", (1, 26))},  # the CTR model's inputs
        {"b": ("uint8", (2, 300)), "a": ("float16", (2,))},  # bin16 data, names out of order
        {"only": ("bool", (1, 5))},
    ],
)
def test_map_template_bodies_are_the_bytes_encode_body_writes(
    layout: dict, params: dict | None
) -> None:
    rng = np.random.default_rng(1)
    encoder = BodyEncoder(params)
    for i in range(4):  # the first learns the parts, the others use them; one is all zeros
        x = {
            name: (rng.standard_normal(shape) * 50 * (i != 2)).astype(DTYPES[dtype])
            if dtype != "bool"
            else rng.random(shape) > 0.5
            for name, (dtype, shape) in layout.items()
        }
        assert encoder.encode(x) == encode_body(x, params)


def test_a_template_is_per_dtype_and_shape() -> None:
    encoder = BodyEncoder()
    a, b = np.ones((1, 4), np.float32), np.ones((1, 4), np.float64)
    c = np.ones((2, 2), np.float32)
    for x in (a, b, c, a, b, c):
        assert encoder.encode(x) == encode_body(x)
        inputs, _ = decode_body_of(encoder.encode(x))
        assert inputs.dtype == x.dtype and inputs.shape == x.shape


def decode_body_of(body: bytes) -> tuple:
    from inferfleet.producer.protocol import decode_body

    return decode_body(body)


@pytest.mark.parametrize(
    "bad", [np.float32(1.0), np.zeros((1, 2), np.complex64), np.zeros((1, 1), object)]
)
def test_what_the_contract_refuses_is_refused_every_time(bad: object) -> None:
    encoder = BodyEncoder()
    for _ in range(2):
        with pytest.raises(ProtocolError):
            encoder.encode(bad)


def test_unencodable_params_are_refused() -> None:
    with pytest.raises(ProtocolError, match="params"):
        BodyEncoder({"f": object()}).encode(np.ones((1, 2), np.float32))


# --------------------------------------------------------------------------- peek_reply


@pytest.mark.parametrize("rid", ["r", "a" * 31, "b" * 32, "c:d-e_f." * 16])  # fixstr and str8
def test_peek_reads_id_and_ok_of_the_fleets_replies(rid: str) -> None:
    ok = encode_reply_ok(rid, np.ones((1, 2), np.float32), ("m", "1"), TIMING)
    failed = encode_reply_error(rid, "expired", "late")
    assert peek_reply(ok) == (rid, True)
    assert peek_reply(failed) == (rid, False)


@pytest.mark.parametrize(
    "raw",
    [
        msgpack.packb({"ok": True, "id": "r", "outputs": {}}),  # another key order
        msgpack.packb({"id": 5, "ok": True}),  # an id that is no string
        msgpack.packb({"id": "r", "ok": 1}),  # an ok that is no bool
        msgpack.packb({"id": "r"}),
        msgpack.packb([1, 2, 3]),
        b"\x82\xa2id\xa3ab",  # cut short
        b"\x82\xa2id\xa2\xff\xfe\xa2ok\xc3",  # not UTF-8
        b"\xc0",
    ],
)
def test_peek_gives_up_on_any_other_layout(raw: bytes) -> None:
    assert peek_reply(raw) is None


# --------------------------------------------------------------------------- lazy_reply


def test_a_lazy_reply_has_every_field_decode_reply_gives() -> None:
    outputs = {"p": np.arange(6, dtype=np.float32).reshape(2, 3), "q": np.ones((2, 1), np.int64)}
    raw = encode_reply_ok("rid-1", outputs, ("ctr", "v7"), TIMING)
    lazy, eager = lazy_reply(raw), decode_reply(raw)
    assert isinstance(lazy, LazyReply) and isinstance(lazy, Reply)
    assert (lazy.id, lazy.ok, lazy.error_code, lazy.error_message) == ("rid-1", True, None, None)
    assert (lazy.model_name, lazy.model_version, lazy.timing) == (
        eager.model_name,
        eager.model_version,
        TIMING,
    )
    assert lazy.outputs.keys() == eager.outputs.keys()
    for name in outputs:
        np.testing.assert_array_equal(lazy.outputs[name], outputs[name])
    assert lazy.outputs is lazy.outputs  # decoded once
    assert lazy.raise_for_error() is lazy


def test_a_lazy_reply_decodes_only_when_asked() -> None:
    raw = encode_reply_ok("r9", np.ones((1, 2), np.float32), ("m", "1"), TIMING)
    broken = raw.replace(b"float32", b"float99")  # the same length: only the dtype name is wrong
    reply = lazy_reply(broken)
    assert reply.id == "r9" and reply.ok is True  # read off the first bytes
    with pytest.raises(ProtocolError, match="dtype"):
        _ = reply.outputs


def test_failed_and_unusual_replies_are_decoded_at_once() -> None:
    failed = lazy_reply(encode_reply_error("r2", "model_error", "boom", ("m", "1")))
    assert type(failed) is Reply
    assert (failed.ok, failed.error_code, failed.error_message) == (False, "model_error", "boom")
    assert failed.model_name == "m"
    with pytest.raises(ModelError):
        failed.raise_for_error()
    reordered = msgpack.packb(
        {"ok": True, "id": "r3", "outputs": {"dtype": "int8", "shape": [1], "data": b"\x01"}}
    )
    assert type(lazy_reply(reordered)) is Reply and lazy_reply(reordered).outputs.tolist() == [1]
    with pytest.raises(ProtocolError):
        lazy_reply(msgpack.packb({"ok": True, "id": "r4"}))  # no outputs: as decode_reply says
    with pytest.raises(ProtocolError):
        lazy_reply(b"")


def test_a_lazy_reply_equals_the_eager_one_and_stays_frozen() -> None:
    raw = encode_reply_ok("r5", np.full((1, 1), 2.0, np.float32), ("m", "1"), TIMING)
    lazy, eager = lazy_reply(raw), decode_reply(raw)
    assert lazy == eager and eager == lazy and lazy == lazy_reply(raw)
    assert lazy != decode_reply(
        encode_reply_ok("r6", np.full((1, 1), 2.0, np.float32), ("m", "1"), TIMING)
    )
    assert [f.name for f in dataclasses.fields(lazy)] == [f.name for f in dataclasses.fields(Reply)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        lazy.ok = False  # type: ignore[misc]
    with pytest.raises(AttributeError):
        lazy.outputs = None  # type: ignore[misc]
    assert "r5" in repr(lazy)
    again = pickle.loads(pickle.dumps(lazy))
    assert again == eager


def test_a_reply_whose_full_decode_disagrees_with_its_first_bytes_is_refused() -> None:
    # a map with "id" twice: msgpack keeps the last, the peek reads the first
    raw = (
        b"\x84\xa2id\xa1a\xa2ok\xc3\xa2id\xa1b"
        + msgpack.packb("outputs")
        + msgpack.packb({"dtype": "int8", "shape": [1], "data": b"\x00"})
    )
    reply = lazy_reply(raw)
    assert reply.id == "a"
    with pytest.raises(ProtocolError, match="another id"):
        _ = reply.timing


# --------------------------------------------------------------------------- validate_request_ids


def test_bulk_id_checks_agree_with_the_single_one() -> None:
    good = ["a", "b-1:2.3_4", "x" * 128]
    assert validate_request_ids(good) == good
    assert validate_request_ids([b"raw-id", "s"]) == ["raw-id", "s"]
    assert validate_request_ids([]) == []
    for bad in (["ok", "has space"], ["x" * 129], [""], ["a\nb"], ["ok", "a{b}"], ["é"]):
        with pytest.raises(ProtocolError, match="invalid request id"):
            validate_request_ids(bad)
