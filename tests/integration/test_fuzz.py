"""Fuzz two real worker processes with >= 10,000 hostile, mutated and valid stream entries.

Hypothesis draws batches of entries (random bytes, random msgpack
structures, valid bodies with one field broken, ext types, truncations, bit
flips, odd envelopes, request ids at their length limits...). Each batch is
written to a real redis-server with one pipelined XADD per entry; the test
then waits until group ``workers`` has delivered and acknowledged everything
and checks every entry against the wire contract (docs/protocol.md):

* an entry with a readable request id gets exactly one well-formed reply, in
  the right list, with the code the contract implies (``ok`` for bodies an
  independent reference decoder accepts, ``bad_request`` for the rest,
  ``expired`` for past deadlines...); an ok reply equals a direct torch
  forward of models/affine.pt;
* an entry without a readable id gets no reply and is acknowledged;
* the workers stay alive, nothing is left pending, and nothing is written
  outside the queue's own keys.

Like a foreign client, this module speaks only ``redis`` and ``msgpack``:
every key, field and byte is written out from the contract.
"""

from __future__ import annotations

import collections
import itertools
import random
import re
import string
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

NAME = "fuzz"
BASE = f"inferfleet:{{{NAME}}}:"
STREAM = BASE + "requests"
INBOX = BASE + "inbox:"
GROUP = "workers"
CODES = frozenset({"ok", "bad_request", "too_large", "expired", "model_error", "dead_letter"})
MAX_BODY = 16 * 1024 * 1024  # the worker's default --max-body-bytes

BATCH_SIZE = 100
BATCHES = 101  # hypothesis examples: BATCH_SIZE * BATCHES entries plus two at the body size limit
MIN_ENTRIES = 10_000
SETTLE_TIMEOUT_S = 20.0

RID_CHARS = string.ascii_letters + string.digits + "._:-"
RID_RE = re.compile(rb"[A-Za-z0-9._:-]{1,128}\Z")
#: Worker message of the catch-all in worker/serving/intake.py: a decoder raised something
#: unexpected.
CATCH_ALL = "the request could not be decoded"

_counter = itertools.count()  # every readable request id embeds a fresh number: never reused
_short_rids = {1: iter(RID_CHARS), 2: (a + b for a in RID_CHARS for b in RID_CHARS)}


def reply_key(rid: str) -> str:
    return f"{BASE}reply:{rid}"


# --------------------------------------------------------------------------- entries


@dataclass
class Entry:
    """One stream entry and what the contract allows as its answer."""

    fields: list[tuple[bytes, bytes]]  # written in this order; a name may repeat
    what: str
    rids: tuple[str, ...] = ()  # readable ids of which exactly one is answered; () = never answered
    allowed: frozenset | None = (
        None  # acceptable (reply list, code) pairs; None = any contract code
    )
    bodies: tuple[bytes, ...] = ()  # an ok reply must equal the forward pass of one of these
    unreadable_id: bytes | None = None  # an id that must never get a reply list

    def __repr__(self) -> str:  # hypothesis prints whole batches: keep it readable
        return f"Entry({self.what!r}, rids={self.rids})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # what hypothesis prints with
        printer.text(repr(self))


def reference_rows(body: bytes) -> np.ndarray | None:
    """The float32[N,16] array if ``body`` is a request affine.pt must answer ok, else None.

    Written from the contract, independently of producer/protocol/: a map
    with ``inputs`` (one TENSOR of float32[N>=1,16]) and optionally empty or
    nil ``params`` (TorchScript models take none); no ext types, string keys.
    """
    if len(body) > MAX_BODY:
        return None
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0, ext_hook=_no_ext)
    except Exception:  # noqa: BLE001 - anything msgpack refuses is a bad request
        return None
    if not isinstance(obj, dict) or "inputs" not in obj or not set(obj) <= {"inputs", "params"}:
        return None
    params, tensor = obj.get("params"), obj["inputs"]
    if params is not None and (not isinstance(params, dict) or params):
        return None
    if not isinstance(tensor, dict) or set(tensor) != {"dtype", "shape", "data"}:
        return None
    shape, data = tensor["shape"], tensor["data"]
    if tensor["dtype"] != "float32" or not isinstance(shape, list) or len(shape) != 2:
        return None
    if not all(type(d) is int for d in shape) or shape[0] < 1 or shape[1] != 16:
        return None
    if not isinstance(data, bytes) or len(data) != shape[0] * 64:
        return None
    return np.frombuffer(data, dtype="<f4").reshape(shape)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"ext type {code}")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def wide_pack(obj: Any, rng: random.Random) -> bytes:
    """msgpack with randomly non-minimal headers (map16 for 1 key, uint64 for 16...): same value."""
    if isinstance(obj, dict):
        head = _sized(len(obj), rng, 0x80, 15, b"\xde", b"\xdf")
        return head + b"".join(wide_pack(k, rng) + wide_pack(v, rng) for k, v in obj.items())
    if isinstance(obj, list):
        return _sized(len(obj), rng, 0x90, 15, b"\xdc", b"\xdd") + b"".join(
            wide_pack(v, rng) for v in obj
        )
    if isinstance(obj, str):
        raw = obj.encode()
        return _sized(len(raw), rng, 0xA0, 31, b"\xda", b"\xdb", b"\xd9") + raw
    if isinstance(obj, bytes):
        return (
            rng.choice(
                [b"\xc5" + struct.pack(">H", len(obj)), b"\xc6" + struct.pack(">I", len(obj))]
            )
            + obj
        )
    if isinstance(obj, int) and not isinstance(obj, bool) and 0 <= obj < 2**63:
        return rng.choice(
            [b"\xcf" + struct.pack(">Q", obj), b"\xd3" + struct.pack(">q", obj), pack(obj)]
        )
    return pack(obj)


