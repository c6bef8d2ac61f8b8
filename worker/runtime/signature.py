"""The input spec: the form of a request's inputs that a model cares about.

A spec is the input form (one tensor, a list or a map), each tensor's dtype
and its trailing shape (every dimension but the batch). The runtime takes one
from the model: from the file's signature where its format carries one
(torch.export, ONNX), from ``--input-spec``, or from the model's example.
Intake compares each request's against it, and batching groups requests whose
specs (and params) are equal. Pure numpy: importing this does not import torch.

A model's spec may name a trailing dimension instead of fixing it
(``int64[N,L]``): that dimension varies from request to request. Requests of
equal lengths still share batches (their specs are equal); a handler that
pads (:func:`inferfleet.worker.handler.pad_batch`) batches them all together.

The written form, which :func:`describe_spec` prints and :func:`parse_spec`
reads (``--input-spec``): ``float32[N,16]`` (one tensor),
``(float32[N,13], int64[N,26])`` (positional tensors),
``{ids: int64[N,L], mask: bool[N,L]}`` (named tensors). The first dimension
is always the batch (any name); a trailing one is a size or a name (``L``,
``*``): tensors that share a name must share the length.
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import Any, cast

import numpy as np

__all__ = [
    "RAW_SPECS",
    "SpecError",
    "describe_spec",
    "parse_spec",
    "spec_fits",
    "spec_of",
    "synthesize",
]

#: The specs of raw inputs (a msgpack str or bin instead of tensors: protocol version 1.2).
RAW_SPECS = (("raw", "str"), ("raw", "bytes"))

_DTYPE_NAMES = ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64")
_TENSOR_RE = re.compile(r"\s*([a-z0-9]+)\s*\[([^\]]*)\]\s*\Z")
_NAME_RE = re.compile(r"[A-Za-z_*][A-Za-z0-9_]*\Z")


class SpecError(ValueError):
    """An ``--input-spec`` that cannot be read; the message shows the accepted form."""


def _tensor_spec(arr: np.ndarray) -> tuple[np.dtype, tuple[int, ...]]:
    return (arr.dtype, arr.shape[1:])  # the dtype object itself: dtype.name is slow


def spec_of(inputs: Any) -> Hashable:
    """The batching-relevant form of inputs: structure, dtypes, trailing shapes."""
    if isinstance(inputs, np.ndarray):
        return ("tensor", _tensor_spec(inputs))
    if isinstance(inputs, dict):
        return ("map", tuple((k, *_tensor_spec(inputs[k])) for k in sorted(inputs)))
    if isinstance(inputs, (str, bytes)):
        return RAW_SPECS[isinstance(inputs, bytes)]
    return ("list", tuple(_tensor_spec(a) for a in inputs))


def describe_spec(spec: Any) -> str:
    """A readable form of a spec, e.g. ``float32[N,16]`` or ``(x: int64[N,26])``."""

    def one(dtype: np.dtype, trail: tuple[int | str, ...]) -> str:
        return f"{np.dtype(dtype).name}[{','.join(['N', *map(str, trail)])}]"

    kind, parts = spec
    if kind == "raw":
        return f"raw {parts}"
    if kind == "tensor":
        return one(*parts)
    if kind == "map":
        return "{" + ", ".join(f"{k}: {one(d, t)}" for k, d, t in parts) + "}"
    return "(" + ", ".join(one(d, t) for d, t in parts) + ")"


def _tensor_parts(spec: Hashable) -> list[tuple[np.dtype, tuple[int | str, ...]]]:
    kind, parts = cast("tuple[str, Any]", spec)
    if kind == "tensor":
        return [parts]
    if kind == "map":
        return [(d, t) for _, d, t in parts]
    return list(parts)


def spec_fits(spec: Hashable, model: Hashable) -> bool:
    """Whether inputs of ``spec`` fit a model of spec ``model``, whose named dimensions vary.

    Sizes must be equal; a named dimension takes any size, the same one wherever the name appears.
    """
    if spec == model:
        return True
    if spec[0] != model[0] or spec[0] == "raw":  # type: ignore[index]
        return False
    if spec[0] == "map" and [p[0] for p in spec[1]] != [p[0] for p in model[1]]:  # type: ignore[index]
        return False
    got, want = _tensor_parts(spec), _tensor_parts(model)
    if len(got) != len(want):
        return False
    seen: dict[str, int] = {}
    for (dtype, trail), (model_dtype, model_trail) in zip(got, want):
        if dtype != model_dtype or len(trail) != len(model_trail):
            return False
        for size, dim in zip(trail, model_trail):
            if isinstance(dim, str):
                if dim != "*" and seen.setdefault(dim, size) != size:  # type: ignore[arg-type]
                    return False
            elif size != dim:
                return False
    return True


def _parse_tensor(text: str) -> tuple[np.dtype, tuple[int | str, ...]]:
    found = _TENSOR_RE.match(text)
    if not found or found.group(1) not in _DTYPE_NAMES:
        raise SpecError(
            f"{text.strip()!r} is not DTYPE[N,...] with DTYPE one of {', '.join(_DTYPE_NAMES)}"
        )
    dims = [d.strip() for d in found.group(2).split(",")]
    trail: list[int | str] = []
    for dim in dims[1:]:
        if dim.isdigit():
            trail.append(int(dim))
        elif _NAME_RE.match(dim):
            trail.append(dim)
        else:
            raise SpecError(
                f"dimension {dim!r} of {text.strip()!r} is neither a size nor a name (L, *)"
            )
    if not dims[0]:
        raise SpecError(f"{text.strip()!r} has no batch dimension: write it first, as N")
    return (np.dtype(found.group(1)), tuple(trail))


def _split_top(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def parse_spec(text: str) -> Hashable:
    """Read a spec in the form :func:`describe_spec` writes (see the module docstring).

    Raises SpecError with the accepted forms.
    """
    body = text.strip()
    try:
        if body.startswith("{") and body.endswith("}"):
            named = [part.partition(":") for part in _split_top(body[1:-1])]
            if any(not sep or not name.strip() for name, sep, _ in named):
                raise SpecError("a map is {name: DTYPE[N,...], ...}")
            return ("map", tuple(sorted((name.strip(), *_parse_tensor(t)) for name, _, t in named)))
        if body.startswith("(") and body.endswith(")"):
            return ("list", tuple(_parse_tensor(t) for t in _split_top(body[1:-1])))
        return ("tensor", _parse_tensor(body))
    except SpecError as exc:
        raise SpecError(
            f"input spec {text!r}: {exc}. Forms: float32[N,16], int64[N,L] (L varies), "
            f"(float32[N,13], int64[N,26]), {{ids: int64[N,L], mask: bool[N,L]}}"
        ) from None


def synthesize(spec: Hashable, rows: int = 1, length: int = 8) -> Any:
    """Zero inputs of ``spec`` (``rows`` rows, each named dimension ``length`` long): a warm-up
    example.

    Zeros are valid where any value is: embedding indices, token ids, masks, features.
    """

    def one(dtype: np.dtype, trail: tuple[int | str, ...]) -> np.ndarray:
        return np.zeros((rows, *(d if isinstance(d, int) else length for d in trail)), dtype)

    kind, parts = cast("tuple[str, Any]", spec)
    if kind == "tensor":
        return one(*parts)
    if kind == "map":
        return {k: one(d, t) for k, d, t in parts}
    if kind == "list":
        return [one(d, t) for d, t in parts]
    raise ValueError(f"no example can be made for {describe_spec(spec)}")
