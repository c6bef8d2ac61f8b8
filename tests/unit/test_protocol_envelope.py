"""inferfleet.producer.protocol beyond tensors: names, keys, entries and replies."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from inferfleet.producer import errors
from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import (
    DEFAULT_PREFIX,
    ERROR_CODES,
    GROUP,
    MAX_DEADLINE_DIGITS,
    MAX_MESSAGE_CHARS,
    QueueKeys,
    Reply,
    all_request_ids,
    deadline_open,
    decode_body,
    decode_reply,
    encode_body,
    encode_reply_error,
    encode_reply_ok,
    entry_time_ms,
    is_deadline,
    is_expired,
    is_tenant,
    pack,
    parse_entry,
    reply_timing,
    request_fields,
    tenant_ok,
    validate_name,
    validate_prefix,
    validate_request_id,
)

BODY = encode_body(np.ones((2, 3), np.float32))


def entry(**fields: Any) -> dict[bytes, bytes]:
    """Stream entry fields as redis-py returns them (bytes to bytes)."""
    return {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["a", "ctr", "A.b_c-9", "x" * 64, "0", "..."])
def test_valid_queue_names_are_returned_unchanged(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "x" * 65, "a b", "a:b", "a{b", "a}b", "a/b", "é", "a\n", "a\x00", None, 5, b"ctr"],
    ids=[
        "empty",
        "65-chars",
        "space",
        "colon",
        "open-brace",
        "close-brace",
        "slash",
        "non-ascii",
        "trailing-newline",
        "nul",
        "none",
        "int",
        "bytes",
    ],
)
def test_invalid_queue_names_are_refused(name: Any) -> None:
    with pytest.raises(ProtocolError, match="queue name") as info:
        validate_name(name)
    assert "A-Z a-z 0-9 . _ -" in str(info.value)


@pytest.mark.parametrize("rid", ["a", "r" * 128, "abc-1:2.3_4", "A:B:C", "0-0"])
def test_valid_request_ids_are_returned_as_str(rid: str) -> None:
    assert validate_request_id(rid) == rid
    assert validate_request_id(rid.encode()) == rid


@pytest.mark.parametrize(
    "rid",
    ["", "r" * 129, "a b", "a/b", "a{b}", "é", "a\n", "a\x00", "a*", b"\xff", 5, None],
    ids=[
        "empty",
        "129-chars",
        "space",
        "slash",
        "braces",
        "non-ascii",
        "trailing-newline",
        "nul",
        "star",
        "bad-bytes",
        "int",
        "none",
    ],
)
def test_invalid_request_ids_are_refused(rid: Any) -> None:
    with pytest.raises(ProtocolError, match="request id"):
        validate_request_id(rid)


# --------------------------------------------------------------------------- keys


def test_queue_keys_follow_the_contract() -> None:
    keys = QueueKeys("ctr")
    assert DEFAULT_PREFIX == "inferfleet"
    assert GROUP == "workers"
    assert keys.requests == "inferfleet:{ctr}:requests"
    assert keys.reply("r-1") == "inferfleet:{ctr}:reply:r-1"
    assert keys.inbox("p-abc") == "inferfleet:{ctr}:inbox:p-abc"
    assert keys.dead == "inferfleet:{ctr}:dead"
    assert keys.inbox_prefix == "inferfleet:{ctr}:inbox:"
    assert keys.own("heartbeats") == "inferfleet:{ctr}:heartbeats"


def test_queue_keys_with_a_custom_prefix() -> None:
    keys = QueueKeys("m.v2", prefix="staging")
    assert keys.requests == "staging:{m.v2}:requests"
    assert keys.reply("x") == "staging:{m.v2}:reply:x"
    assert keys.dead == "staging:{m.v2}:dead"


def test_every_key_of_a_queue_shares_one_hash_tag() -> None:
    keys = QueueKeys("q")
    for key in (keys.requests, keys.reply("r"), keys.inbox("i"), keys.dead, keys.own("x")):
        assert key.startswith("inferfleet:{q}:")
        assert key.count("{") == 1 and key.count("}") == 1


@pytest.mark.parametrize(
    "name,prefix", [("a b", "inferfleet"), ("q", "bad prefix"), ("q", ""), ("", "p")]
)
def test_queue_keys_validate_name_and_prefix(name: str, prefix: str) -> None:
    with pytest.raises(ProtocolError):
        QueueKeys(name, prefix)


@pytest.mark.parametrize("suffix", ["", "a{b", "a}b", "a b", "a\nb"])
def test_inbox_refuses_bad_suffixes(suffix: str) -> None:
    with pytest.raises(ProtocolError, match="inbox"):
        QueueKeys("q").inbox(suffix)


def test_is_inbox_accepts_only_this_queues_inbox() -> None:
    keys = QueueKeys("q")
    assert keys.is_inbox("inferfleet:{q}:inbox:x")
    assert keys.is_inbox("inferfleet:{q}:inbox:p-0123:part")
    assert keys.is_inbox(keys.inbox("client-7"))


@pytest.mark.parametrize(
    "key",
    [
        "inferfleet:{q}:inbox:",  # the prefix alone
        "inferfleet:{other}:inbox:x",  # another queue's inbox
        "inferfleet:{qq}:inbox:x",
        "inferfleet:{q}:reply:x",  # a default reply key
        "inferfleet:{q}:requests",  # the request stream itself
        "inferfleet:{q}:dead",
        "other:{q}:inbox:x",  # another prefix
        "inferfleet:{q}:inbox:a{b}",  # braces would move the key to another slot
        "inferfleet:{q}:inbox:a}",
        "inferfleet:{q}:inbox:a b",
        "inferfleet:{q}:inbox:a\n",
        "inferfleet:{q}:inbox:" + "x" * 257,
        "",
        "x",
    ],
)
def test_is_inbox_refuses_everything_else(key: str) -> None:
    assert not QueueKeys("q").is_inbox(key)


def test_is_inbox_length_bound() -> None:
    keys = QueueKeys("q")
    assert keys.is_inbox(keys.inbox_prefix + "x" * 256)
    assert not keys.is_inbox(keys.inbox_prefix + "x" * 257)


def test_entry_time_ms_reads_the_stream_id_timestamp() -> None:
    assert entry_time_ms(b"1700000000123-4") == 1700000000123
    assert entry_time_ms("42-0") == 42


# --------------------------------------------------------------------------- entries


def test_request_fields_minimal_and_full() -> None:
    assert request_fields("r1", b"B") == {"id": "r1", "body": b"B"}
    full = request_fields(
        "r1", b"B", deadline_ms=1700000000123.9, reply_to="inferfleet:{q}:inbox:x"
    )
    assert full == {
        "id": "r1",
        "body": b"B",
        "deadline": "1700000000123",
        "reply_to": "inferfleet:{q}:inbox:x",
    }


def test_parse_entry_reads_every_field() -> None:
    env = parse_entry(
        entry(id="r-1", body=BODY, deadline="1700000000123", reply_to="inferfleet:{q}:inbox:z")
    )
    assert env.rid == "r-1"
    assert env.body == BODY
    assert env.deadline_ms == 1700000000123
    assert env.reply_to == "inferfleet:{q}:inbox:z"
    inputs, _ = decode_body(env.body)
    np.testing.assert_array_equal(inputs, np.ones((2, 3), np.float32))


def test_parse_entry_optional_fields_default_to_none() -> None:
    env = parse_entry(entry(id="r-1", body=BODY))
    assert env.deadline_ms is None
    assert env.reply_to is None


def test_parse_entry_round_trips_request_fields() -> None:
    fields = request_fields("abc", BODY, 123, "inferfleet:{q}:inbox:i")
    env = parse_entry(entry(**fields))
    assert (env.rid, env.body, env.deadline_ms, env.reply_to) == (
        "abc",
        BODY,
        123,
        "inferfleet:{q}:inbox:i",
    )


def test_parse_entry_without_id_has_no_rid() -> None:
    with pytest.raises(ProtocolError, match="'id'") as info:
        parse_entry(entry(body=BODY))
    assert info.value.rid is None
    assert info.value.code == "bad_request"


@pytest.mark.parametrize("rid", [b"a b", b"x" * 129, b"", b"\xff\xfe", b"r{1}"])
def test_parse_entry_with_an_invalid_id_has_no_rid(rid: bytes) -> None:
    with pytest.raises(ProtocolError, match="request id") as info:
        parse_entry({b"id": rid, b"body": BODY})
    assert info.value.rid is None


def test_parse_entry_with_readable_id_but_no_body_keeps_the_rid() -> None:
    with pytest.raises(ProtocolError, match="'body'") as info:
        parse_entry(entry(id="r-9"))
    assert info.value.rid == "r-9"
    assert info.value.code == "bad_request"


@pytest.mark.parametrize(
    "deadline", [b"", b"soon", b"-5", b"1.5", b"12a", b" 12", b"1" * 17, b"\xd9\xa1"]
)
def test_parse_entry_non_decimal_deadline_keeps_the_rid(deadline: bytes) -> None:
    with pytest.raises(ProtocolError, match="deadline") as info:
        parse_entry({b"id": b"r-9", b"body": BODY, b"deadline": deadline})
    assert info.value.rid == "r-9"


def test_parse_entry_non_ascii_reply_to_is_never_an_inbox() -> None:
    keys = QueueKeys("q")
    raw = (keys.inbox_prefix + "é").encode()
    env = parse_entry({b"id": b"r-9", b"body": BODY, b"reply_to": raw})
    assert env.reply_to is not None
    assert not keys.is_inbox(env.reply_to)


def test_parse_entry_ascii_reply_to_is_kept_verbatim() -> None:
    env = parse_entry({b"id": b"r", b"body": BODY, b"reply_to": b"anything:else"})
    assert env.reply_to == "anything:else"


# --------------------------------------------------------------------------- replies


def test_ok_reply_round_trips_outputs_model_and_timing() -> None:
    outputs = {"p": np.array([[0.25], [0.75]], np.float32), "k": np.array([1, 2], np.int64)}
    timing = {"queued_ms": 1.5, "infer_ms": 2.25, "batch_rows": 8}
    reply = decode_reply(encode_reply_ok("r-1", outputs, ("ctr", "v3"), timing))
    assert reply.ok is True
    assert reply.id == "r-1"
    assert reply.model_name == "ctr"
    assert reply.model_version == "v3"
    assert reply.timing == timing
    assert reply.error_code is None and reply.error_message is None
    assert set(reply.outputs) == {"p", "k"}
    np.testing.assert_array_equal(reply.outputs["p"], outputs["p"])
    np.testing.assert_array_equal(reply.outputs["k"], outputs["k"])
    assert reply.raise_for_error() is reply


@pytest.mark.parametrize("form", ["tensor", "list"])
def test_ok_reply_keeps_the_output_form(form: str) -> None:
    a = np.arange(6, dtype=np.float64).reshape(3, 2)
    outputs: Any = a if form == "tensor" else [a, a[:, 0]]
    reply = decode_reply(encode_reply_ok("r", outputs, ("m", "1"), {}))
    if form == "tensor":
        np.testing.assert_array_equal(reply.outputs, a)
    else:
        assert isinstance(reply.outputs, list) and len(reply.outputs) == 2
        np.testing.assert_array_equal(reply.outputs[1], a[:, 0])


@pytest.mark.parametrize("code", ERROR_CODES)
def test_error_reply_round_trips(code: str) -> None:
    data = encode_reply_error("r-2", code, "it broke", ("ctr", "v1"), {"queued_ms": 3.0})
    reply = decode_reply(data)
    assert reply.ok is False
    assert reply.id == "r-2"
    assert reply.error_code == code
    assert reply.error_message == "it broke"
    assert reply.outputs is None
    assert reply.model_name == "ctr" and reply.model_version == "v1"
    assert reply.timing == {"queued_ms": 3.0}


def test_error_reply_without_model_or_timing() -> None:
    reply = decode_reply(encode_reply_error("r", "expired", "late"))
    assert reply.model_name is None and reply.model_version is None
    assert reply.timing == {}


def test_error_reply_message_is_truncated_keeping_its_end() -> None:
    reply = decode_reply(encode_reply_error("r", "model_error", "x" * 10_000 + "the cause"))
    assert len(reply.error_message) == 2000
    assert reply.error_message.startswith("...x") and reply.error_message.endswith("the cause")


@pytest.mark.parametrize("code", ["oops", "", "BAD_REQUEST", "timeout"])
def test_encode_reply_error_refuses_unknown_codes(code: str) -> None:
    with pytest.raises(ValueError, match="unknown error code"):
        encode_reply_error("r", code, "m")


def test_error_codes_are_the_contract_codes() -> None:
    assert set(ERROR_CODES) == {
        "bad_request",
        "too_large",
        "expired",
        "model_error",
        "dead_letter",
        "cancelled",
        "rate_limited",
        "overloaded",
    }  # version 1.1 adds the last three


@pytest.mark.parametrize(
    "code,cls",
    [
        ("bad_request", errors.BadRequest),
        ("too_large", errors.TooLarge),
        ("expired", errors.Expired),
        ("cancelled", errors.Cancelled),
        ("overloaded", errors.Overloaded),
        ("rate_limited", errors.Throttled),
        ("model_error", errors.ModelError),
        ("dead_letter", errors.DeadLetter),
    ],
)
def test_raise_for_error_raises_the_matching_subclass(
    code: str, cls: type[errors.ReplyError]
) -> None:
    reply = decode_reply(encode_reply_error("r-3", code, "why"))
    with pytest.raises(cls) as info:
        reply.raise_for_error()
    exc = info.value
    assert type(exc) is cls
    assert isinstance(exc, errors.ReplyError) and isinstance(exc, errors.InferfleetError)
    assert exc.code == code
    assert exc.reply is reply
    assert exc.message == "why"
    assert "r-3" in str(exc) and code in str(exc)


def test_raise_for_error_with_an_unknown_code_raises_the_base_class() -> None:
    reply = Reply(id="r", ok=False, error_code="brand_new", error_message="m")
    with pytest.raises(errors.ReplyError) as info:
        reply.raise_for_error()
    assert type(info.value) is errors.ReplyError
    assert info.value.code == "brand_new"


@pytest.mark.parametrize(
    "obj",
    [
        [1, 2],
        {"ok": True},
        {"id": 5, "ok": True},
        {"id": "r"},
        b"not a map",
    ],
    ids=["array", "no-id", "int-id", "no-ok", "bin"],
)
def test_decode_reply_refuses_non_replies(obj: Any) -> None:
    with pytest.raises(ProtocolError, match="reply"):
        decode_reply(pack(obj))


def test_decode_reply_refuses_garbage() -> None:
    with pytest.raises(ProtocolError):
        decode_reply(b"\xc1\xc1")


@pytest.mark.parametrize(
    "obj",
    [
        {"id": "r", "ok": True},  # ok without outputs
        {"id": "r", "ok": False, "error": "boom"},  # error not a map
        {"id": "r", "ok": False, "model": "ctr"},  # model not a map
        {
            "id": "r",
            "ok": True,
            "outputs": 5,
        },  # outputs neither tensors nor raw (1.2) text or bytes
    ],
    ids=["ok-no-outputs", "error-str", "model-str", "outputs-str"],
)
def test_decode_reply_malformed_fields_raise_protocol_error(obj: Any) -> None:
    # Every exception the SDK raises derives from InferfleetError (errors.py).
    with pytest.raises(ProtocolError):
        decode_reply(pack(obj))


def test_workers_group_reads_the_xinfo_groups_reply_in_either_encoding() -> None:
    from inferfleet.producer.protocol import GroupInfo, workers_group

    other = {"name": b"audit", "lag": 7, "pending": 1, "last-delivered-id": b"1-0"}
    ours = {"name": b"workers", "lag": 3, "pending": 2, "last-delivered-id": b"5-1"}
    assert workers_group([other, ours]) == GroupInfo(lag=3, pending=2, last_delivered_id="5-1")
    text = {"name": "workers", "lag": None, "pending": "4", "last-delivered-id": "9-0"}
    assert workers_group([text]) == GroupInfo(lag=None, pending=4, last_delivered_id="9-0")
    assert workers_group([other]) is None and workers_group([]) is None


# --------------------------------------------------------------------------- pinned by the mutation
# run (issue 35, docs/benchmarks.md): each rule below had a mutant that no test told apart


def test_a_group_reply_without_pending_or_last_id_reads_as_nothing_delivered() -> None:
    from inferfleet.producer.protocol import GroupInfo, workers_group

    assert workers_group([{"name": b"workers"}]) == GroupInfo(None, 0, "0-0")


def test_an_inbox_suffix_may_hold_any_character_but_braces_space_and_line_ends() -> None:
    keys = QueueKeys("q")
    assert keys.inbox("X-1.a:Z") == "inferfleet:{q}:inbox:X-1.a:Z"
    assert keys.is_inbox("inferfleet:{q}:inbox:X-1.a:Z")


@pytest.mark.parametrize(
    ("prefix", "says"),
    [("bad prefix", "invalid key prefix 'bad prefix'"), ("", "invalid key prefix ''")],
)
def test_a_refused_prefix_is_named_with_the_rule(prefix: str, says: str) -> None:
    with pytest.raises(ProtocolError, match=f"^{says}: use 1 to 64 characters of A-Z a-z 0-9 "):
        validate_prefix(prefix)


def test_a_refused_request_id_is_shown_in_the_error() -> None:
    with pytest.raises(ProtocolError, match=r"^invalid request id 'a b': use 1 to 128 bytes "):
        validate_request_id("a b")


def test_the_joined_id_check_is_false_for_an_item_that_is_not_bytes() -> None:
    assert all_request_ids([b"a", b"b"])
    assert not all_request_ids([b"a", "b"])  # type: ignore[list-item]
    assert not all_request_ids([b"a", None])  # type: ignore[list-item]


def test_a_deadline_is_one_to_sixteen_digits_and_expires_only_after_it_passes() -> None:
    assert MAX_DEADLINE_DIGITS == 16
    assert is_deadline(b"9" * 16) and not is_deadline(b"9" * 17) and not is_deadline(b"")
    assert not is_expired(1000, 1000.0)  # picked up at the deadline itself: still in time
    assert is_expired(1000, 1000.5)
    assert deadline_open(b"1000", 1000.0) and not deadline_open(b"1000", 1001.0)
    for raw in ("1000", 1000, None, bytearray(b"1000")):  # only bytes reach the fast paths
        assert not deadline_open(raw, 0.0)


@pytest.mark.parametrize("tenant", [b"", b"a b", b"x" * 65, b"caf\xc3\xa9", "nightly"])
def test_an_entry_with_a_bad_tenant_is_refused_keeping_its_id(tenant: object) -> None:
    fields = {b"id": b"r-9", b"body": BODY, b"tenant": tenant}
    assert not tenant_ok(fields)
    says = r"^tenant must be 1 to 64 characters of A-Z a-z 0-9 \. _ : @ -, got "
    with pytest.raises(ProtocolError, match=says) as info:
        parse_entry(fields)  # type: ignore[arg-type]
    assert info.value.rid == "r-9" and info.value.code == "bad_request"


@pytest.mark.parametrize("tenant", [b"nightly", b"a", b"x" * 64, b"team.a_b:c@d-1"])
def test_an_entry_with_a_good_tenant_or_none_is_read(tenant: bytes) -> None:
    assert is_tenant(tenant)
    assert tenant_ok({b"tenant": tenant}) and tenant_ok({})
    assert parse_entry({b"id": b"r-9", b"body": BODY, b"tenant": tenant}).rid == "r-9"


def test_a_field_that_is_not_bytes_counts_as_missing() -> None:
    with pytest.raises(ProtocolError, match="no 'id' field") as info:
        parse_entry({b"id": "r-9", b"body": BODY})  # type: ignore[dict-item]
    assert info.value.rid is None


def test_request_fields_carry_the_traceparent() -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert request_fields("r1", b"B", traceparent=tp) == {
        "id": "r1",
        "body": b"B",
        "traceparent": tp,
    }


def test_the_timing_map_has_the_contract_keys_in_order_and_no_negative_wait() -> None:
    timing = reply_timing(12.5, 3.25, 8)
    assert list(timing.items()) == [("queued_ms", 12.5), ("infer_ms", 3.25), ("batch_rows", 8)]
    assert reply_timing(-40.0, 1.0, 1)["queued_ms"] == 0.0  # two machines' clocks
    assert reply_timing(0.5, 1.0, 1)["queued_ms"] == 0.5


def test_a_message_of_exactly_the_longest_length_is_kept_whole() -> None:
    message = "y" * MAX_MESSAGE_CHARS
    assert decode_reply(encode_reply_error("r", "model_error", message)).error_message == message


def test_a_failed_reply_without_a_message_has_an_empty_one() -> None:
    reply = decode_reply(pack({"id": "r", "ok": False, "error": {"code": "model_error"}}))
    assert reply.error_code == "model_error" and reply.error_message == ""


def test_an_ok_reply_is_read_with_the_output_limits_not_the_input_ones() -> None:
    outputs = {f"o{i}": np.zeros((1, 1), np.uint8) for i in range(65)}  # a request: 64 most
    reply = decode_reply(encode_reply_ok("r", outputs, ("m", "1"), {}))
    assert isinstance(reply.outputs, dict) and len(reply.outputs) == 65


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        ({"id": "r", "ok": True}, "an ok reply must carry 'outputs'"),
        (
            {"id": "r", "ok": False, "error": "boom"},
            "a failed reply must carry 'error': {'code': STR, 'message': STR}",
        ),
        ({"id": "r", "ok": False, "model": "ctr"}, "reply 'model' and 'timing' must be maps"),
        ({"id": "r", "ok": True, "timing": [1]}, "reply 'model' and 'timing' must be maps"),
        ({"id": 5, "ok": True}, "reply must be a map with a string 'id' and a boolean 'ok'"),
        (
            {"id": "r", "ok": True, "outputs": {"dtype": "float32", "shape": [1], "data": b""}},
            "outputs: shape [1] of float32 needs 4 bytes, data has 0",
        ),
    ],
)
def test_a_malformed_reply_says_what_is_wrong_with_it(obj: Any, says: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_reply(pack(obj))
    assert str(info.value) == says


def test_a_malformed_deadline_says_what_docs_protocol_md_shows() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_entry({b"id": b"r", b"body": BODY, b"deadline": b"12.5"})
    assert str(info.value) == "deadline must be decimal unix epoch milliseconds, got b'12.5'"