def _sized(
    n: int,
    rng: random.Random,
    fix: int,
    fix_max: int,
    head16: bytes,
    head32: bytes,
    head8: bytes | None = None,
) -> bytes:
    choices = [head16 + struct.pack(">H", n), head32 + struct.pack(">I", n)]
    if n <= fix_max:
        choices.append(bytes([fix | n]))
    if head8 is not None and n < 256:
        choices.append(head8 + bytes([n]))
    return rng.choice(choices)


# --------------------------------------------------------------------------- strategies

seeds = st.integers(0, 2**32 - 1)
msgpack_ints = st.integers(-(2**63), 2**64 - 1)
keywords = st.sampled_from(
    ["inputs", "params", "dtype", "shape", "data", "float32", "bool", "id", ""]
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    msgpack_ints,
    st.floats(),
    st.floats(width=32),
    st.text(max_size=12),
    st.binary(max_size=24),
    keywords,
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
)
map_keys = st.one_of(
    keywords,
    st.text(max_size=6),
    msgpack_ints,
    st.binary(max_size=4),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
)
structures = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(map_keys, inner, max_size=5),
    max_leaves=10,
)

DTYPE_SIZES = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
}
ODD_DTYPES = [
    "Float32",
    "FLOAT32",
    "float32 ",
    " float32",
    "float32\x00",
    "float",
    "f4",
    "<f4",
    ">f4",
    "float128",
    "bfloat16",
    "complex64",
    "object",
    "str",
    "",
    "float32" * 10,
    "floåt32",
]


@st.composite
def valid_tensor(draw: Callable, max_rows: int = 200) -> dict:
    rows = draw(st.integers(1, 8) | st.integers(1, max_rows))
    x = np.random.default_rng(draw(seeds)).standard_normal((rows, 16), dtype=np.float32)
    return {"dtype": "float32", "shape": [rows, 16], "data": x.tobytes()}


@st.composite
def well_formed_body(draw: Callable) -> tuple[bytes, str]:
    tensor = draw(valid_tensor())
    if draw(st.booleans()):
        tensor = {k: tensor[k] for k in ("data", "shape", "dtype")}  # key order is free
    body: dict[str, Any] = {"inputs": tensor}
    params = draw(st.sampled_from(["absent", "empty", "nil", "first"]))
    if params == "empty":
        body["params"] = {}
    elif params == "nil":
        body["params"] = None
    elif params == "first":
        body = {"params": {}, "inputs": tensor}
    if draw(st.integers(0, 4)) == 0:
        return wide_pack(
            body, random.Random(draw(seeds))
        ), f"well-formed wide-encoded, params {params}"
    return pack(body), f"well-formed {tensor['shape']}, params {params}"


def _shape_cases(rows: int, data: bytes) -> list[tuple[Any, bytes]]:
    return [
        ([rows], data),
        ([rows * 16], data),
        ([rows, 16, 1], data),
        ([rows, 4, 4], data),
        ([1] * 9, data[:4]),
        ([1] * 8, data[:4]),
        ([], data),
        ([], data[:4]),
        ([0, 16], b""),
        ([-1, 16], data),
        ([rows, -16], data),
        ([2**63 - 1, 16], data),
        ([2**64 - 1, 16], data),
        ([rows, 16.0], data),
        ([float(rows), 16], data),
        ([True, 16], data[:64]),
        ([rows, True], data),
        ([None, 16], data),
        ("16", data),
        (None, data),
        ({"0": rows}, data),
        ([[rows], [16]], data),
        ([2**24, 0], b""),
        ([2**24 + 1, 0], b""),
        ([2**24] * 3 + [0], b""),
        ([0] + [2**24] * 7, b""),
        ([rows, 16, 0], b""),
        ((rows, 16), data),
    ]


def _one_row(data: bytes, rows: int = 1) -> dict:
    return {
        "dtype": "float32",
        "shape": [rows, 16],
        "data": data[:64] if rows == 1 else bytes(64 * rows),
    }


