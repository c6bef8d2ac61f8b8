"""The request envelope: the fields of one stream entry and its msgpack ``body``.

:func:`request_fields` builds the fields of one entry; :func:`parse_entry`
reads them back with the field rules of :mod:`.rules`, and
:func:`decode_body` decodes the body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol.codec import (
    DEFAULT_LIMITS,
    Inputs,
    Limits,
    decode_inputs,
    encode_inputs,
    pack,
    unpack,
)
from inferfleet.producer.protocol.rules import (
    decode_reply_to,
    parse_deadline,
    tenant_ok,
    validate_request_id,
)

__all__ = ["Envelope", "decode_body", "encode_body", "parse_entry", "request_fields"]

_BODY_KEYS = frozenset({"inputs", "params"})


def encode_body(inputs: Any, params: Mapping[str, Any] | None = None) -> bytes:
    """The msgpack ``body`` field of a request."""
    body: dict[str, Any] = {"inputs": encode_inputs(inputs)}
    if params:
        body["params"] = dict(params)
    try:
        return pack(body)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"params cannot be encoded as msgpack: {exc}") from exc


def request_fields(
    rid: str,
    body: bytes,
    deadline_ms: int | None = None,
    reply_to: str | None = None,
    traceparent: str | None = None,
    stream: bool = False,
) -> dict[str, bytes | str]:
    """The fields of one request stream entry (for ``XADD ... *``); ``stream`` asks for the
    outputs in chunks (contract 1.3, :mod:`.stream`)."""
    fields: dict[str, bytes | str] = {"id": rid, "body": body}
    if stream:
        fields["stream"] = "1"
    if deadline_ms is not None:
        fields["deadline"] = str(int(deadline_ms))
    if reply_to is not None:
        fields["reply_to"] = reply_to
    if traceparent is not None:
        fields["traceparent"] = traceparent
    return fields


@dataclass(frozen=True)
class Envelope:
    """The fields of a request entry, read but with the body not yet decoded."""

    rid: str
    body: bytes
    deadline_ms: int | None
    reply_to: str | None


def _field(fields: Mapping[bytes, bytes], name: bytes) -> bytes | None:
    value = fields.get(name)
    return value if value is None or isinstance(value, bytes) else None


def parse_entry(fields: Mapping[bytes, bytes]) -> Envelope:
    """Read the fields of one request entry.

    Raises ProtocolError when a field is missing or malformed. The request id
    is read first so a caller can still address an error reply: on failure,
    ``exc.rid`` is the valid request id or None.
    """
    raw_rid = _field(fields, b"id")
    rid: str | None = None
    try:
        if raw_rid is None:
            raise ProtocolError("entry has no 'id' field")
        rid = validate_request_id(raw_rid)
        body = _field(fields, b"body")
        if body is None:
            raise ProtocolError("entry has no 'body' field")
        if not tenant_ok(fields):
            raise ProtocolError(
                "tenant must be 1 to 64 characters of A-Z a-z 0-9 . _ : @ -, "
                f"got {fields[b'tenant']!r:.80}"
            )
        return Envelope(
            rid, body, parse_deadline(_field(fields, b"deadline")), _parse_reply_to(fields)
        )
    except ProtocolError as exc:
        exc.rid = rid  # type: ignore[attr-defined]
        raise


def _parse_reply_to(fields: Mapping[bytes, bytes]) -> str | None:
    if b"reply_to" not in fields:
        return None
    key = decode_reply_to(fields[b"reply_to"])
    return "\x00" if key is None else key  # never an inbox key: the worker refuses it


def decode_body(body: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[Inputs, dict]:
    """Decode a request ``body`` into (inputs, params). Raises ProtocolError."""
    obj = unpack(body, limits)
    if not isinstance(obj, dict) or "inputs" not in obj or not obj.keys() <= _BODY_KEYS:
        raise ProtocolError("body must be a map with 'inputs' and optionally 'params'")
    params = obj.get("params")
    if params is None:  # absent, or nil as some msgpack libraries write an unset field
        params = {}
    if not isinstance(params, dict) or len(params) > limits.max_params:
        raise ProtocolError(f"params must be a map of at most {limits.max_params} entries")
    return decode_inputs(obj["inputs"], limits), params
