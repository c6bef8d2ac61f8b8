"""The inferfleet wire contract, version 1: key names, envelope and tensor codec.

This is the only module that knows msgpack. Producers and workers both go
through it, so the contract (``docs/protocol.md``) lives in one place:

* :class:`QueueKeys` names every Redis key of one queue; :func:`shard_keys`
  and :func:`shard_for` name and pick the shards of a sharded one.
* :func:`encode_inputs` / :func:`decode_inputs` turn numpy structures
  (a tensor, a list of tensors, a dict of tensors) into msgpack-ready maps
  and back. Decoding is strict and bounded: dtype whitelist, exact byte
  counts, limits on sizes, nesting and element counts, zero-copy views.
* :func:`request_fields` builds the fields of one stream entry;
  :func:`parse_entry` and :func:`decode_body` read one back.
* :func:`encode_reply_ok`, :func:`encode_reply_error` and
  :func:`decode_reply` handle the single element of a reply list.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import msgpack
import numpy as np

from inferfleet.producer.errors import ProtocolError

__all__ = [
    "CONTRACT_VERSION",
    "DEFAULT_PREFIX",
    "GROUP",
    "GroupInfo",
    "DEFAULT_REPLY_TTL_S",
    "ERROR_CODES",
    "DTYPES",
    "Limits",
    "QueueKeys",
    "MAX_SHARDS",
    "shard_for",
    "shard_name",
    "shard_keys",
    "Envelope",
    "Reply",
    "Inputs",
    "validate_name",
    "validate_request_id",
    "entry_time_ms",
    "encode_inputs",
    "decode_inputs",
    "encode_body",
    "decode_body",
    "request_fields",
    "parse_entry",
    "encode_reply_ok",
    "encode_reply_error",
    "decode_reply",
    "row_count",
    "pack",
    "unpack",
    "workers_group",
    "is_request_id",
    "all_request_ids",
    "MAX_DEADLINE_DIGITS",
    "is_deadline",
    "is_expired",
    "deadline_open",
    "REQUEST_ID_PATTERN",
    "shown",
    "is_tenant",
    "BodyTemplate",
    "ReplyTemplate",
]

CONTRACT_VERSION = 1
DEFAULT_PREFIX = "inferfleet"
GROUP = "workers"
DEFAULT_REPLY_TTL_S = 300
MAX_SHARDS = 1024
ERROR_CODES = (
    "bad_request",
    "too_large",
    "expired",
    "model_error",
    "dead_letter",
    "cancelled",
    "rate_limited",
    "overloaded",
)  # the last three: contract 1.1

#: Contract dtype name -> numpy dtype, always little-endian.
DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype("|b1"),
    "int8": np.dtype("|i1"),
    "uint8": np.dtype("|u1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
_NAME_BY_KIND = {(dt.kind, dt.itemsize): name for name, dt in DTYPES.items()}
_TENSOR_KEYS = frozenset({"dtype", "shape", "data"})
_BODY_KEYS = frozenset({"inputs", "params"})

_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")
#: A request id, the contract's one rule for it: 1 to 128 bytes of A-Z a-z 0-9 . _ : -.
#: Every check of ids (one id, or many joined by newlines) is built from this pattern.
REQUEST_ID_PATTERN = r"[A-Za-z0-9._:-]{1,128}"
_RID_RE = re.compile(f"{REQUEST_ID_PATTERN}\\Z".encode())
# Ids joined by newlines (which no valid id holds), each one followed by its newline.
_JOINED_RIDS_RE = re.compile(f"(?:{REQUEST_ID_PATTERN}\n)*\\Z".encode())
_JOINED_RIDS_STR_RE = re.compile(f"(?:{REQUEST_ID_PATTERN}\n)*\\Z")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}\Z")
#: Tenant names (contract 1.1): 1 to 64 printable ASCII characters of this set.
_TENANT_RE = re.compile(rb"[A-Za-z0-9._:@-]{1,64}\Z")

#: A numpy array, a list of them (positional model arguments) or a dict of
#: them (keyword arguments).
Inputs = np.ndarray | list | dict


@dataclass(frozen=True)
class Limits:
    """Bounds a decoder enforces so a hostile body cannot exhaust memory."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_tensors: int = 64
    max_ndim: int = 8
    max_params: int = 64

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tensors", "max_ndim", "max_params"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be at least 1, got {getattr(self, name)}")


