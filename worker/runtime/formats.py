"""What a model file is, read from its bytes, and the input spec its format carries.

:func:`detect_kind` looks at a file's first bytes and, for a zip archive, its
member names: never at its extension, and it never unpickles anything (a
pickle can run code). :func:`export_spec` and :func:`onnx_spec` read the input
spec a torch.export program or an ONNX graph carries: dtypes, and which
dimensions vary (a dynamic ``Dim`` or a symbolic ONNX dimension becomes a
named one, :mod:`inferfleet.worker.runtime.signature`).
"""

from __future__ import annotations

import zipfile
from collections.abc import Hashable
from typing import Any

import numpy as np

__all__ = ["KINDS", "detect_kind", "export_spec", "onnx_spec", "unservable_message"]

#: What :func:`detect_kind` answers: the three servable kinds, torch.save files, and anything else.
KINDS = ("torchscript", "export", "onnx", "torch-save", "unknown")

_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTOCOL = (
    0x80  # a pickle's PROTO opcode: torch.save's legacy (non-zip) format starts with it
)
_ONNX_FIELDS = (
    0x08,
    0x12,
    0x1A,
    0x22,
    0x2A,
    0x3A,
    0x42,
)  # protobuf tags of ModelProto's first fields

_ONNX_DTYPES = {
    "tensor(bool)": "bool",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
}


def _zip_kind(path: str) -> str:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return "unknown"
    tails = {name.split("/", 1)[-1] for name in names}
    if "models/model.json" in tails or any(
        n.endswith("serialized_exported_program.json") for n in names
    ):
        return "export"
    if any(t.startswith("code/") for t in tails) and "constants.pkl" in tails:
        return "torchscript"
    if "data.pkl" in tails:
        return "torch-save"
    return "unknown"


def detect_kind(path: str) -> str:
    """The kind of model file at ``path`` (one of :data:`KINDS`), from its content."""
    with open(path, "rb") as fh:
        head = fh.read(8)
    if head.startswith(_ZIP_MAGIC):
        return _zip_kind(path)
    if head[:1] and head[0] == _PICKLE_PROTOCOL:
        return "torch-save"
    if head[:1] and head[0] in _ONNX_FIELDS:
        return "onnx"
    return "unknown"


def unservable_message(path: str, kind: str) -> str:
    """What to tell a user whose file is not a servable model, and how to make one."""
    how = (
        "Load it into your nn.Module and save a servable file with its example: "
        "inferfleet.worker.save_model(module, example, 'model.pt2') (Python), or "
        "'inferfleet save-model mypkg.mymodule:build --example example.npz --out model.pt2' "
        "(docs/handlers.md, 'Bring your own model' in the README)"
    )
    if kind == "torch-save":
        return (
            f"{path!r} is a torch.save file (a state dict or a pickled module): it holds weights, "
            f"not the code that runs them, and inferfleet never unpickles a model file. {how}"
        )
    return (
        f"{path!r} is not a model file inferfleet can serve (TorchScript, torch.export .pt2 or "
        f"ONNX, recognised by content). {how}"
    )


def _dim_name(size: Any, names: dict[str, str]) -> int | str:
    """An exported dimension: its size if static, else a short name shared by equal symbols."""
    if isinstance(size, int):
        return size
    if size is None:
        return "*"  # unknown (ONNX): any length, not tied to another dimension
    trailing = sum(1 for name in names.values() if name != "N")
    return names.setdefault(str(size), "L" if not trailing else f"L{trailing + 1}")


def export_spec(program: Any) -> Hashable | None:
    """The input spec of a ``torch.export.ExportedProgram``: one tensor, positional or keyword
    tensors.

    None when an input is not a tensor (the program then needs --input-spec or an example).
    """
    from torch.export.graph_signature import InputKind

    user = [
        s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT
    ]
    values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    names: dict[str, str] = {}
    tensors = []
    for name in user:
        val = values.get(name)
        if val is None or not hasattr(val, "shape") or len(val.shape) == 0:
            return None
        names.setdefault(str(val.shape[0]), "N")  # the batch dimension is N, never a trailing name
        tensors.append(
            (
                np.dtype(str(val.dtype).removeprefix("torch.")),
                tuple(_dim_name(d, names) for d in val.shape[1:]),
            )
        )
    return _form(program.call_spec.in_spec, tensors)


def _form(in_spec: Any, tensors: list[tuple[np.dtype, tuple[int | str, ...]]]) -> Hashable | None:
    """Positional or keyword inputs, as a call spec ``((args...), {kwargs})`` says."""
    if not tensors or in_spec is None or in_spec.num_children != 2:
        return None
    args, kwargs = in_spec.child(0), in_spec.child(1)
    if kwargs.num_leaves and args.num_leaves:
        return None  # mixed positional and keyword inputs: no request form carries both
    if kwargs.num_leaves:
        keys = list(kwargs.context)
        return ("map", tuple(sorted((k, *t) for k, t in zip(keys, tensors))))
    return ("tensor", tensors[0]) if len(tensors) == 1 else ("list", tuple(tensors))


def onnx_spec(inputs: Any) -> Hashable | None:
    """The input spec of an ONNX Runtime session's inputs (``session.get_inputs()``).

    One input is one tensor; several are a map keyed by input name. A symbolic or
    unknown dimension is a named (varying) one. None for an input that is not a tensor.
    """
    names: dict[str, str] = {}
    tensors = []
    for arg in inputs:
        dtype = _ONNX_DTYPES.get(arg.type)
        if dtype is None or not arg.shape:
            return None
        names.setdefault(str(arg.shape[0]), "N")
        trail = tuple(_dim_name(d, names) for d in arg.shape[1:])
        tensors.append((arg.name, np.dtype(dtype), trail))
    if len(tensors) == 1:
        return ("tensor", tensors[0][1:])
    return ("map", tuple(sorted(tensors)))
