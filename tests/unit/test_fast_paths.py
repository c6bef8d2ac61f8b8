"""The worker's fast paths give exactly what the general paths give.

Intake's template path (a body that fits one learnt from an admitted body)
must admit, refuse and expire as :meth:`Intake.admit` does; the reply
template must write the bytes :func:`encode_reply_ok` writes. Each test
warms the fast path first, then compares it with the general one on the
same entry.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferfleet.producer.protocol import (
    Limits,
    QueueKeys,
    decode_body,
    encode_body,
    encode_reply_ok,
)
from inferfleet.worker.connections import stream_entries
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.consumer import encode_answer
from inferfleet.worker.serving.intake import Answer, Intake, fields_of
from inferfleet.worker.serving.replies import BatchEncoder
from inferfleet.worker.serving.templates import BodyTemplate, ReplyTemplate
from tests.helpers import warmed_intake

KEYS = QueueKeys("q")
MODEL = ("q-model", "v7")
NOW_MS = 1_700_000_000_500
INBOX = KEYS.inbox("p1").encode()


#: What the warmed intakes learn (tests/helpers.py ``warmed_intake``): float32[1,4] bodies.
LEARNT = (encode_body(np.zeros((1, 4), np.float32)),)


def same(a: Request | Answer, b: Request | Answer) -> None:
    assert type(a) is type(b)
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
    np.testing.assert_array_equal(a.inputs, b.inputs)
    assert a.inputs.dtype == b.inputs.dtype


rids = st.one_of(st.from_regex(rb"[A-Za-z0-9._:-]{1,20}", fullmatch=True), st.binary(max_size=8))
bodies = st.one_of(
    st.builds(
        lambda v: encode_body(np.full((1, 4), v, np.float32)), st.floats(width=32, allow_nan=False)
    ),
    st.builds(lambda: encode_body(np.zeros((2, 4), np.float32))),
    st.builds(lambda: encode_body(np.zeros((1, 4), np.float64))),
    st.builds(lambda: encode_body(np.zeros((1, 4), np.float32), {"t": 1})),
    st.builds(
        lambda b: encode_body(np.zeros((1, 4), np.float32))[:-4] + b,
        st.binary(min_size=4, max_size=4),
    ),
    st.binary(min_size=0, max_size=80),
)
deadlines = st.one_of(
    st.none(), st.sampled_from([b"1700000000400", b"1700000000600", b"12x", b"-5", b""])
)
reply_tos = st.one_of(
    st.none(), st.sampled_from([INBOX, KEYS.inbox("p2").encode(), b"elsewhere", b"\xff"])
)


@settings(max_examples=300, deadline=None)
@given(rid=rids, body=bodies, deadline=deadlines, reply_to=reply_tos)
def test_the_template_path_decides_as_the_general_path(
    rid: bytes, body: bytes, deadline: bytes | None, reply_to: bytes | None
) -> None:
    entry = {b"id": rid, b"body": body}
    if deadline is not None:
        entry[b"deadline"] = deadline
    if reply_to is not None:
        entry[b"reply_to"] = reply_to
    entry_id = b"1700000000123-7"
    same(
        warmed_intake(KEYS, MODEL, LEARNT, INBOX, NOW_MS).admit_fast(entry_id, entry, NOW_MS),
        Intake(KEYS, Limits(), MODEL).admit(entry_id, entry, NOW_MS),
    )


def test_the_template_path_is_taken_and_keeps_the_model_checks() -> None:
    intake = warmed_intake(KEYS, MODEL, LEARNT, INBOX, NOW_MS, input_spec=None)
    body = encode_body(np.ones((1, 4), np.float32))
    template, _ = intake._templates[len(body)]  # the template learnt from the warm-up entry
    assert template.inputs_of(body) is not None
    strict = Intake(KEYS, Limits(), MODEL, accepts_params=False)
    params_body = encode_body(np.ones((1, 4), np.float32), {"a": 1})
    assert (
        BodyTemplate.learn(params_body, *decode_body(params_body)) is None
    )  # params are never templated
    assert isinstance(
        strict.admit_fast(b"1-0", {b"id": b"r", b"body": params_body}, NOW_MS), Answer
    )


def test_a_look_alike_body_does_not_fit_the_template() -> None:
    body = encode_body(np.ones((1, 4), np.float32))
    template = BodyTemplate.learn(body, *decode_body(body))
    assert template is not None
    np.testing.assert_array_equal(
        template.inputs_of(encode_body(np.full((1, 4), 7, np.float32))),
        np.full((1, 4), 7, np.float32),
    )
    assert (
        template.inputs_of(encode_body(np.ones((1, 4), np.int32))) is None
    )  # same length, other dtype
    assert (
        template.inputs_of(encode_body(np.ones((2, 2), np.float32))) is None
    )  # same length, other shape
    assert template.inputs_of(body + b"\x00") is None and template.inputs_of(body[:-1]) is None


@settings(max_examples=200, deadline=None)
@given(
    rid=st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True),
    shape=st.sampled_from([(1,), (1, 4), (3, 2), (2, 1, 5)]),
    dtype=st.sampled_from(["float32", "float64", "int64", "uint8", "bool", "float16"]),
    queued=st.floats(min_value=0, max_value=1e9),
    infer=st.floats(min_value=0, max_value=1e6),
    rows=st.integers(min_value=0, max_value=1 << 40),
)
def test_the_reply_template_writes_the_bytes_of_encode_reply_ok(
    rid: str, shape: tuple[int, ...], dtype: str, queued: float, infer: float, rows: int
) -> None:
    outputs = np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
    timing = {"queued_ms": queued, "infer_ms": infer, "batch_rows": rows}
    template = ReplyTemplate(MODEL, outputs.dtype, outputs.shape)
    got = template.encode(rid, outputs.tobytes(), queued, ReplyTemplate.batch_tail(infer, rows))
    assert got == encode_reply_ok(rid, outputs, MODEL, timing)


def _request(rid: str, rows: int = 1) -> Request:
    return Request(
        b"1-0", rid, KEYS.reply(rid), np.zeros((rows, 4), np.float32), {}, rows, None, 100, 104.5
    )


def test_the_batch_encoder_answers_as_encode_answer_for_every_kind_of_result() -> None:
    batch = [_request(f"r{i}") for i in range(6)]
    results: list[Any] = [
        np.ones((1, 2), np.float32),
        np.ones((1, 2), np.float32),
        ValueError("boom"),
        [np.ones((1, 2)), np.zeros((1, 1))],
        np.ones((1, 2), np.complex64),
        np.ones((1, 2), np.float32).byteswap().view(np.dtype(">f4")),
    ]
    got = BatchEncoder(MODEL, encode_answer).encode(batch, results, 2.5, 6)
    want = [encode_answer(MODEL, req, res, 2.5, 6) for req, res in zip(batch, results)]
    assert got == want
    assert [a.ok for a in got] == [True, True, False, True, False, True]


@pytest.mark.parametrize(
    "response",
    [
        {b"s": [[b"1-0", [b"id", b"a", b"body", b"x"]]]},  # RESP3, raw
        [[b"s", [[b"1-0", [b"id", b"a", b"body", b"x"]]]]],  # RESP2, raw
        [[b"s", [(b"1-0", {b"id": b"a", b"body": b"x"})]]],  # redis-py's parsed form
    ],
)
def test_stream_entries_reads_every_reply_form(response: Any) -> None:
    ((entry_id, fields),) = stream_entries(response)
    assert entry_id == b"1-0"
    assert (fields if isinstance(fields, dict) else fields_of(fields)) == {
        b"id": b"a",
        b"body": b"x",
    }
    assert stream_entries(None) == [] and stream_entries([]) == [] and stream_entries({}) == []


def test_fields_of_keeps_a_deleted_entry_none() -> None:
    assert (
        fields_of(None) is None
        and fields_of([]) == {}
        and fields_of([b"a", b"1", b"a", b"2"]) == {b"a": b"2"}
    )