DEFAULT_LIMITS = Limits()


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


def shown(value: object, limit: int = 64) -> str:
    """``repr(value)`` in about ``limit`` characters at most, with the length of what was cut.

    Producer-controlled text ends up in error messages, replies and log
    lines: a 2 MB request id must not make a 2 MB (or, escaped, 8 MB) line.
    """
    if isinstance(value, (str, bytes, bytearray, list, tuple)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} long)"
    text = repr(value)
    return text if len(text) <= 4 * limit else f"{text[: 4 * limit]}... ({len(text)} characters)"


def is_tenant(raw: bytes) -> bool:
    """True if ``raw`` is a valid ``tenant`` field value (contract 1.1)."""
    return _TENANT_RE.match(raw) is not None


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


@dataclass(frozen=True)
class GroupInfo:
    """Group ``workers`` of one request stream, as XINFO GROUPS reports it."""

    #: Entries not yet delivered to any worker; None where Redis cannot tell
    #: (after an XDEL or XTRIM of undelivered entries).
    lag: int | None
    #: Entries delivered but not yet acknowledged.
    pending: int
    last_delivered_id: str


def workers_group(groups: Sequence[Mapping[Any, Any]]) -> GroupInfo | None:
    """Group ``workers`` in an XINFO GROUPS reply (names as str or bytes), or None if it is missing.

    The one place that reads that reply: the SDK's backpressure, the
    supervisor, ``inferfleet status`` and the worker's trim all use it.
    """
    for group in groups:
        if group.get("name") in (GROUP, GROUP.encode()):
            lag = group.get("lag")
            last = group.get("last-delivered-id", b"0-0")
            return GroupInfo(
                None if lag is None else int(lag),
                int(group.get("pending", 0)),
                last.decode() if isinstance(last, bytes) else str(last),
            )
    return None


@dataclass(frozen=True)
class QueueKeys:
    """Every Redis key of one queue. The braces are a Redis Cluster hash tag."""

    name: str
    prefix: str = DEFAULT_PREFIX
    base: str = field(init=False)
    requests: str = field(init=False)
    dead: str = field(init=False)
    inbox_prefix: str = field(init=False)

    def __post_init__(self) -> None:
        validate_name(self.name)
        validate_prefix(self.prefix)
        base = f"{self.prefix}:{{{self.name}}}:"
        object.__setattr__(self, "base", base)
        object.__setattr__(self, "requests", base + "requests")
        object.__setattr__(self, "dead", base + "dead")
        object.__setattr__(self, "inbox_prefix", base + "inbox:")

    def reply(self, rid: str) -> str:
        """The default reply list of request ``rid``."""
        return f"{self.base}reply:{rid}"

    def inbox(self, suffix: str) -> str:
        """A shared reply inbox a client may name in ``reply_to``."""
        if not suffix or any(c in suffix for c in "{} \t\r\n"):
            raise ProtocolError(f"invalid inbox suffix {suffix!r}")
        return self.inbox_prefix + suffix

    def own(self, what: str) -> str:
        """An implementation key under this queue's prefix (heartbeats, version...)."""
        return self.base + what

    def is_inbox(self, key: str) -> bool:
        """True if ``key`` is a reply inbox of this queue (what ``reply_to`` may name)."""
        return (
            key.startswith(self.inbox_prefix)
            and len(key) > len(self.inbox_prefix)
            and len(key) <= len(self.inbox_prefix) + 256
            and not any(c in key[len(self.inbox_prefix) :] for c in "{} \t\r\n")
        )


# --------------------------------------------------------------------------- shards


