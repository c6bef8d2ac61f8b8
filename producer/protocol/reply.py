"""The reply: the one element of a reply list, its encoders, its decoder and its layout.

:func:`encode_reply_ok` and :func:`encode_reply_error` are the one
definition of a reply's bytes; every fast path (the SDK's
:func:`~inferfleet.producer.protocol.fast.peek_reply`, the worker's reply
templates) is derived from them: :data:`ID_KEY`, :data:`OK_TRUE` and
:data:`OK_FALSE` are packed from the same keys, and the templates encode a
sample and locate its slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol.codec import (
    OUTPUT_LIMITS,
    Inputs,
    decode_inputs,
    encode_inputs,
    pack,
    unpack,
)
from inferfleet.producer.protocol.names import ERROR_CODES

__all__ = [
    "ID_KEY",
    "MAX_MESSAGE_CHARS",
    "OK_FALSE",
    "OK_TRUE",
    "STR_HEADERS",
    "Reply",
    "decode_reply",
    "encode_reply_error",
    "encode_reply_ok",
    "reply_timing",
]

#: An error message's longest form; a longer one keeps its end, which says what went wrong.
MAX_MESSAGE_CHARS = 2000
#: Every reply is a map whose first key is ``id`` and second ``ok`` (the encoders below write
#: them in that order): these are their packed bytes, for readers of the first bytes alone.
ID_KEY = pack("id")
OK_TRUE = pack("ok") + pack(True)
OK_FALSE = pack("ok") + pack(False)
#: msgpack's header of a str of each length below 256, as :func:`pack` writes it.
STR_HEADERS = tuple(pack("a" * n)[: len(pack("a" * n)) - n] for n in range(256))


@dataclass(frozen=True)
class Reply:
    """One decoded reply. ``outputs`` is set when ``ok``, ``error_*`` when not."""

    id: str
    ok: bool
    outputs: Inputs | None = None
    error_code: str | None = None
    error_message: str | None = None
    model_name: str | None = None
    model_version: str | None = None
    timing: dict = field(default_factory=dict)

    def raise_for_error(self) -> Reply:
        """Return self if ok, else raise the matching :class:`ReplyError`."""
        if not self.ok:
            from inferfleet.producer.errors import reply_error_for

            raise reply_error_for(self)
        return self


def _reply_meta(model: tuple[str, str] | None, timing: Mapping[str, Any] | None) -> dict:
    meta: dict[str, Any] = {}
    if model is not None:
        meta["model"] = {"name": model[0], "version": model[1]}
    if timing is not None:
        meta["timing"] = dict(timing)
    return meta


def reply_timing(queued_ms: float, infer_ms: float, batch_rows: int) -> dict[str, Any]:
    """The ``timing`` map of a computed request's reply, in the order every reply writes it.

    A negative queue wait (clocks of two machines) is written as 0.0.
    """
    return {"queued_ms": max(0.0, queued_ms), "infer_ms": infer_ms, "batch_rows": batch_rows}


def encode_reply_ok(
    rid: str,
    outputs: Any,
    model: tuple[str, str],
    timing: Mapping[str, Any],
) -> bytes:
    """The reply to a request that was computed."""
    reply = {"id": rid, "ok": True, "outputs": encode_inputs(outputs)}
    reply.update(_reply_meta(model, timing))
    return pack(reply)


def encode_reply_error(
    rid: str,
    code: str,
    message: str,
    model: tuple[str, str] | None = None,
    timing: Mapping[str, Any] | None = None,
) -> bytes:
    """The reply to a request that failed with contract error ``code``."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}: use one of {', '.join(ERROR_CODES)}")
    if len(message) > MAX_MESSAGE_CHARS:
        message = "..." + message[3 - MAX_MESSAGE_CHARS :]
    reply = {"id": rid, "ok": False, "error": {"code": code, "message": message}}
    reply.update(_reply_meta(model, timing))
    return pack(reply)


def decode_reply(data: bytes) -> Reply:
    """Decode the single element of a reply list. Raises ProtocolError if malformed."""
    obj = unpack(data, OUTPUT_LIMITS)
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("id"), str)
        or not isinstance(obj.get("ok"), bool)
    ):
        raise ProtocolError("reply must be a map with a string 'id' and a boolean 'ok'")
    model, timing = obj.get("model") or {}, obj.get("timing") or {}
    if not isinstance(model, dict) or not isinstance(timing, dict):
        raise ProtocolError("reply 'model' and 'timing' must be maps")
    common = {
        "id": obj["id"],
        "model_name": model.get("name"),
        "model_version": model.get("version"),
        "timing": timing,
    }
    if obj["ok"]:
        if "outputs" not in obj:
            raise ProtocolError("an ok reply must carry 'outputs'")
        return Reply(
            ok=True, outputs=decode_inputs(obj["outputs"], OUTPUT_LIMITS, "outputs"), **common
        )
    error = obj.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("code"), str):
        raise ProtocolError("a failed reply must carry 'error': {'code': STR, 'message': STR}")
    return Reply(
        ok=False, error_code=error["code"], error_message=str(error.get("message", "")), **common
    )


# -- SDK fast paths
#
# What the producer does per request when it sends or collects thousands in one
# call, at a fraction of the cost of the general functions above and with the
# same bytes: a request body written from a template, a reply's id and ok read
