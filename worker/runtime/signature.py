"""The input spec: the form of a request's inputs that a model cares about.

A spec is the input form (one tensor, a list or a map), each tensor's dtype
and its trailing shape (every dimension but the batch). The runtime takes one
from the model's example (what the model accepts); intake compares each
request's against it, and batching groups requests whose specs (and params)
are equal. Pure numpy: importing this does not import torch.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

__all__ = ["describe_spec", "spec_of"]


def _tensor_spec(arr: np.ndarray) -> tuple[np.dtype, tuple[int, ...]]:
    return (arr.dtype, arr.shape[1:])  # the dtype object itself: dtype.name is slow


def spec_of(inputs: Any) -> Hashable:
    """The batching-relevant form of inputs: structure, dtypes, trailing shapes."""
    if isinstance(inputs, np.ndarray):
        return ("tensor", _tensor_spec(inputs))
    if isinstance(inputs, dict):
        return ("map", tuple((k, *_tensor_spec(inputs[k])) for k in sorted(inputs)))
    return ("list", tuple(_tensor_spec(a) for a in inputs))


def describe_spec(spec: Any) -> str:
    """A readable form of a spec, e.g. ``float32[N,16]`` or ``(x: int64[N,26])``."""

    def one(dtype: np.dtype, trail: tuple[int, ...]) -> str:
        return f"{np.dtype(dtype).name}[{','.join(['N', *map(str, trail)])}]"

    kind, parts = spec
    if kind == "tensor":
        return one(*parts)
    if kind == "map":
        return "{" + ", ".join(f"{k}: {one(d, t)}" for k, d, t in parts) + "}"
    return "(" + ", ".join(one(d, t) for d, t in parts) + ")"