def _check_shards(shards: int) -> int:
    if not isinstance(shards, int) or isinstance(shards, bool) or not 1 <= shards <= MAX_SHARDS:
        raise ProtocolError(f"shards must be an integer from 1 to {MAX_SHARDS}, got {shards!r}")
    return shards


def shard_for(request_id: str, shards: int) -> int:
    """The shard (0 to ``shards - 1``) that request ``request_id`` goes to.

    CRC-32/IEEE (what zlib.crc32 computes) of the id's UTF-8 bytes, mod
    ``shards``: any language can reproduce it, so any producer and any tool
    finds the same shard for the same id.
    """
    return zlib.crc32(request_id.encode("utf-8")) % _check_shards(shards)


def shard_name(name: str, shard: int, shards: int) -> str:
    """The queue name of shard ``shard``: ``NAME`` itself when unsharded, else ``NAME.shard``.

    A shard name must itself be a valid queue name (64 characters at most),
    so a sharded queue's own name is shorter by the suffix; this says by how much.
    """
    validate_name(name)
    if _check_shards(shards) == 1:
        return name
    if not isinstance(shard, int) or not 0 <= shard < shards:
        raise ProtocolError(f"shard must be an integer from 0 to {shards - 1}, got {shard!r}")
    longest = len(name) + 1 + len(str(shards - 1))
    if longest > 64:
        raise ProtocolError(
            f"queue name {name!r} is too long for {shards} shards: shard names such as "
            f"{name}.{shards - 1} must fit 64 characters, so use at most {64 - longest + len(name)}"
        )
    return f"{name}.{shard}"


def shard_keys(name: str, shards: int = 1, prefix: str = DEFAULT_PREFIX) -> tuple[QueueKeys, ...]:
    """The keys of every shard of queue ``name``, shard 0 first.

    Shard ``s`` is keyed exactly like a queue named ``NAME.s`` (its own hash
    tag, so its own cluster slot); with one shard the queue is ``NAME``'s own.
    """
    return tuple(
        QueueKeys(shard_name(name, s, shards), prefix) for s in range(_check_shards(shards))
    )


def entry_time_ms(entry_id: bytes | str) -> int:
    """The millisecond timestamp part of a stream entry id (Redis server clock)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


# --------------------------------------------------------------------------- msgpack


def pack(obj: Any) -> bytes:
    """msgpack-encode ``obj`` (bin for bytes, str for str)."""
    return msgpack.packb(obj, use_bin_type=True)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension types are not allowed (ext type {code})")


def unpack(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """msgpack-decode ``data`` with bounds so hostile input cannot allocate gigabytes."""
    if len(data) > limits.max_body_bytes:
        raise ProtocolError(
            f"body is {len(data)} bytes, over the limit of {limits.max_body_bytes}", "too_large"
        )
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=limits.max_body_bytes,
            max_str_len=64 * 1024,
            max_array_len=4096,
            max_map_len=max(limits.max_tensors, limits.max_params, 8),
            max_ext_len=0,
            ext_hook=_refuse_ext,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"body is not valid msgpack: {exc}") from exc


# --------------------------------------------------------------------------- tensors


def _as_array(value: Any) -> np.ndarray:
    """Turn a numpy array, torch tensor or nested list into a numpy array."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # torch, without importing it
        try:
            return value.detach().cpu().numpy()
        except TypeError as exc:  # bfloat16 and friends have no numpy dtype
            raise ProtocolError(f"tensor of dtype {value.dtype} cannot be sent: {exc}") from exc
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"cannot make a tensor of {type(value).__name__}: {exc}") from exc


def encode_tensor(value: Any) -> dict:
    """One TENSOR map. ``data`` is a zero-copy view when the array allows it."""
    arr = _as_array(value)
    name = _NAME_BY_KIND.get((arr.dtype.kind, arr.dtype.itemsize))
    if name is None:
        raise ProtocolError(f"unsupported dtype {arr.dtype}: use one of {', '.join(DTYPES)}")
    if arr.ndim == 0:
        raise ProtocolError("a tensor needs at least one dimension: shape[0] is the row count")
    arr = np.ascontiguousarray(arr, dtype=DTYPES[name])
    data = memoryview(arr).cast("B") if arr.size else b""  # type: ignore[arg-type]  # cannot cast empty
    return {"dtype": name, "shape": list(arr.shape), "data": data}


