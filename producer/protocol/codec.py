"""The msgpack codec of the wire contract and its tensors, with the bounds a decoder enforces.

The only module that imports msgpack. :func:`encode_inputs` /
:func:`decode_inputs` turn numpy structures (a tensor, a list of tensors, a
dict of tensors) into msgpack-ready maps and back. Decoding is strict and
bounded: dtype whitelist, exact byte counts, limits on sizes, nesting and
element counts, zero-copy views.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import msgpack
import numpy as np

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol.rules import shown

__all__ = [
    "DEFAULT_LIMITS",
    "DTYPES",
    "OUTPUT_LIMITS",
    "Inputs",
    "Limits",
    "decode_inputs",
    "decode_outputs",
    "encode_inputs",
    "encode_outputs",
    "encode_tensor",
    "pack",
    "row_count",
    "unpack",
]

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
#: What a reader of outputs allows: the worker is trusted further than a producer.
OUTPUT_LIMITS = Limits(max_body_bytes=1 << 30, max_tensors=4096, max_ndim=32)


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
    # an empty array's memoryview cannot be cast
    data = memoryview(arr).cast("B") if arr.size else b""  # type: ignore[arg-type]
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
    return decode_inputs(unpack(data, OUTPUT_LIMITS), OUTPUT_LIMITS, "outputs")


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
            f"{where}: shape must be a list of 1 to {limits.max_ndim} non-negative ints, "
            f"got {shown(shape)}"
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
        # a raw input (version 1.2): one row that a handler decodes
        return obj  # type: ignore[return-value]
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
