"""The exceptions of the inferfleet SDK.

Every exception the SDK raises derives from :class:`InferfleetError`, so a
caller can catch the whole family at once::

    InferfleetError
    ├── ProtocolError            bytes or values that break the wire contract
    │                            (``.code`` is ``bad_request`` or ``too_large``)
    ├── ConnectionError          Redis could not be reached or dropped us
    │   └── NotReplicated        with durability on: no replica confirmed the write
    ├── ReplyTimeout             no reply arrived within the timeout
    ├── QueueFull                the queue's backlog is over max_backlog (the producer's or the
    fleet's) ├── RateLimited              the producer's tenant is over its fleet-wide quota └──
    ReplyError               a worker answered ``ok: false``
        ├── BadRequest           code ``bad_request``
        ├── TooLarge             code ``too_large``
        ├── Expired              code ``expired``
        ├── ModelError           code ``model_error``
        ├── DeadLetter           code ``dead_letter``
        ├── Cancelled            code ``cancelled``
        ├── Overloaded           code ``overloaded``
        └── Throttled            code ``rate_limited``

redis-py's own exceptions never escape the SDK: they are translated into
:class:`ConnectionError` (or :class:`InferfleetError`) at one seam,
``inferfleet.producer.connections.translate_errors``, with the original kept as ``__cause__``.
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferfleet.producer.protocol import Reply

__all__ = [
    "InferfleetError",
    "ProtocolError",
    "ConnectionError",
    "NotReplicated",
    "ReplyTimeout",
    "QueueFull",
    "RateLimited",
    "ReplyError",
    "BadRequest",
    "TooLarge",
    "Expired",
    "ModelError",
    "DeadLetter",
    "Cancelled",
    "Overloaded",
    "Throttled",
    "reply_error_for",
]


class InferfleetError(Exception):
    """Base class of every exception raised by inferfleet."""


class ProtocolError(InferfleetError, ValueError):
    """Something does not follow the wire contract.

    Raised by the SDK before anything is sent (an invalid queue name, a
    tensor of an unsupported dtype) and by the worker's decoder on hostile
    or malformed entries. ``code`` is the contract error code a worker
    answers with: ``bad_request`` or ``too_large``.
    """

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ConnectionError(InferfleetError, builtins.ConnectionError):
    """Redis could not be reached, refused us, or the connection dropped."""


class NotReplicated(ConnectionError):
    """With durability on (:class:`~inferfleet.producer.durability.Durability`), the primary
    took the write but too few replicas confirmed it in time.

    The request may be lost in a failover, or may still be computed: send it again
    (with a new id) if it is still needed. The next call reconnects, so a primary
    that was switched over is left.
    """


class ReplyTimeout(InferfleetError, TimeoutError):
    """No reply arrived within the caller's timeout.

    The request may still be answered later; collecting it again with the
    same request id is safe.
    """


class QueueFull(InferfleetError):
    """The queue's backlog is over the producer's ``max_backlog``, or Redis is out of memory:
    back off and retry.

    Nothing was enqueued. ``backlog`` is the backlog that was seen (None when
    Redis itself refused the write at ``maxmemory``).
    """

    def __init__(self, message: str, backlog: int | None) -> None:
        super().__init__(message)
        self.backlog = backlog


class RateLimited(InferfleetError):
    """The producer's tenant is over its fleet-wide quota (``inferfleet limit --tenant``): back off.

    Nothing was enqueued. ``tenant`` is the tenant, ``retry_after_s`` about
    how long until the quota admits the refused requests.
    """

    def __init__(self, message: str, tenant: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.retry_after_s = retry_after_s


class ReplyError(InferfleetError):
    """A worker answered the request with ``ok: false``.

    ``code`` is the contract error code, ``reply`` the whole decoded reply.
    """

    code = "error"

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        message = reply.error_message or ""
        super().__init__(f"request {reply.id!r} failed with {reply.error_code}: {message}")
        self.code = reply.error_code or self.code
        self.message = message


class BadRequest(ReplyError):
    """The worker could not decode the request or it does not fit the model."""

    code = "bad_request"


class TooLarge(ReplyError):
    """The request body was over the worker's size limit."""

    code = "too_large"


class Expired(ReplyError):
    """The request was picked up after its deadline and not computed."""

    code = "expired"


class ModelError(ReplyError):
    """The model raised on this request."""

    code = "model_error"


class DeadLetter(ReplyError):
    """The request was delivered too many times and was given up on."""

    code = "dead_letter"


class Cancelled(ReplyError):
    """The request was cancelled before a worker computed it."""

    code = "cancelled"


class Overloaded(ReplyError):
    """Written past the admission check while the queue was over its fleet-wide backlog limit."""

    code = "overloaded"


class Throttled(ReplyError):
    """Written past the admission check while its tenant was over its quota (code
    ``rate_limited``)."""

    code = "rate_limited"


_BY_CODE: dict[str, type[ReplyError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        TooLarge,
        Expired,
        ModelError,
        DeadLetter,
        Cancelled,
        Overloaded,
        Throttled,
    )
}


def reply_error_for(reply: Reply) -> ReplyError:
    """Return the exception that stands for a failed ``reply``."""
    return _BY_CODE.get(reply.error_code or "", ReplyError)(reply)