def encode_inputs(inputs: Any) -> Any:
    """Encode a tensor, a list/tuple of tensors or a dict of tensors as INPUTS."""
    if isinstance(inputs, Mapping):
        if not inputs:
            raise ProtocolError("inputs map is empty")
        for key in inputs:
            if not isinstance(key, str):
                raise ProtocolError(f"inputs map keys must be strings, got {shown(key)}")
        return {key: encode_tensor(val) for key, val in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        if not inputs:
            raise ProtocolError("inputs list is empty")
        return [encode_tensor(val) for val in inputs]
    if isinstance(inputs, (str, bytes, bytearray)):
        return (
            bytes(inputs) if isinstance(inputs, bytearray) else inputs
        )  # raw (version 1.2): a handler decodes it
    return encode_tensor(inputs)


def encode_outputs(outputs: Any) -> bytes:
    """OUTPUTS (same forms as INPUTS) as msgpack bytes: the fleet result cache's values."""
    return pack(encode_inputs(outputs))


def decode_outputs(data: bytes) -> Inputs:
    """Inverse of :func:`encode_outputs`. Raises ProtocolError if malformed."""
    return decode_inputs(unpack(data, _REPLY_LIMITS), _REPLY_LIMITS, "outputs")


def _decode_tensor(obj: Any, limits: Limits, where: str) -> np.ndarray:
    if not isinstance(obj, dict) or obj.keys() != _TENSOR_KEYS:
        raise ProtocolError(f"{where}: a tensor is a map with exactly dtype, shape and data")
    dtype = DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None
    if dtype is None:
        raise ProtocolError(
            f"{where}: dtype {shown(obj['dtype'])} is not one of {', '.join(DTYPES)}"
        )
    shape, data = obj["shape"], obj["data"]
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= limits.max_ndim
        or not all(type(d) is int and 0 <= d <= limits.max_body_bytes for d in shape)
    ):
        raise ProtocolError(
            f"{where}: shape must be a list of 1 to {limits.max_ndim} non-negative ints, got {shown(shape)}"
        )
    if not isinstance(data, bytes):
        raise ProtocolError(f"{where}: data must be msgpack bin, got {type(data).__name__}")
    if prod(d for d in shape if d) > limits.max_body_bytes:  # bounds empty tensors' shapes too
        raise ProtocolError(f"{where}: shape {shape} is too large")
    expected = prod(shape) * dtype.itemsize
    if expected != len(data):
        raise ProtocolError(
            f"{where}: shape {shape} of {obj['dtype']} needs {expected} bytes, data has {len(data)}"
        )
    arr = np.frombuffer(data, dtype=dtype).reshape(shape)
    if dtype.kind == "b" and data and max(data) > 1:
        raise ProtocolError(f"{where}: bool data must be bytes 0 or 1")
    return arr


