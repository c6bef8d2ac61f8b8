"""The SDK's fast paths: the same bytes as the general functions, for thousands a call.

What the producer does per request when it sends or collects many in one
call: a request body written from parts located in one encoded by
:func:`~inferfleet.producer.protocol.request.encode_body` (:class:`BodyEncoder`),
a reply's id and ok read straight off its first bytes and the rest decoded
only when asked for (:func:`lazy_replies`). tests/unit/test_protocol_fast_paths.py
holds each to its general function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol.codec import DTYPES, Inputs, pack
from inferfleet.producer.protocol.reply import (
    ID_KEY,
    OK_FALSE,
    OK_TRUE,
    STR_HEADERS,
    Reply,
    decode_reply,
)
from inferfleet.producer.protocol.request import encode_body

__all__ = ["BodyEncoder", "LazyReply", "lazy_replies", "lazy_reply", "peek_reply"]

_TEMPLATE_DTYPES = frozenset(DTYPES.values())


class BodyEncoder:
    """:func:`encode_body` for the many inputs of one call, with the same bytes.

    The body of a lone C-contiguous tensor is ``prefix + data + suffix``, and
    that of a map of them ``part + data + part + data ... + suffix``: the
    parts (map headers, names, dtypes, shapes, bin headers) depend only on
    the names, dtypes and shapes, the suffix only on ``params``. They are
    worked out once per layout and proved (the parts around flipped data
    must give :func:`encode_body`'s bytes too); each body after that is a
    concatenation. Every other input goes through :func:`encode_body`.
    """

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = params
        self._around: dict[tuple[Any, tuple[int, ...]], tuple[bytes, bytes] | None] = {}
        self._maps: dict[tuple, tuple[bytes, ...] | None] = {}

    def encode(self, inputs: Any) -> bytes:
        """The ``body`` field of a request for ``inputs`` (ProtocolError as encode_body)."""
        if inputs.__class__ is np.ndarray and inputs.flags.c_contiguous:
            key = (inputs.dtype, inputs.shape)
            around = self._around[key] if key in self._around else self._learn(key, inputs)
            if around is not None:
                return around[0] + inputs.tobytes() + around[1]
        elif inputs.__class__ is dict:
            return self._encode_map(inputs)
        return encode_body(inputs, self._params)

    def _encode_map(self, inputs: dict) -> bytes:
        arrays = list(inputs.values())
        if not all(a.__class__ is np.ndarray and a.flags.c_contiguous for a in arrays):
            return encode_body(inputs, self._params)
        key = tuple((name, a.dtype, a.shape) for name, a in inputs.items())
        parts = self._maps[key] if key in self._maps else self._learn_map(key, inputs)
        if parts is None:
            return encode_body(inputs, self._params)
        pieces = [parts[0]]
        for arr, part in zip(arrays, parts[1:]):
            pieces.append(arr.tobytes())
            pieces.append(part)
        return b"".join(pieces)

    def _learn_map(self, key: tuple, inputs: dict) -> tuple[bytes, ...] | None:
        body = encode_body(
            inputs, self._params
        )  # raises for what the contract refuses, as it would
        parts: tuple[bytes, ...] | None = None
        if len(self._maps) < 64 and all(
            a.dtype in _TEMPLATE_DTYPES and a.size for a in inputs.values()
        ):
            parts = _split_around(body, [a.tobytes() for a in inputs.values()])
            flipped = {name: _flipped(a) for name, a in inputs.items()}
            if parts is not None and _joined(parts, flipped) != encode_body(flipped, self._params):
                parts = None
        self._maps[key] = parts
        return parts

    def _learn(
        self, key: tuple[Any, tuple[int, ...]], arr: np.ndarray
    ) -> tuple[bytes, bytes] | None:
        body = encode_body(arr, self._params)  # raises for what the contract refuses, as it would
        around = None
        if arr.dtype in _TEMPLATE_DTYPES and arr.size:
            data = arr.tobytes()
            suffix = pack("params") + pack(dict(self._params)) if self._params else b""
            prefix = body[: len(body) - len(data) - len(suffix)]
            if prefix + data + suffix == body:
                around = (prefix, suffix)
        self._around[key] = around
        return around


def _split_around(body: bytes, datas: list[bytes]) -> tuple[bytes, ...] | None:
    """``body`` cut around each of ``datas`` in order: the bytes before, between and after them."""
    parts, start = [], 0
    for data in datas:
        at = body.find(data, start)
        if at < 0:
            return None
        parts.append(body[start:at])
        start = at + len(data)
    parts.append(body[start:])
    return tuple(parts)


def _flipped(arr: np.ndarray) -> np.ndarray:
    """``arr`` with every byte of its data inverted (the same dtype and shape)."""
    return (np.frombuffer(arr.tobytes(), np.uint8) ^ 0xFF).view(arr.dtype).reshape(arr.shape)


def _joined(parts: tuple[bytes, ...], inputs: dict) -> bytes:
    pieces = [parts[0]]
    for arr, part in zip(inputs.values(), parts[1:]):
        pieces += [arr.tobytes(), part]
    return b"".join(pieces)


def peek_reply(raw: bytes) -> tuple[str, bool] | None:
    """``(id, ok)`` of a reply that starts ``{"id": STR, "ok": BOOL, ...}``, as the fleet writes.

    Reads the msgpack bytes directly; None for any other layout (which
    :func:`decode_reply` then reads in full).
    """
    span = _id_span(raw)
    if span is None:
        return None
    start, end = span
    if raw.startswith(OK_TRUE, end):
        ok = True
    elif raw.startswith(OK_FALSE, end):
        ok = False
    else:
        return None
    try:
        return raw[start:end].decode("utf-8"), ok
    except UnicodeDecodeError:
        return None


# Where a reply's id header lies, after the map's one-byte header and ID_KEY.
_ID_AT = 1 + len(ID_KEY)
# A map of 2 to 15 entries has a one-byte header; every reply has 4 or 5 entries.
_MAP_HEADERS = frozenset(pack(dict.fromkeys(range(n)))[0] for n in range(2, 16))
# The one-byte str headers (lengths 0 to 31) are consecutive; then a two-byte one.
_FIXSTR, _FIXSTR_COUNT = STR_HEADERS[0][0], sum(len(h) == 1 for h in STR_HEADERS)
_STR8 = STR_HEADERS[_FIXSTR_COUNT][0]


def _id_span(raw: bytes) -> tuple[int, int] | None:
    """Where the id string of a reply starting ``{"id": STR`` lies (one- or two-byte header)."""
    if len(raw) <= _ID_AT + 1 or not raw.startswith(ID_KEY, 1) or raw[0] not in _MAP_HEADERS:
        return None
    length = raw[_ID_AT] - _FIXSTR
    if 0 <= length < _FIXSTR_COUNT:
        return _ID_AT + 1, _ID_AT + 1 + length
    if raw[_ID_AT] == _STR8:
        return _ID_AT + 2, _ID_AT + 2 + raw[_ID_AT + 1]
    return None


class LazyReply(Reply):
    """An ok :class:`Reply` whose outputs, model and timing are decoded on first access.

    ``id`` and ``ok`` are read off the reply's first bytes (:func:`peek_reply`);
    the first access to any other field decodes the whole reply with
    :func:`decode_reply` (so a malformed reply raises ProtocolError then) and
    keeps the result. It compares equal to a :class:`Reply` with the same fields.
    """

    __slots__ = ("_full", "_raw", "id", "ok")
    _full: Reply
    _raw: bytes

    def _decoded(self) -> Reply:
        try:
            return self._full
        except AttributeError:
            full = decode_reply(self._raw)
            if full.id != self.id or full.ok is not self.ok:
                raise ProtocolError(f"reply {self.id!r} decodes to another id or ok") from None
            object.__setattr__(self, "_full", full)
            return full

    @property
    def outputs(self) -> Inputs | None:
        """The reply's OUTPUTS, decoded (zero-copy) on first access."""
        return self._decoded().outputs

    @property
    def model_name(self) -> str | None:
        """The name of the model that answered."""
        return self._decoded().model_name

    @property
    def model_version(self) -> str | None:
        """The version of the model that answered."""
        return self._decoded().model_version

    @property
    def timing(self) -> dict:
        """The worker's timing map (queued_ms, infer_ms, batch_rows)."""
        return self._decoded().timing

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Reply):
            return NotImplemented
        return _reply_fields(self) == _reply_fields(other)

    __hash__ = Reply.__hash__

    def __repr__(self) -> str:
        return "Lazy" + repr(self._decoded())

    def __reduce__(self) -> tuple:
        return lazy_reply, (self._raw,)  # pickled and copied as its bytes


def _reply_fields(reply: Reply) -> tuple:
    return (
        reply.id,
        reply.ok,
        reply.outputs,
        reply.error_code,
        reply.error_message,
        reply.model_name,
        reply.model_version,
        reply.timing,
    )


_new_reply = object.__new__
# the slots' own setters: a frozen Reply refuses setattr, and these cost a C call each
_set_id, _set_ok, _set_raw = (LazyReply.__dict__[slot].__set__ for slot in ("id", "ok", "_raw"))


def lazy_reply(raw: bytes) -> Reply:
    """The reply ``raw`` decoded as :func:`decode_reply` would, but lazily where it can be.

    An ok reply in the fleet's layout becomes a :class:`LazyReply`; a failed
    one, or any other layout, is decoded at once (so its error is there to raise).
    """
    return lazy_replies((raw,))[0]


def lazy_replies(raws: Sequence[bytes]) -> list[Reply]:
    """:func:`lazy_reply` of each of ``raws`` (one loop: the per-reply cost of a bulk collect)."""
    out: list[Reply] = []
    append, id_span, new = out.append, _id_span, _new_reply
    for raw in raws:
        span = id_span(raw)
        if span is not None and raw.startswith(OK_TRUE, span[1]):
            try:
                rid = raw[span[0] : span[1]].decode("utf-8")
            except UnicodeDecodeError:
                append(decode_reply(raw))  # raises ProtocolError, as decode_reply does
                continue
            reply = new(LazyReply)
            _set_id(reply, rid)
            _set_ok(reply, True)
            _set_raw(reply, raw)
            append(reply)
        else:
            append(decode_reply(raw))
    return out
