"""Reading inputs from and writing outputs to ``.npy`` / ``.npz`` files.

A ``.npy`` file is one tensor. A ``.npz`` file whose arrays are named
``arr_0, arr_1, ...`` (what ``np.savez(f, a, b)`` writes) is a list of
positional inputs; any other names make a map of keyword inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["load_inputs", "save_outputs"]


def load_inputs(path: str) -> Any:
    """Read a tensor, list or dict of tensors; raises ValueError with the reason."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path!r} as .npy or .npz: {exc}") from exc
    if isinstance(data, np.ndarray):
        return data
    with data:
        keys = list(data.keys())
        if not keys:
            raise ValueError(f"{path!r} holds no arrays")
        if all(k == f"arr_{i}" for i, k in enumerate(sorted(keys, key=_arr_index))):
            return [data[f"arr_{i}"] for i in range(len(keys))]
        return {k: data[k] for k in keys}


def _arr_index(key: str) -> int:
    suffix = key[4:]
    return int(suffix) if key.startswith("arr_") and suffix.isdigit() else -1


def save_outputs(path: str, outputs: Any) -> None:
    """Write outputs the way :func:`load_inputs` reads them back."""
    if isinstance(outputs, np.ndarray) and path.endswith(".npy"):
        np.save(path, outputs)
    elif isinstance(outputs, np.ndarray):
        np.savez(path, outputs)
    elif isinstance(outputs, dict):
        np.savez(path, **outputs)
    else:
        np.savez(path, *outputs)