def decode_inputs(obj: Any, limits: Limits = DEFAULT_LIMITS, where: str = "inputs") -> Inputs:
    """Decode INPUTS (already msgpack-unpacked) into numpy arrays, zero-copy.

    Returns an array, a list of arrays or a dict of arrays, and checks that
    every tensor has the same row count.
    """
    arrays: list[np.ndarray]
    result: Inputs
    if isinstance(obj, dict) and isinstance(obj.get("dtype"), str):
        tensor = _decode_tensor(obj, limits, where)
        arrays, result = [tensor], tensor
    elif isinstance(obj, dict):
        if not 1 <= len(obj) <= limits.max_tensors:
            raise ProtocolError(f"{where}: a map of 1 to {limits.max_tensors} tensors is required")
        if not all(isinstance(k, str) for k in obj):
            raise ProtocolError(f"{where}: the keys of an inputs map must be msgpack strings")
        by_name = {k: _decode_tensor(v, limits, f"{where}[{shown(k)}]") for k, v in obj.items()}
        arrays, result = list(by_name.values()), by_name
    elif isinstance(obj, (str, bytes)):
        return obj  # type: ignore[return-value]  # a raw input (version 1.2): one row that a handler decodes
    elif isinstance(obj, list):
        if not 1 <= len(obj) <= limits.max_tensors:
            raise ProtocolError(f"{where}: a list of 1 to {limits.max_tensors} tensors is required")
        arrays = [_decode_tensor(v, limits, f"{where}[{i}]") for i, v in enumerate(obj)]
        result = arrays
    else:
        raise ProtocolError(
            f"{where}: must be a tensor, a list of tensors, a map of tensors or raw text or bytes"
        )
    rows = {a.shape[0] for a in arrays}
    if len(rows) != 1:
        raise ProtocolError(
            f"{where}: every tensor must have the same row count, got {sorted(rows)}"
        )
    return result


def row_count(inputs: Inputs) -> int:
    """shape[0] shared by every tensor of a decoded INPUTS structure."""
    if isinstance(inputs, np.ndarray):
        return int(inputs.shape[0])
    if isinstance(inputs, (str, bytes)):
        return 1  # a raw input is one row
    first = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs[0]
    return int(first.shape[0])


# --------------------------------------------------------------------------- requests


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
) -> dict[str, bytes | str]:
    """The fields of one request stream entry (for ``XADD ... *``)."""
    fields: dict[str, bytes | str] = {"id": rid, "body": body}
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
        tenant = fields.get(b"tenant")
        if tenant is not None and not (isinstance(tenant, bytes) and is_tenant(tenant)):
            raise ProtocolError(
                f"tenant must be 1 to 64 characters of A-Z a-z 0-9 . _ : @ -, got {tenant!r:.80}"
            )
        return Envelope(
            rid, body, _parse_deadline(_field(fields, b"deadline")), _parse_reply_to(fields)
        )
    except ProtocolError as exc:
        exc.rid = rid  # type: ignore[attr-defined]
        raise


#: A deadline is decimal unix epoch milliseconds of at most this many digits.
MAX_DEADLINE_DIGITS = 16


def is_deadline(raw: bytes) -> bool:
    """Whether ``raw`` is a well-formed ``deadline`` field: the contract's one rule for it."""
    return raw.isdigit() and len(raw) <= MAX_DEADLINE_DIGITS


def is_expired(deadline_ms: int, now_ms: float) -> bool:
    """Whether a request with this deadline, picked up at ``now_ms``, is answered ``expired``."""
    return now_ms > deadline_ms


def deadline_open(raw: object, now_ms: float) -> bool:
    """Whether ``raw`` is a well-formed deadline not yet passed: what the fast paths admit.

    Anything else (malformed, expired, not bytes) goes to the general path, which answers it.
    """
    if raw.__class__ is not bytes:
        return False
    return is_deadline(raw) and not is_expired(int(raw), now_ms)  # type: ignore[arg-type]