def _mutate_dtype(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    t["dtype"] = draw(st.sampled_from(ODD_DTYPES) | st.just(b"float32") | structures)
    return body, f"dtype {t['dtype']!r:.40}"


def _mutate_other_dtype(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    name = draw(st.sampled_from(sorted(set(DTYPE_SIZES) - {"float32"})))
    t.update(dtype=name, data=bytes(t["shape"][0] * 16 * DTYPE_SIZES[name]))
    return body, f"dtype {name}"


def _mutate_shape(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    shape, t["data"] = draw(st.sampled_from(_shape_cases(t["shape"][0], t["data"])))
    t["shape"] = list(shape) if isinstance(shape, tuple) else shape
    return body, f"shape {t['shape']!r:.60} with {len(t['data'])} bytes"


def _mutate_dims(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    """Random dims; zero-size ones pass the byte count with empty data."""
    dims = draw(
        st.lists(st.integers(0, 2**24) | st.sampled_from([0, 1, 16, 2**24]), min_size=1, max_size=9)
        | st.lists(msgpack_ints, max_size=10)
    )
    t["data"] = b"" if 0 in dims else draw(st.sampled_from([t["data"], t["data"][:4], b""]))
    t["shape"] = dims
    return body, f"shape {dims!r:.80} with {len(t['data'])} bytes"


def _mutate_data(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    data = t["data"]
    t["data"] = draw(
        st.sampled_from(
            [
                data[:-1],
                data + b"\0",
                b"",
                data * 2,
                data[:-4],
                data.hex()[:64],
                [0.0] * 16,
                None,
                0,
                True,
                msgpack.ExtType(1, data[:8]),
            ]
        )
    )
    return (
        body,
        f"data {type(t['data']).__name__} of "
        f"{len(t['data']) if hasattr(t['data'], '__len__') else '-'}",
    )


def _mutate_bool(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    size = t["shape"][0] * 16
    raw = bytearray(draw(st.binary(min_size=size, max_size=size)))
    raw[draw(st.integers(0, size - 1))] = draw(st.integers(2, 255))
    t.update(dtype="bool", data=bytes(raw))
    return body, "bool data with a byte over 1"


def _mutate_tensor_keys(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    change = draw(st.sampled_from(["extra", "missing", "bin_key", "int_key"]))
    if change == "extra":
        t[draw(st.text(max_size=6).filter(lambda k: k not in t))] = draw(structures)
    elif change == "missing":
        del t[draw(st.sampled_from(["dtype", "shape", "data"]))]
    elif change == "bin_key":
        t[b"data"] = t.pop("data")
    else:
        t[1] = 1
    return body, f"tensor keys: {change}"


def _mutate_body_keys(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    return draw(
        st.sampled_from(
            [
                {"inputs": t, "meta": 1},
                {"params": {}},
                {},
                {b"inputs": t},
                {"input": t},
                {1: t},
                {"inputs": t, None: 0},
                [t],
                t,
                {"inputs": {"inputs": t}},
            ]
        )
    ), "body keys"


def _mutate_list(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    count = draw(st.sampled_from([0, 1, 2, 63, 64, 65, 100]))
    items: list[Any] = [_one_row(t["data"])] * count
    if count and draw(st.booleans()):
        items[-1] = _one_row(t["data"], rows=2)  # row counts differ
    body["inputs"] = items
    return body, f"list of {count} tensors"


def _mutate_map(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    one = _one_row(t["data"])
    body["inputs"] = draw(
        st.sampled_from(
            [
                {"x": one},
                {},
                {str(i): one for i in range(65)},
                {1: one},
                {b"x": one},
                {None: one},
                {"dtype": one},
                {"x": one, "y": _one_row(t["data"], rows=2)},
            ]
        )
    )
    return body, "map of tensors"


def _mutate_params(draw: Callable, body: dict, t: dict) -> tuple[Any, str]:
    body["params"] = draw(
        st.sampled_from(
            [
                [],
                0,
                1,
                "x",
                True,
                False,
                b"",
                1.5,
                {"a": 1},
                {"temperature": 0.5},
                {1: 2},
                {"": None},
                {str(i): i for i in range(65)},
                [{}],
                {},
                None,
            ]
        )
        | structures
    )
    return body, f"params {body['params']!r:.40}"


MUTATIONS: dict[str, Callable[[Callable, dict, dict], tuple[Any, str]]] = {
    "dtype": _mutate_dtype,
    "other_dtype": _mutate_other_dtype,
    "shape": _mutate_shape,
    "dims": _mutate_dims,
    "data": _mutate_data,
    "bool": _mutate_bool,
    "tensor_keys": _mutate_tensor_keys,
    "body": _mutate_body_keys,
    "list": _mutate_list,
    "map": _mutate_map,
    "params": _mutate_params,
}


@st.composite
def mutated_body(draw: Callable) -> tuple[bytes, str]:
    """A valid body with one field broken."""
    tensor = draw(valid_tensor(max_rows=64))
    body: dict[Any, Any] = {"inputs": tensor}
    mutated, label = MUTATIONS[draw(st.sampled_from(sorted(MUTATIONS)))](draw, body, tensor)
    return pack(mutated), label


@st.composite
def structure_body(draw: Callable) -> tuple[bytes, str]:
    """Valid msgpack of random structures, at the top or inside the request's layers."""
    place = draw(st.sampled_from(["top", "inputs", "inputs+params", "tensor", "list"]))
    s = draw(structures)
    if place == "top":
        return pack(s), "random structure"
    if place == "inputs":
        return pack({"inputs": s}), "random inputs"
    if place == "inputs+params":
        return pack({"inputs": s, "params": draw(structures)}), "random inputs and params"
    if place == "tensor":
        return pack(
            {"inputs": {"dtype": s, "shape": draw(structures), "data": draw(structures)}}
        ), "random tensor"
    return pack({"inputs": [s, draw(structures)]}), "random list inputs"


@st.composite
def ext_body(draw: Callable) -> tuple[bytes, str]:
    tensor = draw(valid_tensor(max_rows=4))
    ext = draw(
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16))
        | st.builds(msgpack.Timestamp, st.integers(0, 2**33), st.integers(0, 999_999_999))
    )
    where = draw(st.sampled_from(["top", "inputs", "dtype", "shape", "data", "params", "raw"]))
    if where == "raw":  # zero-length and negative-code exts, hand written
        raw = draw(
            st.sampled_from(
                [b"\xc7\x00\x05", b"\xd4\x80\x00", b"\xd5\xff\x00\x00", b"\xc7\x01\x81\x00"]
            )
        )
        return b"\x81\xa6inputs" + raw, "ext raw"
    if where == "top":
        return pack(ext), "ext top"
    if where == "inputs":
        return pack({"inputs": ext}), "ext inputs"
    if where == "params":
        return pack({"inputs": tensor, "params": {"p": ext}}), "ext params"
    tensor[where] = [ext, 16] if where == "shape" else ext
    return pack({"inputs": tensor}), f"ext {where}"


@st.composite
def damaged_body(draw: Callable) -> tuple[bytes, str]:
    """A valid body truncated, bit-flipped, padded, or hand-written to strain the decoder."""
    body, _ = draw(well_formed_body())
    how = draw(
        st.sampled_from(
            ["truncated", "bitflip", "bitflip", "trailing", "dup_keys", "deep", "huge_len", "empty"]
        )
    )
    if how == "truncated":
        return body[: draw(st.integers(0, len(body) - 1))], "truncated"
    if how == "bitflip":
        flipped = bytearray(body)
        for bit in draw(st.lists(st.integers(0, len(body) * 8 - 1), min_size=1, max_size=4)):
            flipped[bit // 8] ^= 1 << (bit % 8)
        return bytes(flipped), "bit flips"
    if how == "trailing":
        return body + draw(st.binary(min_size=1, max_size=8)), "trailing bytes"
    if how == "dup_keys":  # a map that names "inputs" twice: decoders keep the last one
        junk = pack(draw(st.sampled_from([1, "x", None, [], {"dtype": "float32"}])))
        inner = (
            body[1 + len(pack("inputs")) :]
            if body[:1] == b"\x81" and body[1:8] == pack("inputs")
            else pack(1)
        )
        pairs = [pack("inputs") + junk, pack("inputs") + inner]
        if draw(st.booleans()):
            pairs.reverse()
        return b"\x82" + b"".join(pairs), "duplicate inputs key"
    if how == "deep":
        depth = draw(st.sampled_from([100, 1000, 5000, 100_000]))
        nest = draw(st.sampled_from([b"\x91", b"\x81\xa1a"]))
        return b"\x81\xa6inputs" + nest * depth + b"\xc0", f"nested {depth} deep"
    if how == "huge_len":  # declared lengths of gigabytes with no data behind them
        head = draw(
            st.sampled_from(
                [
                    b"\xdb\xff\xff\xff\xff",
                    b"\xc6\x7f\xff\xff\xff",
                    b"\xdd\xff\xff\xff\xff",
                    b"\xdf\xff\xff\xff\xff",
                    b"\xc9\xff\xff\xff\xff\x05",
                ]
            )
        )
        return b"\x81\xa6inputs" + head + b"\x00" * draw(st.integers(0, 8)), "huge declared length"
    return b"", "empty body"


fuzzed_body = st.one_of(
    st.binary(max_size=256).map(lambda b: (b, "random bytes")),
    structure_body(),
    mutated_body(),
    mutated_body(),
    ext_body(),
    damaged_body(),
    damaged_body(),
)

VALID_INBOXES = [INBOX + "fuzz", INBOX + "a.b_c-d:e", INBOX + "x" * 256]
#: Not this queue's inbox, or (docs/protocol.md, "This worker") a suffix that is not 1 to 256
#: ASCII characters without braces or whitespace: refused with bad_request to the default key.
INVALID_REPLY_TO = [
    b"evil:key",
    b"inferfleet:{other}:inbox:x",
    BASE.encode() + b"requests",
    BASE.encode() + b"reply:x",
    BASE.encode() + b"dead",
    BASE.encode() + b"inboxx",
    b"INFERFLEET:{fuzz}:inbox:x",
    b" " + INBOX.encode() + b"x",
    INBOX.encode() + b"\xff",
    INBOX.encode() + "\u00e9".encode(),
    b"",
    b"inferfleet:{fuzz}:inbox",
    INBOX.encode(),
    INBOX.encode() + b"x" * 257,
    INBOX.encode() + b"a{b",
    INBOX.encode() + b"a b",
    INBOX.encode() + b"a\tb",
    INBOX.encode() + b"a}",
    INBOX.encode() + b"a\r\n",
]
#: Not 1 to 16 decimal digits: bad_request.
GARBAGE_DEADLINES = [
    b"",
    b"abc",
    b"-5",
    b"1.5",
    b" 123",
    b"+5",
    b"1e9",
    b"0x10",
    "\u0661\u0662".encode(),
    b"\xff",
    b"12 ",
    b"9" * 40,
    b"1" + b"0" * 16,
    b"0" * 17 + b"1",
]


def readable_rid(draw: Callable) -> str:
    stem = f"fz{next(_counter)}."  # digits then "." keep every id unique
    how = draw(st.sampled_from(["plain", "plain", "plain", "text", "max", "one", "two"]))
    if how in ("one", "two"):
        short = next(_short_rids[1 if how == "one" else 2], None)
        if short is not None:
            return short
    if how == "max":
        return stem + "".join(random.Random(draw(seeds)).choices(RID_CHARS, k=128 - len(stem)))
    if how == "text":
        return stem + draw(st.text(RID_CHARS, max_size=24))
    return stem


def unreadable_id(draw: Callable) -> bytes | None:
    how = draw(st.sampled_from(["missing", "empty", "129", "bad_char", "bad_char", "random"]))
    if how == "missing":
        return None
    if how == "empty":
        return b""
    if how == "129":
        return f"fz{next(_counter)}.".encode().ljust(129, b"x")
    if how == "bad_char":
        stem = f"fz{next(_counter)}.".encode()
        at = min(
            draw(st.integers(0, 12)), len(stem)
        )  # no bound from external state: hypothesis replays
        bad = draw(
            st.sampled_from(
                [b" ", b"{", b"}", b"/", b"\x00", b"\xff", "é".encode(), b"\n", b"*", b"+", b"@"]
            )
        )
        return stem[:at] + bad + stem[at:]
    return draw(st.binary(min_size=1, max_size=40).filter(lambda b: not RID_RE.match(b)))


def outcomes(
    rid: str, body: bytes | None, deadline: str, reply: str, reply_to: bytes | None
) -> frozenset:
    """The (reply list, code) pairs allowed for an entry with a readable id.

    The worker's checks in their documented order (docs/protocol.md): body
    present, deadline format, reply_to, deadline passed, then the body.
    """
    default = reply_key(rid)
    if body is None or deadline == "garbage" or reply == "invalid":
        return frozenset({(default, "bad_request")})
    where = reply_to.decode() if reply_to is not None else default
    if deadline == "past":
        return frozenset({(where, "expired")})
    rows = reference_rows(body)
    if rows is None:
        return frozenset({(where, "bad_request")})
    if not np.all(
        np.isfinite(rows) & (np.abs(rows) <= 1e30)
    ):  # bit flips make NaN, Inf and huge inputs:
        return frozenset(
            {(where, "ok"), (where, "model_error")}
        )  # NaN/Inf outputs answer model_error
    return frozenset({(where, "ok")})


@st.composite
def envelope(
    draw: Callable, clean: bool
) -> tuple[list[tuple[bytes, bytes]], str, str, bytes | None]:
    """Optional entry fields: (fields, deadline kind, reply_to kind, reply_to)."""
    now_ms = int(time.time() * 1000)
    fields: list[tuple[bytes, bytes]] = []
    kinds = ["none", "none", "future"] if clean else ["none", "future", "past", "garbage"]
    deadline = draw(st.sampled_from(kinds))
    if deadline == "future":
        fields.append((b"deadline", str(now_ms + 3_600_000).encode()))
    elif deadline == "past":
        fields.append(
            (
                b"deadline",
                draw(
                    st.sampled_from(
                        [b"0", b"1", str(now_ms - 60_000).encode(), b"0" * 16, b"000123"]
                    )
                ),
            )
        )
    elif deadline == "garbage":
        fields.append((b"deadline", draw(st.sampled_from(GARBAGE_DEADLINES))))
    kinds = ["none", "none", "valid"] if clean else ["none", "valid", "invalid"]
    reply = draw(st.sampled_from(kinds))
    pool = {"none": [], "valid": [k.encode() for k in VALID_INBOXES], "invalid": INVALID_REPLY_TO}[
        reply
    ]
    reply_to = draw(st.sampled_from(pool)) if pool else None
    if reply_to is not None:
        fields.append((b"reply_to", reply_to))
    if draw(st.integers(0, 5)) == 0:  # unknown fields are ignored
        name = draw(st.sampled_from([b"ID", b"Body", b"id ", b"", b"\xff", b"params", b"trace"]))
        fields.append((name, draw(st.binary(max_size=16))))
    return fields, deadline, reply, reply_to


@st.composite
def entries(draw: Callable) -> Entry:
    kind = draw(
        st.sampled_from(
            ["well_formed"] * 2
            + ["body"] * 10
            + ["envelope"] * 4
            + ["unreadable"] * 2
            + ["duplicate"] * 2
        )
    )
    if kind == "unreadable":
        rid_value = unreadable_id(draw)
        body, label = draw(well_formed_body() | fuzzed_body)
        extra, *_ = draw(envelope(clean=False))
        fields = ([] if rid_value is None else [(b"id", rid_value)]) + [(b"body", body)] + extra
        return Entry(
            draw(st.permutations(fields)),
            f"unreadable id {rid_value!r}, {label}",
            unreadable_id=rid_value,
        )
    if kind == "duplicate":
        return draw(duplicate_entry())
    rid = readable_rid(draw)
    if kind == "well_formed":
        body, label = draw(well_formed_body())
        assert reference_rows(body) is not None, label
        extra, deadline, reply, reply_to = draw(envelope(clean=True))
    elif kind == "body":
        body, label = draw(fuzzed_body)
        extra, deadline, reply, reply_to = [], "none", "none", None
    else:
        body, label = draw(well_formed_body() | fuzzed_body)
        extra, deadline, reply, reply_to = draw(envelope(clean=False))
    fields = [(b"id", rid.encode())] + [(b"body", body)] + extra
    if kind == "envelope" and draw(st.integers(0, 5)) == 0:
        fields, body, label = [f for f in fields if f[0] != b"body"], None, "no body"
    what = f"{kind}: {label}; deadline {deadline}, reply_to {reply} {reply_to!r}"
    return Entry(
        draw(st.permutations(fields)),
        what,
        (rid,),
        outcomes(rid, body, deadline, reply, reply_to),
        () if body is None else (body,),
    )


@st.composite
def duplicate_entry(draw: Callable) -> Entry:
    """An entry naming a field twice: exactly one of its ids is answered, with any code."""
    rids = (readable_rid(draw), readable_rid(draw))
    first, _ = draw(well_formed_body())
    second, label = draw(well_formed_body() | fuzzed_body)
    fields = [(b"id", rids[0].encode()), (b"id", rids[1].encode()), (b"body", first)]
    if draw(st.booleans()):
        fields.append((b"body", second))
    extra, *_ = draw(envelope(clean=False))
    fields += extra + draw(
        st.sampled_from(
            [
                [],
                [(b"reply_to", VALID_INBOXES[0].encode())],
                [(b"deadline", b"0"), (b"deadline", b"abc")],
            ]
        )
    )
    return Entry(
        draw(st.permutations(fields)), f"duplicate fields, {label}", rids, None, (first, second)
    )


def limit_entries() -> list[Entry]:
    """A valid body of exactly the size limit (ok) and one a byte over it (too_large).

    Non-minimal headers pad the 46-byte envelope of float32[N,16] to 64 bytes.
    """
    rows = (MAX_BODY - 64) // 64
    data = np.random.default_rng(7).standard_normal((rows, 16), dtype=np.float32).tobytes()

    def body(data_key: bytes) -> bytes:
        return (
            b"\x81"
            + b"\xda\x00\x06inputs"
            + b"\x83"
            + b"\xdb\x00\x00\x00\x05dtype"
            + pack("float32")
            + pack("shape")
            + b"\x92"
            + b"\xcf"
            + struct.pack(">Q", rows)
            + b"\xcf"
            + struct.pack(">Q", 16)
            + data_key
            + b"\xc6"
            + struct.pack(">I", len(data))
            + data
        )

    at_limit, over = body(pack("data")), body(b"\xd9\x04data")
    assert (len(at_limit), len(over)) == (MAX_BODY, MAX_BODY + 1)
    assert reference_rows(at_limit) is not None
    result = []
    for what, payload, code in (
        ("body at the size limit", at_limit, "ok"),
        ("body over the limit", over, "too_large"),
    ):
        rid = f"fz{next(_counter)}.limit"
        result.append(
            Entry(
                [(b"id", rid.encode()), (b"body", payload)],
                what,
                (rid,),
                frozenset({(reply_key(rid), code)}),
                (payload,),
            )
        )
    return result


# --------------------------------------------------------------------------- the run


@dataclass
class Tally:
    sent: int = 0
    batches: int = 0
    codes: collections.Counter = field(default_factory=collections.Counter)
    catch_all: list[str] = field(default_factory=list)
    reply_keys: set[str] = field(default_factory=set)
    unreadable: set[bytes] = field(default_factory=set)
    inbox_replies: int = 0


class Fleet:
    """Writes batches to the stream, waits for the workers, checks every reply."""

    def __init__(
        self,
        client: redis.Redis,
        procs: list[subprocess.Popen],
        model: Any,
        logs: collections.deque,
    ) -> None:
        self.client, self.procs, self.model, self.logs = client, procs, model, logs
        self.tally = Tally()

    def run(self, batch: list[Entry]) -> None:
        self.verify(batch, self.send(batch))

    def verify(self, batch: list[Entry], last_id: bytes) -> None:
        """Wait until the workers are done with everything up to ``last_id``; check ``batch``."""
        self.settle(last_id)
        self.check(batch, self.collect(batch))
        dead = [p.pid for p in self.procs if p.poll() is not None]
        assert not dead, f"workers {dead} died after {self.tally.sent} entries:\n{self.log_tail()}"

    def send(self, batch: list[Entry]) -> bytes:
        pipe = self.client.pipeline(transaction=False)
        for entry in batch:
            pipe.execute_command("XADD", STREAM, "*", *itertools.chain.from_iterable(entry.fields))
        ids = pipe.execute()
        self.tally.sent += len(batch)
        self.tally.batches += 1
        return ids[-1]

    def settle(self, last_id: bytes) -> None:
        """Wait until group ``workers`` has delivered up to ``last_id`` and holds nothing
        pending."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            group = next(g for g in self.client.xinfo_groups(STREAM) if g["name"] == GROUP.encode())
            if _id_key(group["last-delivered-id"]) >= _id_key(last_id) and group["pending"] == 0:
                return
            time.sleep(0.005)
        stuck = self.client.xpending_range(STREAM, GROUP, min="-", max="+", count=5)
        raise AssertionError(
            f"batch {self.tally.batches} not settled in {SETTLE_TIMEOUT_S} s "
            f"({self.tally.sent} entries sent): group {group}, pending {stuck}, "
            f"alive {[p.poll() is None for p in self.procs]}\n{self.log_tail()}"
        )

    def collect(self, batch: list[Entry]) -> dict[str, list[tuple[str, bytes]]]:
        """Every reply of the batch by request id: (list it was in, payload)."""
        pipe = self.client.pipeline(transaction=True)
        rids = [rid for entry in batch for rid in entry.rids]
        known = set(rids)
        for rid in rids:
            pipe.lrange(reply_key(rid), 0, -1)
        inboxes = VALID_INBOXES
        for key in inboxes:
            pipe.lrange(key, 0, -1)
        pipe.delete(*inboxes)
        results = pipe.execute()
        found: dict[str, list[tuple[str, bytes]]] = collections.defaultdict(list)
        for rid, payloads in zip(rids, results):
            found[rid] += [(reply_key(rid), p) for p in payloads]
            self.tally.reply_keys.update([reply_key(rid)] if payloads else [])
        for key, payloads in zip(inboxes, results[len(rids) :]):
            for payload in payloads:
                self.tally.inbox_replies += 1
                reply = msgpack.unpackb(payload, raw=False)
                answered = reply.get("id") if isinstance(reply, dict) else None
                assert answered in known, (
                    f"inbox {key} holds a reply to {answered!r}, no entry of this batch"
                )
                found[answered].append((key, payload))
        return found

    def check(self, batch: list[Entry], found: dict[str, list[tuple[str, bytes]]]) -> None:
        for entry in batch:
            if entry.unreadable_id is not None:
                self.tally.unreadable.add(entry.unreadable_id)
            replies = [
                (rid, key, payload) for rid in entry.rids for key, payload in found.get(rid, [])
            ]
            if not entry.rids:
                continue
            assert len(replies) == 1, (
                f"{entry.what}: {len(replies)} replies to ids {entry.rids} "
                f"(entry {entry.fields!r:.600}): {replies!r:.600}"
            )
            rid, key, payload = replies[0]
            code, reply = check_reply(payload, rid)
            self.tally.codes[code] += 1
            message = reply.get("error", {}).get("message", "")
            if message.startswith(CATCH_ALL):
                self.tally.catch_all.append(f"{entry.what}: {message}")
            allowed = entry.allowed
            if allowed is not None:
                assert (key, code) in allowed, (
                    f"{entry.what}: answered {code!r} in {key!r} ({message!r:.300}), "
                    f"allowed {sorted(allowed)}; fields {entry.fields!r:.600}"
                )
            if code == "ok":
                self.check_outputs(entry, reply)

    def check_outputs(self, entry: Entry, reply: dict) -> None:
        out = reply["outputs"]
        inputs = [x for x in map(reference_rows, entry.bodies) if x is not None]
        assert inputs, (
            f"{entry.what}: answered ok, but no body is a valid request: {entry.fields!r:.600}"
        )
        got = np.frombuffer(out["data"], dtype="<f4").reshape(out["shape"])
        assert np.all(np.isfinite(got)), (
            f"{entry.what}: an ok reply with NaN/Inf outputs (the guard is on)"
        )
        errors = []
        for x in inputs:
            if x.shape[0] != got.shape[0]:
                errors.append(f"{got.shape[0]} rows for {x.shape[0]}")
                continue
            with torch.no_grad():
                want = self.model(torch.from_numpy(x.copy())).numpy()
            sane = np.all(np.isfinite(x) & (np.abs(x) <= 1e4), axis=1)  # bit flips make huge inputs
            if np.allclose(got[sane], want[sane], rtol=1e-5, atol=1e-6, equal_nan=True):
                return
            errors.append(f"max abs diff {np.max(np.abs(got[sane] - want[sane]))}")
        raise AssertionError(f"{entry.what}: ok outputs differ from a direct forward: {errors}")

    def log_tail(self) -> str:
        return b"".join(list(self.logs)[-40:]).decode(errors="replace")


def check_reply(payload: bytes, rid: str) -> tuple[str, dict]:
    """Check one reply against the contract's reply format; return (code, reply)."""
    reply = msgpack.unpackb(payload, raw=False)
    assert isinstance(reply, dict) and reply.get("id") == rid and type(reply.get("ok")) is bool, (
        reply
    )
    if not reply["ok"]:
        error = reply.get("error")
        assert isinstance(error, dict) and isinstance(error.get("message"), str), reply
        assert error.get("code") in CODES - {"ok"}, f"unknown error code in {reply}"
        return error["code"], reply
    out, model, timing = reply.get("outputs"), reply.get("model"), reply.get("timing")
    assert isinstance(out, dict) and out.get("dtype") == "float32", reply
    assert isinstance(out.get("shape"), list) and len(out["shape"]) == 2 and out["shape"][1] == 4, (
        out.get("shape")
    )
    assert isinstance(out.get("data"), bytes) and len(out["data"]) == out["shape"][0] * 16
    assert (
        isinstance(model, dict)
        and model.get("name") == NAME
        and isinstance(model.get("version"), str)
    ), model
    assert isinstance(timing, dict) and {"queued_ms", "infer_ms", "batch_rows"} <= set(timing), (
        timing
    )
    assert timing["batch_rows"] >= out["shape"][0], timing
    return "ok", reply


def _id_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.decode().partition("-")
    return int(ms), int(seq or 0)


def pump_stderr(proc: subprocess.Popen, sink: collections.deque) -> None:
    """Read a worker's log so a full pipe never blocks it (it logs every unreadable entry)."""

    stream = proc.stderr
    assert stream is not None, "spawn_worker pipes stderr"

    def pump() -> None:
        try:
            for line in iter(stream.readline, b""):
                sink.append(line)
        except (OSError, ValueError):  # the fixture closed the pipe at teardown
            pass

    threading.Thread(target=pump, name=f"stderr-{proc.pid}", daemon=True).start()


class JoinFeeder:
    """Writes a valid request every 50 ms while the workers start, until stopped.

    They are checked like every other entry: requests that arrive while
    workers join the group are served too.
    """

    def __init__(self, redis_url: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.entries: list[Entry] = []
        self.last_id = b"0-0"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="join-feeder", daemon=True)

    def __enter__(self) -> JoinFeeder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()

    def _feed(self) -> None:
        rng = np.random.default_rng(0)
        while not self._stop.is_set():
            rid = f"fz{next(_counter)}.join"
            body = pack(
                {
                    "inputs": {
                        "dtype": "float32",
                        "shape": [1, 16],
                        "data": rng.standard_normal((1, 16), dtype=np.float32).tobytes(),
                    }
                }
            )
            entry = Entry(
                [(b"id", rid.encode()), (b"body", body)],
                "joining",
                (rid,),
                frozenset({(reply_key(rid), "ok")}),
                (body,),
            )
            self.last_id = self.client.xadd(STREAM, dict(entry.fields))
            self.entries.append(entry)
            self._stop.wait(0.05)


def fuzz_settings() -> settings:
    return settings(
        max_examples=BATCHES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.function_scoped_fixture,
        ],
    )


# a fixed amount of work (BATCHES hypothesis batches, most of the time spent generating them):
# 60-100 s on a quiet 2-core machine, past the suite's 120 s default when the machine is busy
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fuzzed_entries_are_answered_once_by_the_contract(
    spawn_worker: Callable, redis_url: str, redis_client: redis.Redis, models_dir: Path
) -> None:
    started = time.monotonic()
    model_path = str(models_dir / "affine.pt")
    logs: collections.deque = collections.deque(maxlen=2000)
    procs = []
    with JoinFeeder(redis_url) as feeder:
        for _ in range(2):
            procs.append(spawn_worker(NAME, model_path))
            pump_stderr(procs[-1], logs)
    fleet = Fleet(redis_client, procs, torch.jit.load(model_path), logs)
    fleet.tally.sent += len(feeder.entries)
    fleet.verify(feeder.entries, feeder.last_id)

    @fuzz_settings()
    @given(st.lists(entries(), min_size=BATCH_SIZE, max_size=BATCH_SIZE))
    def fuzz(batch: list[Entry]) -> None:
        fleet.run(batch)

    fuzz()
    fleet.run(limit_entries())
    tally = fleet.tally
    summary = (
        f"{tally.sent} entries in {tally.batches} batches, {time.monotonic() - started:.1f} s; "
        f"codes {dict(tally.codes)}; {len(tally.unreadable)} unreadable ids; "
        f"{tally.inbox_replies} replies in inboxes; {len(tally.catch_all)} answered by the "
        f"intake catch-all (a decoder raised something other than ProtocolError)"
    )
    print(summary)
    for line in tally.catch_all[:5]:
        print("  catch-all:", line)

    assert tally.sent >= MIN_ENTRIES, summary
    assert not tally.catch_all, (
        f"a decoder raised something other than ProtocolError: {tally.catch_all[:5]}"
    )
    assert (
        tally.codes["ok"] >= tally.sent // 20 and tally.codes["bad_request"] >= tally.sent // 4
    ), summary
    assert all(p.poll() is None for p in procs), f"a worker died: {summary}\n{fleet.log_tail()}"
    assert redis_client.xpending(STREAM, GROUP)["pending"] == 0, summary
    assert_only_own_keys(redis_client, tally, summary)


def assert_only_own_keys(client: redis.Redis, tally: Tally, summary: str) -> None:
    """Nothing outside the queue's keys, one element per reply list, none for unreadable ids."""
    keys = {k.decode(errors="replace") for k in client.keys("*")}
    outside = sorted(k for k in keys if not k.startswith(BASE))
    assert not outside, f"keys written outside {BASE}: {outside[:10]} ({summary})"
    replies = {k for k in keys if k.startswith(BASE + "reply:")}
    assert replies == tally.reply_keys, (
        f"unexpected reply lists {sorted(replies - tally.reply_keys)[:10]}"
    )
    assert not {k for k in keys if k.startswith(INBOX)}, "a late reply reached an inbox"
    pipe = client.pipeline(transaction=False)
    for key in sorted(replies):
        pipe.llen(key)
    lengths = pipe.execute()
    assert set(lengths) <= {1}, f"reply lists with {set(lengths)} elements ({summary})"
    for rid in tally.unreadable:
        assert not client.exists(BASE.encode() + b"reply:" + rid), (
            f"unreadable id {rid!r} was answered"
        )


def test_zero_size_tensor_with_huge_dims_is_refused_to_the_inbox(
    spawn_worker: Callable, redis_url: str, redis_client: redis.Redis, models_dir: Path
) -> None:
    with JoinFeeder(redis_url):
        spawn_worker(NAME, str(models_dir / "affine.pt"))
    body = pack({"inputs": {"dtype": "float32", "shape": [2**24] * 3 + [0], "data": b""}})
    inbox = INBOX + "huge-dims"
    redis_client.xadd(STREAM, {"id": "huge-dims", "body": body, "reply_to": inbox})
    got = redis_client.blpop([inbox, reply_key("huge-dims")], timeout=20)
    assert got is not None, "no reply within 20 s"
    key, payload = got
    error = msgpack.unpackb(payload, raw=False)["error"]
    assert error["code"] == "bad_request", error
    assert key.decode() == inbox, f"answered in {key!r}, not the reply_to inbox: {error}"
    assert not error["message"].startswith(CATCH_ALL), error
