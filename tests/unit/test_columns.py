"""Columnar admission decides every entry as the general intake does, and is taken for the common
case.

A read admitted by :func:`admit_read` gives, per entry, what
:meth:`Intake.admit` gives for it alone: the same refusal, or a request with
the same id, reply key, rows and inputs (a :class:`Columns` batch unpacked
with :meth:`Columns.requests`). Every entry of the read is accounted for
exactly once. The reply format strings write what :func:`encode_reply_ok`
writes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferfleet.producer.protocol import (
    Limits,
    QueueKeys,
    encode_body,
    encode_reply_ok,
)
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.columns import Columns, admit_read, merge_columns
from inferfleet.worker.serving.intake import Answer, Intake
from inferfleet.worker.serving.templates import ReplyTemplate
from tests.helpers import warmed_intake

KEYS = QueueKeys("q")
MODEL = ("q-model", "v7")
NOW_MS = 1_700_000_000_500
INBOX = KEYS.inbox("p1").encode()
BODY = encode_body(np.zeros((1, 4), np.float32))


def ctr_like(
    dense: float = 0.0,
    ids: int = 0,
    order: tuple[str, str] = ("dense", "ids"),
    ids_dtype: str = "int64",
) -> bytes:
    """A map body of two tensors, as the CTR model takes."""
    tensors = {"dense": np.full((1, 3), dense, np.float32), "ids": np.full((1, 2), ids, ids_dtype)}
    return encode_body({name: tensors[name] for name in order})


#: What the warmed intakes learn (tests/helpers.py ``warmed_intake``): the float32[1,4] and the
#: CTR-like map templates.
LEARNT = (BODY, ctr_like())


def warmed() -> Intake:
    """A new intake that learnt :data:`LEARNT` from first requests to the inbox p1."""
    return warmed_intake(KEYS, MODEL, LEARNT, INBOX, NOW_MS)


def flat(fields: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [part for pair in fields for part in pair]


def unpacked(admitted: list[Any]) -> dict[bytes, Request | Answer]:
    """Each entry id's outcome; fails if an entry is answered twice."""
    out: dict[bytes, Request | Answer] = {}
    for item in admitted:
        for one in item.requests() if isinstance(item, Columns) else [item]:
            assert one.entry_id not in out, one.entry_id
            out[one.entry_id] = one
    return out


def same(a: Request | Answer, b: Request | Answer) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, Answer):
        assert a == b
        return
    assert isinstance(b, Request)
    for name in (
        "entry_id",
        "rid",
        "reply_key",
        "params",
        "rows",
        "signature",
        "enqueued_ms",
        "picked_ms",
    ):
        assert getattr(a, name) == getattr(b, name), name
    same_inputs(a.inputs, b.inputs)