def _parse_deadline(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    if not is_deadline(raw):
        raise ProtocolError(f"deadline must be decimal unix epoch milliseconds, got {raw[:32]!r}")
    return int(raw)


def _parse_reply_to(fields: Mapping[bytes, bytes]) -> str | None:
    if b"reply_to" not in fields:
        return None
    raw = _field(fields, b"reply_to")
    try:
        return raw.decode("ascii") if raw is not None else "\x00"
    except UnicodeDecodeError:
        return "\x00"  # never an inbox key: the worker refuses it


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


@dataclass(frozen=True)
class BodyTemplate:
    """The bytes every body of one input spec shares, so the worker can skip decoding them.

    Learnt from a body that was fully decoded and admitted: a map with only
    ``inputs`` (or empty ``params``) holding one tensor, a list or a map of
    them (no bool tensors: their data bytes are checked one by one). Another
    body of the same length with the same bytes outside the tensors' data
    (``consts``) has the same structure, dtypes and shapes byte for byte, so
    it decodes to the same checks passed: only the data differ.

    The data ranges are found by searching the body for each tensor's bytes
    and then proved: the body with every data byte flipped must decode to
    exactly the flipped tensors, or nothing is learnt.
    """

    length: int
    consts: tuple[tuple[int, bytes], ...]  # (offset, bytes) every fitting body repeats
    tensors: tuple[
        tuple[int, np.dtype, tuple[int, ...]], ...
    ]  # (offset, dtype, shape) of each tensor's data
    names: tuple[str, ...] | None  # a map's keys in order; None for one tensor or a list
    single: bool  # one tensor, not a list of one

    @property
    def rows(self) -> int:
        """Rows of every fitting body's request."""
        return self.tensors[0][2][0]

    @classmethod
    def learn(cls, body: bytes, inputs: Inputs, params: dict) -> BodyTemplate | None:
        """The template of ``body`` (already decoded to ``inputs``, ``params``), or None if it has none."""
        arrays = _tensors_of(inputs)
        if params or arrays is None:
            return None
        tensors, start = [], 0
        for arr in arrays:
            at = body.find(arr.tobytes(), start)
            if at < 0:
                return None
            tensors.append((at, arr.dtype, arr.shape))
            start = at + arr.nbytes
        ranges = [(at, at + int(np.prod(shape)) * dtype.itemsize) for at, dtype, shape in tensors]
        ends = [0] + [end for _, end in ranges]
        consts = tuple(
            (end, body[end:at]) for end, (at, _) in zip(ends, [*ranges, (len(body), 0)]) if at > end
        )
        template = cls(
            len(body),
            consts,
            tuple(tensors),
            tuple(inputs) if isinstance(inputs, dict) else None,
            isinstance(inputs, np.ndarray),
        )
        return template if template._proved(body, ranges) else None

    def _proved(self, body: bytes, ranges: list[tuple[int, int]]) -> bool:
        """Flip every data byte: the body must decode to exactly the flipped tensors, in this form."""
        flipped = np.frombuffer(body, np.uint8).copy()
        for start, end in ranges:
            flipped[start:end] ^= 0xFF
        try:
            inputs, params = decode_body(flipped.tobytes())
        except ProtocolError:
            return False
        if isinstance(inputs, dict):
            same_form = self.names == tuple(inputs)
        else:
            same_form = self.names is None and self.single == isinstance(inputs, np.ndarray)
        got = _tensors_of(inputs)
        want = _tensors_of(self._inputs_of(flipped.reshape(1, -1)))
        return (
            not params
            and same_form
            and got is not None
            and want is not None
            and len(got) == len(want)
            and all(
                a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
                for a, b in zip(got, want)
            )
        )

    def fitting(self, bodies: np.ndarray) -> np.ndarray:
        """Which rows of ``bodies`` (uint8, one body of ``length`` bytes a row) fit: a bool each."""
        fits = np.ones(len(bodies), bool)
        for at, const in self.consts:
            fits &= (bodies[:, at : at + len(const)] == np.frombuffer(const, np.uint8)).all(axis=1)
        return fits

    def _inputs_of(self, bodies: np.ndarray) -> Inputs:
        """The inputs of fitting ``bodies`` (uint8 rows), concatenated row-wise, in this template's form."""
        arrays = []
        for at, dtype, shape in self.tensors:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            # a copy, always: a one-row slice counts as contiguous, so ascontiguousarray would keep
            # its row stride (the body's length), which is no multiple of the dtype's size
            arr = bodies[:, at : at + nbytes].copy().view(dtype)
            arrays.append(arr.reshape((len(bodies) * shape[0],) + shape[1:]))
        if self.single:
            return arrays[0]
        return dict(zip(self.names, arrays)) if self.names is not None else arrays

    def inputs_many(self, bodies: np.ndarray) -> Inputs:
        """Every fitting body's inputs (``bodies``: uint8, one a row), concatenated row-wise: one copy a tensor."""
        return self._inputs_of(bodies)

    def inputs_of(self, body: bytes) -> Inputs | None:
        """``body``'s inputs if it fits this template, else None."""
        if len(body) != self.length or not all(
            body.startswith(const, at) for at, const in self.consts
        ):
            return None
        if self.single:
            at, dtype, shape = self.tensors[0]
            return np.frombuffer(body, dtype, offset=at, count=int(np.prod(shape))).reshape(shape)
        return self._inputs_of(np.frombuffer(body, np.uint8).reshape(1, -1))


def _tensors_of(inputs: Inputs) -> list[np.ndarray] | None:
    """The tensors of decoded inputs in body order, or None where a template cannot hold them."""
    arrays = (
        [inputs]
        if isinstance(inputs, np.ndarray)
        else list(inputs.values())
        if isinstance(inputs, dict)
        else list(inputs)
        if isinstance(inputs, list)
        else None
    )
    if not arrays or not all(
        isinstance(a, np.ndarray) and a.size and a.dtype.kind != "b" for a in arrays
    ):
        return None
    return arrays


# --------------------------------------------------------------------------- replies


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
    if len(message) > 2000:  # the end says what went wrong; the start of a long one is context
        message = "..." + message[-1997:]
    reply = {"id": rid, "ok": False, "error": {"code": code, "message": message}}
    reply.update(_reply_meta(model, timing))
    return pack(reply)


class ReplyTemplate:
    """Encodes the ok replies of one model and one output spec from precomputed bytes.

    The result equals :func:`encode_reply_ok` byte for byte (a test holds
    them together) for outputs that are one tensor of ``dtype`` and ``shape``,
    at a fraction of its cost: per reply only the id, the data and the
    queue wait change; the batch's timing tail is encoded once per batch.
    """

    def __init__(self, model: tuple[str, str], dtype: np.dtype, shape: tuple[int, ...]) -> None:
        sample = np.zeros(shape, dtype)
        whole = encode_reply_ok(
            "r", sample, model, {"queued_ms": 0.0, "infer_ms": 0.0, "batch_rows": 0}
        )
        head = pack({"id": "r", "ok": True, "outputs": encode_inputs(sample)})[: -sample.nbytes]
        self._ok_outputs = head[
            len(pack({"id": "r"})) :
        ]  # "ok", true, "outputs", the tensor up to its data
        self._map5 = pack({"id": "r", "ok": True, "outputs": 0, "model": 0, "timing": 0})[:1]
        self._id_key = pack("id")
        model_part = whole[len(head) + sample.nbytes :]
        self._model_queued = (
            model_part[: model_part.index(pack("queued_ms")) + len(pack("queued_ms"))] + b"\xcb"
        )
        self.nbytes = sample.nbytes

    @staticmethod
    def batch_tail(infer_ms: float, batch_rows: int) -> bytes:
        """The end of every reply of one batch: its infer_ms and batch_rows."""
        return pack("infer_ms") + pack(float(infer_ms)) + pack("batch_rows") + pack(int(batch_rows))

    def payload_format(self, id_length: int, tail: bytes) -> tuple[bytes, int]:
        """A bytes %-format of the ok reply to a request whose ASCII id is ``id_length`` bytes long,
        and the reply's length.

        ``format % (rid, data, queued)`` (``queued`` the queue wait packed as a
        big-endian double, :meth:`queued_bytes`) equals :meth:`encode`'s bytes:
        a batch's replies are formatted without building them piece by piece.
        """
        parts = self.payload_parts(id_length, tail)
        fmt = b"%b".join(part.replace(b"%", b"%%") for part in parts)
        return fmt, sum(map(len, parts)) + id_length + self.nbytes + _DOUBLE.size

    def payload_parts(self, id_length: int, tail: bytes) -> tuple[bytes, bytes, bytes, bytes]:
        """The fixed bytes of an ok reply whose ASCII id is ``id_length`` bytes long: the reply is
        ``parts[0] + rid + parts[1] + data + parts[2] + queued + parts[3]`` (as in :meth:`payload_format`)."""
        if not 0 < id_length < 256:
            raise ValueError(f"id_length must be 1 to 255, got {id_length}")
        return (
            self._map5 + self._id_key + _STR_HEADERS[id_length],
            self._ok_outputs,
            self._model_queued,
            tail,
        )

    @staticmethod
    def queued_bytes(queued_ms: np.ndarray) -> bytes:
        """Queue waits in ms, packed as the big-endian doubles of the replies' ``queued_ms`` (8 bytes each)."""
        return (
            (np.maximum(queued_ms, 0.0) + 0.0).astype(">f8").tobytes()
        )  # + 0.0: no -0.0, as max(0.0, x)

    def encode(self, rid: str, data: bytes, queued_ms: float, tail: bytes) -> bytes:
        """One ok reply: ``data`` is the request's outputs (``nbytes`` bytes, C order)."""
        packed_id = (
            _STR_HEADERS[len(rid)] + rid.encode() if len(rid) < 256 and rid.isascii() else pack(rid)
        )
        return b"".join(
            (
                self._map5,
                self._id_key,
                packed_id,
                self._ok_outputs,
                data,
                self._model_queued,
                _DOUBLE.pack(queued_ms),
                tail,
            )
        )


_DOUBLE = struct.Struct(">d")
#: msgpack's header of an ASCII str of each length below 256 (fixstr, then str 8).
_STR_HEADERS = tuple(bytes((0xA0 | n,)) if n < 32 else bytes((0xD9, n)) for n in range(256))


_REPLY_LIMITS = Limits(max_body_bytes=1 << 30, max_tensors=4096, max_ndim=32)


def decode_reply(data: bytes) -> Reply:
    """Decode the single element of a reply list. Raises ProtocolError if malformed."""
    obj = unpack(data, _REPLY_LIMITS)
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
            ok=True, outputs=decode_inputs(obj["outputs"], _REPLY_LIMITS, "outputs"), **common
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
# straight off its first bytes and the rest decoded only when asked for.

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
        """The ``body`` field of a request for ``inputs`` (raises ProtocolError like encode_body)."""
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
    """``(id, ok)`` of a reply that starts ``{"id": STR, "ok": BOOL, ...}``, as the fleet writes them.

    Reads the msgpack bytes directly; None for any other layout (which
    :func:`decode_reply` then reads in full).
    """
    span = _id_span(raw)
    if span is None:
        return None
    start, end = span
    if raw.startswith(_OK_TRUE, end):
        ok = True
    elif raw.startswith(_OK_FALSE, end):
        ok = False
    else:
        return None
    try:
        return raw[start:end].decode("utf-8"), ok
    except UnicodeDecodeError:
        return None


_OK_TRUE, _OK_FALSE = b"\xa2ok\xc3", b"\xa2ok\xc2"


def _id_span(raw: bytes) -> tuple[int, int] | None:
    """Where the id string of a reply starting ``{"id": STR`` lies (fixstr or str8), else None."""
    if len(raw) < 9 or not raw.startswith(b"\xa2id", 1) or not 0x82 <= raw[0] <= 0x8F:
        return None
    tag = raw[4]
    if 0xA0 <= tag <= 0xBF:
        return 5, tag - 0x9B  # 5 + length
    if tag == 0xD9:
        return 6, 6 + raw[5]
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
        if span is not None and raw.startswith(_OK_TRUE, span[1]):
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


def validate_request_ids(rids: Sequence[str | bytes]) -> list[str]:
    """:func:`validate_request_id` of each id: one match over them all when all are valid str."""
    if set(map(type, rids)) <= {str}:
        joined = "\n".join([*rids, ""])  # type: ignore[list-item]
        # The newline count rules out an id with a newline of its own (see all_request_ids).
        if joined.count("\n") == len(rids) and _JOINED_RIDS_STR_RE.match(joined):
            return list(rids)  # type: ignore[arg-type]
    return [validate_request_id(rid) for rid in rids]
