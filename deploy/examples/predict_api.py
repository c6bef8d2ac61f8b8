"""What both example web apps share: the request body they take and the status each error gets.

``POST /predict`` takes ``{"inputs": [[...], ...]}`` (rows of numbers, float32 on the wire)
and answers ``{"outputs": [[...], ...]}``. A caller's mistake is a 4xx; a fleet that is full,
slow or unreachable is a 503 or 504 the caller may retry; a model that failed is a 502.
"""

from __future__ import annotations

import json
import os

import numpy as np

from inferfleet.producer import errors

#: The queue and Redis the apps send to (the worker's --name and REDIS_URL).
QUEUE = os.environ.get("INFERFLEET_QUEUE", "default")
#: How long one HTTP request waits for its reply before answering 504.
TIMEOUT_S = float(os.environ.get("INFERFLEET_TIMEOUT_S", "10"))
#: The most rows one HTTP request may carry: a bigger batch belongs on the bulk path (map).
MAX_ROWS = 64
#: The largest body read: 64 rows of a few hundred numbers fit many times over.
MAX_BODY_BYTES = 1 << 20


class BadInput(ValueError):
    """The HTTP body is not ``{"inputs": rows of numbers}``."""


class BodyTooLarge(BadInput):
    """The HTTP body is over :data:`MAX_BODY_BYTES` (a 413, read no further)."""


def check_length(length: int) -> None:
    """Refuse a body of ``length`` bytes."""
    if length > MAX_BODY_BYTES:
        raise BodyTooLarge(f"the body is {length} bytes, over the {MAX_BODY_BYTES} this app takes")


def declared_length(header: str | None) -> int:
    """The Content-Length header's value, refused before the body is read if over the limit."""
    try:
        length = int(header or 0)
    except ValueError:
        raise BadInput(f"Content-Length is not a number: {header!r}") from None
    check_length(length)
    return length


def parse_inputs(body: bytes) -> np.ndarray:
    """The float32 array a ``/predict`` body holds, or :class:`BadInput` saying why not."""
    check_length(len(body))
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"the body is not JSON: {exc}") from None
    rows = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise BadInput('expected {"inputs": [[number, ...], ...]} with at least one row')
    if len(rows) > MAX_ROWS:
        raise BadInput(f"at most {MAX_ROWS} rows a request (got {len(rows)})")
    try:
        array = np.asarray(rows, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise BadInput(f"inputs must be rows of numbers of one length: {exc}") from None
    if array.ndim != 2:
        raise BadInput(f"inputs must be a list of rows (got {array.ndim} dimensions)")
    return array


def outputs_body(outputs: np.ndarray) -> bytes:
    """The JSON answer for a reply's outputs."""
    return json.dumps({"outputs": np.asarray(outputs).tolist()}).encode()


def error_reply(exc: Exception) -> tuple[int, bytes]:
    """The HTTP status and JSON body for an exception ``infer`` or ``parse_inputs`` raised."""
    if isinstance(exc, (BodyTooLarge, errors.TooLarge)):
        status = 413
    elif isinstance(exc, (BadInput, errors.BadRequest, errors.ProtocolError)):
        status = 400
    elif isinstance(exc, errors.RateLimited):
        status = 429
    elif isinstance(exc, (errors.ReplyTimeout, errors.Expired)):
        status = 504
    elif isinstance(exc, (errors.QueueFull, errors.Overloaded, errors.ConnectionError)):
        status = 503
    elif isinstance(exc, errors.InferfleetError):
        status = 502
    else:
        raise exc
    return status, json.dumps({"error": type(exc).__name__, "detail": str(exc)}).encode()
