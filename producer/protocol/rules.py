"""The contract's rules for names and for an entry's fields, each defined once.

A queue name, a key prefix, a request id, a ``tenant``, a ``deadline`` and a
``reply_to`` are checked in several places: the SDK before it sends, the worker's general admission
and its fast paths. Each check here is the one definition; the fast ones
(:func:`all_request_ids`, :func:`deadline_open`, :func:`tenant_ok`) are
built from it, and tests/unit/test_rule_paths.py holds each pair together.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from inferfleet.producer.errors import ProtocolError

__all__ = [
    "MAX_DEADLINE_DIGITS",
    "REQUEST_ID_PATTERN",
    "all_request_ids",
    "deadline_open",
    "decode_reply_to",
    "is_deadline",
    "is_expired",
    "is_request_id",
    "is_tenant",
    "parse_deadline",
    "shown",
    "tenant_ok",
    "validate_name",
    "validate_prefix",
    "validate_request_id",
    "validate_request_ids",
]

#: A request id: 1 to 128 bytes of A-Z a-z 0-9 . _ : -. Every check of ids (one id, or many
#: joined by newlines) is built from this pattern.
REQUEST_ID_PATTERN = r"[A-Za-z0-9._:-]{1,128}"
#: A deadline is decimal unix epoch milliseconds of at most this many digits.
MAX_DEADLINE_DIGITS = 16

_RID_RE = re.compile(f"{REQUEST_ID_PATTERN}\\Z".encode())
# Ids joined by newlines (which no valid id holds), each one followed by its newline.
_JOINED_RIDS_RE = re.compile(f"(?:{REQUEST_ID_PATTERN}\n)*\\Z".encode())
_JOINED_RIDS_STR_RE = re.compile(f"(?:{REQUEST_ID_PATTERN}\n)*\\Z")
#: Tenant names (contract 1.1): 1 to 64 printable ASCII characters of this set.
_TENANT_RE = re.compile(rb"[A-Za-z0-9._:@-]{1,64}\Z")
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}\Z")


def shown(value: object, limit: int = 64) -> str:
    """``repr(value)`` in about ``limit`` characters at most, with the length of what was cut.

    Producer-controlled text ends up in error messages, replies and log
    lines: a 2 MB request id must not make a 2 MB (or, escaped, 8 MB) line.
    """
    if isinstance(value, (str, bytes, bytearray, list, tuple)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} long)"
    text = repr(value)
    return text if len(text) <= 4 * limit else f"{text[: 4 * limit]}... ({len(text)} characters)"


# --------------------------------------------------------------------------- names


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid queue name, else raise ProtocolError."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ProtocolError(
            f"invalid queue name {name!r}: use 1 to 64 characters of A-Z a-z 0-9 . _ -"
        )
    return name


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a valid key prefix, else raise ProtocolError."""
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ProtocolError(
            f"invalid key prefix {prefix!r}: use 1 to 64 characters of A-Z a-z 0-9 . _ : -"
        )
    return prefix


# --------------------------------------------------------------------------- request ids


def is_request_id(raw: bytes) -> bool:
    """Whether ``raw`` is a valid request id (the check :func:`validate_request_id` makes)."""
    return _RID_RE.match(raw) is not None


def all_request_ids(rids: Sequence[bytes]) -> bool:
    """Whether every item of ``rids`` passes :func:`is_request_id`, in one pass over all of them.

    The ids are joined by newlines and matched once; counting the newlines is what makes this
    the same rule: an id that holds a newline of its own would otherwise pass as two valid ids.
    """
    if not rids:
        return True
    try:
        joined = b"\n".join(rids) + b"\n"
    except TypeError:  # an item that is not bytes-like
        return False
    return joined.count(b"\n") == len(rids) and _JOINED_RIDS_RE.match(joined) is not None


def validate_request_id(rid: str | bytes) -> str:
    """Return ``rid`` as str if it is a valid request id, else raise ProtocolError."""
    raw = rid.encode() if isinstance(rid, str) else rid
    if not isinstance(raw, bytes) or not _RID_RE.match(raw):
        raise ProtocolError(
            f"invalid request id {shown(rid)}: use 1 to 128 bytes of A-Z a-z 0-9 . _ : -"
        )
    return raw.decode("ascii")


def validate_request_ids(rids: Sequence[str | bytes]) -> list[str]:
    """:func:`validate_request_id` of each id: one match over them all when all are valid str."""
    if set(map(type, rids)) <= {str}:
        joined = "\n".join([*rids, ""])  # type: ignore[list-item]
        # The newline count rules out an id with a newline of its own (see all_request_ids).
        if joined.count("\n") == len(rids) and _JOINED_RIDS_STR_RE.match(joined):
            return list(rids)  # type: ignore[arg-type]
    return [validate_request_id(rid) for rid in rids]


# --------------------------------------------------------------------------- tenant


def is_tenant(raw: bytes) -> bool:
    """True if ``raw`` is a valid ``tenant`` field value (contract 1.1)."""
    return _TENANT_RE.match(raw) is not None


def tenant_ok(fields: Mapping[bytes, object]) -> bool:
    """Whether an entry's ``tenant`` field is absent or valid: what admission requires."""
    tenant = fields.get(b"tenant")
    return tenant is None or (isinstance(tenant, bytes) and is_tenant(tenant))


# --------------------------------------------------------------------------- deadline


def is_deadline(raw: bytes) -> bool:
    """Whether ``raw`` is a well-formed ``deadline`` field: the contract's one rule for it."""
    return raw.isdigit() and len(raw) <= MAX_DEADLINE_DIGITS


def is_expired(deadline_ms: int, now_ms: float) -> bool:
    """Whether a request with this deadline, picked up at ``now_ms``, is answered ``expired``."""
    return now_ms > deadline_ms


def parse_deadline(raw: bytes | None) -> int | None:
    """A ``deadline`` field's milliseconds (None when absent); ProtocolError if malformed."""
    if raw is None:
        return None
    if not is_deadline(raw):
        raise ProtocolError(f"deadline must be decimal unix epoch milliseconds, got {raw[:32]!r}")
    return int(raw)


def deadline_open(raw: object, now_ms: float) -> bool:
    """Whether ``raw`` is a well-formed deadline not yet passed: what the fast paths admit.

    Anything else (malformed, expired, not bytes) goes to the general path, which answers it.
    """
    if raw.__class__ is not bytes:
        return False
    return is_deadline(raw) and not is_expired(int(raw), now_ms)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- reply_to


def decode_reply_to(raw: object) -> str | None:
    """A ``reply_to`` field's key as str, or None when it is not ASCII bytes.

    Whether the key is one the worker writes to is :meth:`QueueKeys.is_inbox`'s rule.
    """
    if raw.__class__ is not bytes:
        return None
    try:
        return raw.decode("ascii")  # type: ignore[attr-defined]
    except UnicodeDecodeError:
        return None
