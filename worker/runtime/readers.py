"""Reading a model: each kind of file (or a ``module:Handler``) into a Handler and its example.

A file's kind comes from its content (:mod:`inferfleet.worker.runtime.formats`).
TorchScript and torch.export files may carry an example request body and an
input spec as extra files (ONNX models as metadata_props), written by
``inferfleet save-model``; the runtime (:mod:`inferfleet.worker.runtime.loading`)
decides what to warm up on and check requests against.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Hashable
from typing import Any

import torch

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import decode_body
from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.handler import Handler
from inferfleet.worker.runtime.formats import detect_kind, export_spec, unservable_message
from inferfleet.worker.runtime.modules import ModuleHandler
from inferfleet.worker.runtime.onnx_backend import load_onnx
from inferfleet.worker.runtime.signature import SpecError, parse_spec
from inferfleet.worker.runtime.stepwise import StepwiseHandler

__all__ = [
    "EXAMPLE_EXTRA_FILE",
    "SPEC_EXTRA_FILE",
    "file_version",
    "import_target",
    "is_handler_spec",
    "load_model",
]

log = logging.getLogger(__name__)

#: Name of the extra file (TorchScript and torch.export) or ONNX metadata_props key holding an
#: example body.
EXAMPLE_EXTRA_FILE = "inferfleet_example"
#: Name of the extra file (or metadata_props key) holding an input spec in its written form
#: (``int64[N,L]``).
SPEC_EXTRA_FILE = "inferfleet_input_spec"


def file_version(path: str) -> str:
    """A model file's default version: the first 12 hex digits of its SHA-256."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:12]


def _decode_example(raw: bytes | str | None) -> Any:
    if not raw:
        return None
    try:
        data = base64.b64decode(raw, validate=True)
        inputs, _ = decode_body(data)
    except (ValueError, ProtocolError) as exc:
        raise ModelLoadError(
            f"the model's {EXAMPLE_EXTRA_FILE} extra file is not a base64 request body: {exc}"
        ) from exc
    return inputs


def _decode_spec(raw: bytes | str | None) -> Hashable | None:
    if not raw:
        return None
    try:
        return parse_spec(raw.decode() if isinstance(raw, bytes) else raw)
    except (SpecError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"the model's {SPEC_EXTRA_FILE} extra file: {exc}") from exc


def _load_torchscript(path: str, device: torch.device) -> tuple[Handler, Any]:
    extra = {EXAMPLE_EXTRA_FILE: "", SPEC_EXTRA_FILE: ""}
    with warnings.catch_warnings():
        # torch 2.10+ marks TorchScript deprecated; we still serve it on purpose.
        warnings.filterwarnings("ignore", message=r".*torch\.jit", category=DeprecationWarning)
        module = torch.jit.load(path, map_location=device, _extra_files=extra)
    handler = ModuleHandler(module)
    handler.input_spec = _decode_spec(
        extra[SPEC_EXTRA_FILE]
    )  # TorchScript carries no signature of its own
    return handler, _decode_example(extra[EXAMPLE_EXTRA_FILE])


def _load_export(path: str, device: torch.device) -> tuple[Handler, Any]:
    extra = {EXAMPLE_EXTRA_FILE: "", SPEC_EXTRA_FILE: ""}
    program = torch.export.load(path, extra_files=extra)
    handler = ModuleHandler(_exported_module(program, device))
    handler.input_spec = _decode_spec(extra[SPEC_EXTRA_FILE]) or export_spec(program)
    return handler, _decode_example(extra[EXAMPLE_EXTRA_FILE])


def _exported_module(program: Any, device: torch.device) -> Any:
    """The program's module on ``device``, constants and graph-made tensors included.

    ``module().to(device)`` moves parameters and buffers only: lifted tensor
    constants, and devices written into the graph (``torch.arange(...,
    device="cpu")``) stay on the CPU. ``torch.export.passes.move_to_device_pass``
    rewrites the program itself; a torch without it gets the old move and a warning.
    """
    if device.type == "cpu":
        return program.module()
    try:
        from torch.export.passes import move_to_device_pass as move
    except ImportError:
        log.warning(
            "torch %s has no torch.export.passes.move_to_device_pass: constants and devices "
            "written into the .pt2 graph stay on the CPU (upgrade torch)",
            torch.__version__,
        )
        return program.module().to(device)
    return move(program, device).module()


def import_target(spec: str) -> Any:
    """``module:attr`` imported with the current directory on the path, as ``python -m`` has it."""
    module_name, _, attr = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, "")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(
            f"cannot import handler {spec!r}: {exc} (the current directory is "
            f"{os.getcwd()}; run inferfleet where {module_name.split('.')[0]} can be "
            f"imported, or set PYTHONPATH)"
        ) from exc


def load_stepwise(model: str, device: torch.device) -> Any:
    """The :class:`StepwiseHandler` that ``model`` names (``module:attr``), set up on
    ``device``; None when ``model`` names anything else (a file, a one-reply handler)."""
    if not is_handler_spec(model):
        return None
    target = import_target(model)
    stepwise = isinstance(target, type) and issubclass(target, StepwiseHandler)
    if not stepwise and not isinstance(target, StepwiseHandler):
        return None
    handler = target() if isinstance(target, type) else target
    try:
        handler.setup(device)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot set up {model!r}: {exc}") from exc
    return handler


def _load_handler(spec: str) -> Handler:
    target = import_target(spec)
    handler = target() if isinstance(target, type) else target
    if not isinstance(handler, Handler):
        raise ModelLoadError(
            f"{spec!r} is not a inferfleet.worker.handler.Handler subclass or instance"
        )
    return handler


def is_handler_spec(model: str) -> bool:
    """Whether ``model`` names a ``module:Handler`` to import rather than a file."""
    return ":" in model and not os.path.exists(model)


def _load_onnx(path: str, device: torch.device) -> tuple[Handler, Any]:
    handler = load_onnx(path, device)  # imports onnxruntime (optional) only now
    spec = _decode_spec(handler.metadata.get(SPEC_EXTRA_FILE))
    if spec is not None:
        handler.input_spec = spec
    return handler, _decode_example(handler.metadata.get(EXAMPLE_EXTRA_FILE))


_LOADERS = {"torchscript": _load_torchscript, "export": _load_export, "onnx": _load_onnx}
_KIND_NAMES = {
    "torchscript": "TorchScript file",
    "export": "torch.export program",
    "onnx": "ONNX model",
}


def load_model(model: str, device: torch.device) -> tuple[Handler, Any, str]:
    """Load a model of any supported kind; return (handler, example inputs, default version)."""
    if is_handler_spec(model):
        handler = _load_handler(model)
        handler.setup(device)
        return handler, handler.example_inputs(), handler.version or "1"
    if not os.path.isfile(model):
        raise ModelLoadError(f"model file {model!r} does not exist")
    kind = detect_kind(model)
    loader = _LOADERS.get(kind)
    if loader is None:
        raise ModelLoadError(unservable_message(model, kind))
    try:
        handler, example = loader(model, device)  # the ONNX loader translates its own errors
    except (RuntimeError, ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot load {model!r} as a {_KIND_NAMES[kind]}: {exc}") from exc
    handler.setup(device)
    return handler, example, file_version(model)