def same_inputs(a: Any, b: Any) -> None:
    """Equal inputs in one form: a tensor, a list or a map of tensors (names in order)."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        a, b = list(a.values()), list(b.values())
    for x, y in zip(
        [a] if isinstance(a, np.ndarray) else a, [b] if isinstance(b, np.ndarray) else b
    ):
        np.testing.assert_array_equal(x, y)
        assert x.dtype == y.dtype and x.shape == y.shape


rids = st.one_of(
    st.from_regex(rb"[A-Za-z0-9._:-]{1,12}", fullmatch=True),
    st.binary(max_size=6),
    st.just(b"x" * 129),
    st.just(b"x" * 128),
    st.just(b"ab\ncd"),  # two valid ids joined: one invalid id, whatever its batch-mates
    st.just(b"ab\n"),
    st.just("é".encode()),
)
bodies = st.one_of(
    st.builds(
        lambda v: encode_body(np.full((1, 4), v, np.float32)), st.floats(width=32, allow_nan=False)
    ),
    st.builds(lambda: encode_body(np.zeros((2, 4), np.float32))),
    st.builds(lambda: encode_body(np.zeros((1, 4), np.float64))),
    st.builds(lambda: encode_body(np.zeros((1, 4), np.float32), {"t": 1})),
    st.builds(lambda b: BODY[:-4] + b, st.binary(min_size=4, max_size=4)),
    st.builds(
        lambda b: b + BODY[3:], st.binary(min_size=3, max_size=3)
    ),  # same length, other prefix
    st.binary(min_size=0, max_size=60),
    st.builds(ctr_like, st.floats(width=32, allow_nan=False), st.integers(-(2**40), 2**40)),
    st.builds(lambda: ctr_like(order=("ids", "dense"))),  # same length, other key order
    st.builds(lambda: ctr_like(ids_dtype="float64")),  # same length, other dtype
)
extras = st.lists(
    st.sampled_from(
        [
            (b"deadline", b"1700000000400"),
            (b"deadline", b"1700000000600"),
            (b"deadline", b"12x"),
            (b"reply_to", INBOX),
            (b"reply_to", KEYS.inbox("p2").encode()),
            (b"reply_to", b"elsewhere"),
            (b"tenant", b"t1"),
            (b"id", b"again"),
        ]
    ),
    max_size=3,
)
entries = st.builds(
    lambda rid, body, extra, swap: (
        flat([(b"body", body), (b"id", rid)] if swap else [(b"id", rid), (b"body", body)])
        + flat(extra)
    ),
    rids,
    bodies,
    extras,
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(read=st.lists(entries, min_size=1, max_size=12))
def test_a_read_is_admitted_entry_by_entry_as_the_general_intake_would(
    read: list[list[bytes]],
) -> None:
    raw = [[b"1700000000%03d-%d" % (i, i % 3), fields] for i, fields in enumerate(read)]
    got = unpacked(admit_read(warmed(), raw, NOW_MS))
    general = Intake(KEYS, Limits(), MODEL)
    assert set(got) == {entry_id for entry_id, _ in raw}
    for entry_id, fields in raw:
        values = iter(fields)
        same(got[entry_id], general.admit(entry_id, dict(zip(values, values)), NOW_MS))


def test_the_common_read_is_one_columns_batch_decoded_at_once() -> None:
    inputs = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
    raw = [
        [
            b"1700000000%03d-0" % i,
            [
                b"id",
                b"r%d" % i,
                b"body",
                encode_body(inputs[i : i + 1]),
                b"deadline",
                b"1700000009999",
                b"reply_to",
                INBOX,
            ],
        ]
        for i in range(40)
    ]
    (cols,) = admit_read(warmed(), raw, NOW_MS)
    assert isinstance(cols, Columns)
    assert cols.rids == [b"r%d" % i for i in range(40)] and cols.reply_keys == [INBOX] * 40
    np.testing.assert_array_equal(cols.inputs, inputs)
    assert cols.rows == 40 and cols.enqueued_ms()[:2] == [1700000000000, 1700000000001]


def test_entries_that_do_not_fit_go_one_by_one_beside_the_batch() -> None:
    good = [[b"1-%d" % i, [b"id", b"r%d" % i, b"body", BODY]] for i in range(5)]
    odd = [
        [b"2-0", [b"id", b"bad id!", b"body", BODY]],
        [b"2-1", None],
        [b"2-2", {b"id": b"d", b"body": BODY}],
    ]
    admitted = admit_read(warmed(), good + odd, NOW_MS)
    assert [len(item) for item in admitted if isinstance(item, Columns)] == [5]
    outcomes = unpacked(admitted)
    assert outcomes[b"2-0"] == Answer(
        b"2-0", None, None
    )  # no readable id: acknowledged, never answered
    assert outcomes[b"2-1"] == Answer(
        b"2-1", None, None
    )  # deleted while pending: acknowledged only
    assert isinstance(outcomes[b"2-2"], Request)


def test_a_map_read_is_one_columns_batch_with_a_map_of_inputs() -> None:
    raw = [
        [b"1-%d" % i, [b"id", b"r%d" % i, b"body", ctr_like(dense=i, ids=10 * i)]] for i in range(6)
    ]
    (cols,) = admit_read(warmed(), raw, NOW_MS)
    assert isinstance(cols, Columns) and list(cols.inputs) == ["dense", "ids"]
    np.testing.assert_array_equal(cols.inputs["ids"][:, 0], [0, 10, 20, 30, 40, 50])
    assert cols.inputs["ids"].dtype == np.int64 and cols.inputs["dense"].shape == (6, 3)
    np.testing.assert_array_equal(
        cols.requests()[4].inputs["dense"], np.full((1, 3), 4, np.float32)
    )


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("body", [BODY, ctr_like(dense=1.5, ids=7)])
def test_columns_inputs_are_fresh_writable_arrays_torch_takes(body: bytes, count: int) -> None:
    """One entry too: its one-row slice of the joined bodies must not keep the body's length as its
    stride."""
    raw = [[b"1-%d" % i, [b"id", b"r%d" % i, b"body", body]] for i in range(count)]
    (cols,) = admit_read(warmed(), raw, NOW_MS)
    arrays = [cols.inputs] if isinstance(cols.inputs, np.ndarray) else list(cols.inputs.values())
    for arr in arrays:
        assert arr.flags.c_contiguous and arr.flags.writeable and arr.strides[-1] == arr.itemsize
        torch.from_numpy(arr)  # refuses strides that are no multiple of the element size
    single = warmed().template_for(len(body))
    assert single is not None
    for arr in (
        [single[0].inputs_of(body)] if body is BODY else list(single[0].inputs_of(body).values())
    ):
        assert all(
            stride % arr.itemsize == 0 for stride in arr.strides
        )  # the per-entry path's views too


def test_columns_of_one_signature_are_merged_for_one_batch() -> None:
    intake = warmed()
    reads = [
        [[b"1-%d" % (10 * r + i), [b"id", b"r%d%d" % (r, i), b"body", BODY]] for i in range(3)]
        for r in range(2)
    ]
    parts = [item for read in reads for item in admit_read(intake, read, NOW_MS)]
    (merged,) = merge_columns(parts)
    assert merged.entry_ids == [b"1-0", b"1-1", b"1-2", b"1-10", b"1-11", b"1-12"]
    assert merged.inputs.shape == (6, 4)


@settings(max_examples=200, deadline=None)
@given(
    rid=st.from_regex(r"[A-Za-z0-9._:%-]{1,128}", fullmatch=True),
    shape=st.sampled_from([(1,), (1, 4), (3, 2), (2, 1, 5)]),
    dtype=st.sampled_from(["float32", "float64", "int64", "uint8", "bool", "float16"]),
    queued=st.floats(min_value=-5, max_value=1e9),
    infer=st.floats(min_value=0, max_value=1e6),
    rows=st.integers(min_value=0, max_value=1 << 40),
)
def test_the_payload_parts_write_the_bytes_of_encode_reply_ok(
    rid: str, shape: tuple[int, ...], dtype: str, queued: float, infer: float, rows: int
) -> None:
    outputs = np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
    template = ReplyTemplate(("m%d", "v%s"), outputs.dtype, outputs.shape)
    tail = ReplyTemplate.batch_tail(infer, rows)
    head, ok_outputs, model_queued, tail = template.payload_parts(len(rid), tail)
    wait = ReplyTemplate.queued_bytes(np.array([queued]))
    got = head + rid.encode() + ok_outputs + outputs.tobytes() + model_queued + wait + tail
    length = template.reply_length(len(rid), tail)
    want = encode_reply_ok(
        rid,
        outputs,
        ("m%d", "v%s"),
        {"queued_ms": max(0.0, queued), "infer_ms": infer, "batch_rows": rows},
    )
    assert got == want and len(got) == length
