"""Each wire rule's fast path against its general definition, on the same generated inputs.

The request-id rule has a general check (one id: ``is_request_id``, ``validate_request_id``)
and fast ones built from the same pattern (many ids joined by newlines: ``all_request_ids``,
``validate_request_ids``, the columnar admission's per-read check). Edge cases come first: a
newline inside an id (``ab\\ncd`` reads as two valid ids once joined), 128 and 129 bytes, empty,
non-ASCII, and reads that mix valid and invalid ids.

The deadline rule likewise: ``deadline_open`` (the fast paths' test) against the envelope's
parse and ``is_expired``, on malformed, 16- and 17-digit and just-passed deadlines. The
tenant and ``reply_to`` rules: the template admission (``Intake.admit_fast`` once warmed) and
the columnar one against the general intake. The reply's layout: the SDK's readers of a reply's
first bytes (``peek_reply``, ``lazy_replies``) against ``decode_reply``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import (
    REQUEST_ID_PATTERN,
    Limits,
    all_request_ids,
    deadline_open,
    decode_reply,
    encode_reply_error,
    encode_reply_ok,
    is_expired,
    is_request_id,
    lazy_replies,
    parse_entry,
    peek_reply,
    validate_request_id,
    validate_request_ids,
)
from inferfleet.worker.serving.batching import Request
from inferfleet.worker.serving.columns import admit_read
from inferfleet.worker.serving.intake import Intake
from tests.unit.test_columns import BODY, INBOX, KEYS, MODEL, NOW_MS, same, unpacked, warmed

EDGES = [b"ab\ncd", b"ab\n", b"\nab", b"\n", b"", b"x" * 128, b"x" * 129, "é".encode(), b"a b"]

ids = st.one_of(
    st.sampled_from(EDGES),
    st.from_regex(REQUEST_ID_PATTERN.encode(), fullmatch=True),
    st.binary(max_size=8),
    st.lists(st.from_regex(rb"[a-z]{1,4}", fullmatch=True), min_size=2, max_size=3).map(b"\n".join),
)
reads = st.lists(ids, max_size=12)


def _general(rid: bytes) -> bool:
    try:
        validate_request_id(rid)
    except ProtocolError:
        return False
    return True


@pytest.mark.parametrize("rid", EDGES)
def test_the_edge_cases_are_decided_by_the_contract(rid: bytes) -> None:
    assert is_request_id(rid) is (rid == b"x" * 128)
    assert all_request_ids([rid]) is (rid == b"x" * 128)
    assert all_request_ids([b"ok", rid, b"fine"]) is (rid == b"x" * 128)


@settings(max_examples=500, deadline=None)
@given(read=reads)
@example(read=[b"ab\ncd"])
@example(read=[b"ok", b"ab\ncd"])
@example(read=[b"ab\ncd", b"\n"])
def test_the_joined_check_agrees_with_the_one_id_check(read: list[bytes]) -> None:
    each = [is_request_id(rid) for rid in read]
    assert each == [_general(rid) for rid in read]
    assert all_request_ids(read) is all(each)


@settings(max_examples=300, deadline=None)
@given(read=reads)
@example(read=[b"ab\ncd"])
def test_the_sdks_many_ids_check_agrees_with_its_one_id_check(read: list[bytes]) -> None:
    texts = [rid.decode("utf-8", "replace") for rid in read]
    each = [_general(text.encode()) for text in texts]
    if all(each):
        assert validate_request_ids(texts) == texts
    else:
        with pytest.raises(ProtocolError):
            validate_request_ids(texts)


@settings(max_examples=200, deadline=None)
@given(read=st.lists(ids, min_size=1, max_size=8))
@example(read=[b"ab\ncd"])
@example(read=[b"ok", b"ab\ncd", b"fine"])
@example(read=[b"ab\ncd", b"\n"])
def test_the_columnar_admission_answers_each_id_as_the_general_intake(read: list[bytes]) -> None:
    raw = [[b"1700000000%03d-0" % i, [b"id", rid, b"body", BODY]] for i, rid in enumerate(read)]
    got = unpacked(admit_read(warmed(), raw, NOW_MS))
    general = Intake(KEYS, Limits(), MODEL)
    for (entry_id, _), rid in zip(raw, read):
        same(got[entry_id], general.admit(entry_id, {b"id": rid, b"body": BODY}, NOW_MS))
        assert isinstance(got[entry_id], Request) is is_request_id(rid)


NOW = 1_700_000_000_500
DEADLINE_EDGES = [
    b"",
    b"-1",
    b" 1700000000600",
    b"1700000000600 ",
    b"17000000006.0",
    "\u0661\u0667".encode(),  # Arabic-Indic digits: not decimal ASCII
    b"1" * 16,
    b"1" * 17,
    b"0" * 16 + b"1",
    str(NOW).encode(),
    str(NOW - 1).encode(),
    str(NOW + 1).encode(),
]
deadlines = st.one_of(
    st.sampled_from(DEADLINE_EDGES),
    st.integers(NOW - 10, NOW + 10).map(lambda ms: str(ms).encode()),
    st.from_regex(rb"[0-9]{1,18}", fullmatch=True),
    st.binary(max_size=18),
)


def _general_deadline_open(raw: bytes, now_ms: float) -> bool:
    """What the general path decides: a parsed deadline that has not passed."""
    try:
        envelope = parse_entry({b"id": b"r1", b"body": b"\x80", b"deadline": raw})
    except ProtocolError:
        return False
    return envelope.deadline_ms is not None and not is_expired(envelope.deadline_ms, now_ms)


@settings(max_examples=500, deadline=None)
@given(raw=deadlines, now_ms=st.sampled_from([NOW, NOW + 0.5, float(NOW - 1)]))
@example(raw=str(NOW).encode(), now_ms=NOW)
@example(raw=b"1" * 17, now_ms=NOW)
def test_the_fast_deadline_check_agrees_with_the_envelopes(raw: bytes, now_ms: float) -> None:
    assert deadline_open(raw, now_ms) is _general_deadline_open(raw, now_ms)


@settings(max_examples=150, deadline=None)
@given(raw=deadlines)
def test_the_columnar_admission_decides_each_deadline_as_the_general_intake(raw: bytes) -> None:
    fields = {b"id": b"r1", b"body": BODY, b"deadline": raw}
    entry = [b"1700000000001-0", [part for pair in fields.items() for part in pair]]
    got = unpacked(admit_read(warmed(), [entry], NOW_MS))
    same(got[entry[0]], Intake(KEYS, Limits(), MODEL).admit(entry[0], fields, NOW_MS))


TENANT_EDGES = [b"", b"t", b"a" * 64, b"a" * 65, b"a b", b"a\n", b"acme@eu", "é".encode(), b"{x}"]
tenants = st.one_of(st.sampled_from(TENANT_EDGES), st.binary(max_size=66))


@settings(max_examples=300, deadline=None)
@given(tenant=tenants)
def test_the_template_admission_decides_each_tenant_as_the_general_intake(tenant: bytes) -> None:
    fields = {b"id": b"r1", b"body": BODY, b"tenant": tenant}
    entry_id = b"1700000000001-0"
    fast = warmed().admit_fast(entry_id, fields, NOW_MS)
    same(fast, Intake(KEYS, Limits(), MODEL).admit(entry_id, fields, NOW_MS))


REPLY_TO_EDGES = [INBOX, INBOX + b"x", KEYS.inbox_prefix.encode(), b"elsewhere", b"", "é".encode()]
reply_tos = st.one_of(st.sampled_from(REPLY_TO_EDGES), st.binary(max_size=40).map(INBOX.__add__))


@settings(max_examples=200, deadline=None)
@given(reply_to=reply_tos)
def test_every_admission_path_decides_each_reply_to_as_the_general_intake(reply_to: bytes) -> None:
    fields = {b"id": b"r1", b"body": BODY, b"reply_to": reply_to}
    entry_id = b"1700000000001-0"
    general = Intake(KEYS, Limits(), MODEL).admit(entry_id, fields, NOW_MS)
    same(warmed().admit_fast(entry_id, fields, NOW_MS), general)
    entry = [entry_id, [part for pair in fields.items() for part in pair]]
    same(unpacked(admit_read(warmed(), [entry], NOW_MS))[entry_id], general)


reply_ids = st.one_of(
    st.sampled_from(["r", "x" * 31, "x" * 32, "x" * 128, "x" * 255, "x" * 256, "é" * 20]),
    st.text(min_size=1, max_size=300),
)


@settings(max_examples=300, deadline=None)
@given(rid=reply_ids, ok=st.booleans(), with_model=st.booleans())
def test_the_sdks_reply_readers_agree_with_decode_reply(
    rid: str, ok: bool, with_model: bool
) -> None:
    model = ("m", "v1") if with_model or ok else None
    if ok:
        raw = encode_reply_ok(rid, np.ones((1, 2), np.float32), ("m", "v1"), {"queued_ms": 1.0})
    else:
        raw = encode_reply_error(rid, "model_error", "boom", model)
    full = decode_reply(raw)
    # peek_reply reads ids of up to 255 bytes (all the fleet writes); longer ones are decoded.
    fast = peek_reply(raw)
    assert fast == (full.id, full.ok) if len(rid.encode()) < 256 else fast in (None, (rid, ok))
    (lazy,) = lazy_replies([raw])
    assert (lazy.id, lazy.ok, lazy.error_code, lazy.error_message) == (
        full.id,
        full.ok,
        full.error_code,
        full.error_message,
    )
    assert (lazy.model_name, lazy.timing) == (full.model_name, full.timing)
    if ok:
        assert lazy.outputs.tobytes() == full.outputs.tobytes()
