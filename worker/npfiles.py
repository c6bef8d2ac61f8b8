"""Reading inputs from and writing outputs to ``.npy`` / ``.npz`` files.

A ``.npy`` file is one tensor. A ``.npz`` file whose arrays are named
``arr_0, arr_1, ...`` (what ``np.savez(f, a, b)`` writes) is a list of
positional inputs; any other names make a map of keyword inputs.
"""

from __future__ import annotations

import zipfile
from typing import Any

import numpy as np

__all__ = ["load_inputs", "save_outputs"]


def load_inputs(path: str) -> Any:
    """Read a tensor, list or dict of tensors; raises ValueError with the reason."""
    try:
        with open(path, "rb") as fh:  # our handle: closed even when numpy gives up half-way
            data = np.load(fh, allow_pickle=False)
            if isinstance(data, np.ndarray):
                return data
            return _arrays(data, path)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        reason = str(exc)
        if "pickled" in reason:  # numpy says so for any file that is not .npy/.npz
            reason = "not a .npy/.npz file of plain arrays (pickled objects are never loaded)"
        raise ValueError(f"cannot read {path!r} as .npy or .npz: {reason}") from exc


def _arrays(data: Any, path: str) -> Any:
    with data:
        keys = list(data.keys())
        if not keys:
            raise ValueError(f"{path!r} holds no arrays")
        if sorted(keys, key=_arr_index) == [f"arr_{i}" for i in range(len(keys))]:
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
