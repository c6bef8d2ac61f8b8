"""The streamed reply's wire rules (producer/protocol/stream.py), pure: a chunk's fields and
bodies, and a reader's rule over a stream of them."""

from __future__ import annotations

import numpy as np
import pytest

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import (
    Chunk,
    StreamFold,
    chunk_fields,
    encode_chunk,
    encode_final,
    encode_reply_error,
    parse_chunk,
    request_fields,
    wants_stream,
)

MODEL = ("tokens", "1")


def _entry(n: int, attempt: int = 1, final: bool = False, body: bytes | None = None) -> dict:
    body = body if body is not None else encode_chunk("r1", [n])
    fields = chunk_fields(n, attempt, final, body)
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


def _chunk(n: int, attempt: int = 1, final: bool = False) -> Chunk:
    body = encode_final("r1", [n], "stop", MODEL, {"tokens": n + 1}) if final else None
    return parse_chunk(f"1-{n}".encode(), _entry(n, attempt, final, body))


def test_a_request_asks_for_a_stream_with_one_field():
    fields = request_fields("r1", b"body", stream=True)
    assert fields["stream"] == "1"
    assert wants_stream(
        {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
    )
    assert "stream" not in request_fields("r1", b"body")
    assert not wants_stream({b"stream": b"0"}) and not wants_stream({})


def test_chunks_round_trip_their_number_attempt_tokens_and_end():
    middle = _chunk(3, attempt=2)
    assert (middle.n, middle.attempt, middle.final, middle.entry_id) == (3, 2, False, "1-3")
    assert middle.tokens.tolist() == [3] and middle.tokens.dtype == np.int64
    last = _chunk(4, final=True)
    assert last.final and last.finish_reason == "stop" and last.reply.timing == {"tokens": 5}
    assert last.reply.model_version == "1"
    error = parse_chunk(
        b"1-5", _entry(5, final=True, body=encode_reply_error("r1", "expired", "late"))
    )
    assert error.reply.error_code == "expired" and error.tokens.size == 0


@pytest.mark.parametrize(
    "change, said",
    [
        ({b"n": b"-1"}, "'n' must be an integer"),
        ({b"n": b"x"}, "'n' must be an integer"),
        ({b"attempt": b"0"}, "'attempt' must be an integer >= 1"),
        ({b"final": b"yes"}, "'final' must be 0 or 1"),
        ({b"body": None}, "no 'body'"),
        ({b"final": b"1"}, "finish_reason"),  # an ok final chunk must say why it ended
    ],
)
def test_a_malformed_chunk_is_a_protocol_error(change, said):
    fields = {**_entry(0), **change}
    with pytest.raises(ProtocolError, match=said):
        parse_chunk(b"1-0", {k: v for k, v in fields.items() if v is not None})


def test_encode_final_takes_only_the_contract_reasons():
    with pytest.raises(ValueError, match="finish_reason"):
        encode_final("r1", [1], "tired", MODEL, {})


def test_a_reader_takes_each_chunk_once_in_order_across_attempts():
    fold = StreamFold()
    assert fold.take(_chunk(0)) is not None
    assert fold.take(_chunk(0)) is None  # read again from an older id: skipped
    assert fold.take(_chunk(1, attempt=2)) is not None  # a takeover numbers on
    assert (fold.next_n, fold.attempt, fold.last_id) == (2, 2, "1-1")
    with pytest.raises(ProtocolError, match="chunk 3 of attempt 2 after chunk 1"):
        fold.take(_chunk(3, attempt=2))  # a gap
    assert fold.take(_chunk(2, final=True)) is not None and fold.done
    with pytest.raises(ProtocolError, match=r"\(final\)"):
        fold.take(_chunk(3))


def test_a_reader_resuming_from_an_id_counts_on_from_its_first_chunk():
    fold = StreamFold(last_id="1-6", next_n=None)
    assert fold.take(_chunk(7)) is not None and fold.next_n == 8
    with pytest.raises(ProtocolError):
        fold.take(_chunk(9))
