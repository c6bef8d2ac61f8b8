"""The model runtime: load once, warm up, predict a batch.

:func:`load_runtime` accepts four kinds of model:

* a TorchScript file (``torch.jit.load``), any suffix but ``.pt2`` and ``.onnx``;
* a ``torch.export`` program (``.pt2``, ``torch.export.load``);
* an ONNX model (``.onnx``, ONNX Runtime: :mod:`inferfleet.worker.runtime.onnx_backend`);
* a :class:`~inferfleet.worker.handler.Handler` given as ``module:attr``.

Example models store an example request body in the file's extra files
(``inferfleet_example``, base64; ONNX models in their metadata_props), so the
worker can warm up and check each request's dtypes and trailing shapes against
what the model takes. This is the only module that knows about devices,
threads and precision: fp16 and bf16 run under ``torch.autocast``, int8 is
dynamic quantization of the linear layers on the CPU (:mod:`inferfleet.worker.runtime.quantize`
for torch models, ONNX Runtime's quantizer for ``.onnx``).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import logging
import os
import shutil
import time
import warnings
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import decode_body
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ModelLoadError, OutputError
from inferfleet.worker.handler import Handler
from inferfleet.worker.npfiles import load_inputs
from inferfleet.worker.runtime.devices import (
    is_out_of_memory,
    release_device_memory,
    select_device,
    warn_emulated_precision,
)
from inferfleet.worker.runtime.memory import tune_allocator
from inferfleet.worker.runtime.modules import ModuleHandler
from inferfleet.worker.runtime.onnx_backend import OnnxHandler, load_onnx
from inferfleet.worker.runtime.quantize import quantize_handler
from inferfleet.worker.runtime.signature import spec_of

__all__ = ["ModelRuntime", "apply_precision", "c_compiler", "file_version", "is_handler_spec", "is_out_of_memory",
           "load_runtime", "resolve_device", "EXAMPLE_EXTRA_FILE", "to_numpy"]

log = logging.getLogger(__name__)

#: Name of the extra file (TorchScript and torch.export) or ONNX metadata_props key holding an example body.
EXAMPLE_EXTRA_FILE = "inferfleet_example"


def resolve_device(device: str) -> torch.device:
    """``auto`` -> the first GPU if there is one, else the CPU. Validates cuda:N."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} asked for, but this machine has no usable GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r}: only {torch.cuda.device_count()} GPUs visible")
    return dev


def to_numpy(outputs: Any) -> Any:
    """Model outputs (tensors, numpy arrays, lists or dicts of them) as numpy arrays."""
    if isinstance(outputs, torch.Tensor):
        t = outputs.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()  # numpy has no bfloat16; float32 holds it exactly
        return t.cpu().numpy()
    if isinstance(outputs, np.ndarray):
        return outputs
    if isinstance(outputs, dict):
        return {str(k): to_numpy(v) for k, v in outputs.items()}
    if isinstance(outputs, (list, tuple)):
        return [to_numpy(v) for v in outputs]
    raise OutputError(f"a model output must be a tensor, list or dict of tensors, got {type(outputs).__name__}")


_AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _as_float32(outputs: Any) -> Any:
    """Reduced-precision float outputs back to float32: clients see the same dtypes as with fp32."""
    if isinstance(outputs, torch.Tensor):
        return outputs.float() if outputs.dtype in (torch.float16, torch.bfloat16) else outputs
    if isinstance(outputs, dict):
        return {k: _as_float32(v) for k, v in outputs.items()}
    if isinstance(outputs, (list, tuple)):
        return [_as_float32(v) for v in outputs]
    return outputs


class ModelRuntime:
    """One loaded, warmed-up model copy on one device."""

    def __init__(self, handler: Handler, name: str, version: str, device: torch.device,
                 example: Any = None, precision: str = "fp32") -> None:
        self.handler = handler
        self.precision = precision
        self._autocast = _AUTOCAST.get(precision)
        self.name = name
        self.version = version
        self.device = device
        self.example = example
        #: The spec (form, dtypes, trailing shapes) the model takes, if known.
        self.input_spec: Hashable | None = spec_of(example) if example is not None else None
        #: TorchScript, export and ONNX models take no params; handlers may.
        self.accepts_params = handler.accepts_params

    @property
    def model_meta(self) -> tuple[str, str]:
        return (self.name, self.version)

    def predict(self, inputs: Any, params: dict) -> Any:
        """Run one batch (numpy in, numpy out) under ``torch.inference_mode``."""
        with torch.inference_mode():
            x = self.handler.preprocess(inputs, params)
            if self._autocast is None:
                y = self.handler.predict(x, params)
            else:
                with torch.autocast(self.device.type, dtype=self._autocast):
                    y = _as_float32(self.handler.predict(x, params))
            out = to_numpy(self.handler.postprocess(y, params))
        return out

    def release_memory(self) -> None:
        """Return cached device memory (after an out-of-memory error)."""
        release_device_memory(self.device)

    def warmup(self, max_rows: int, iters: int) -> float:
        """Run the example at every batch size in :func:`warmup_sizes`; return seconds spent.

        So kernels, allocator pools, oneDNN primitives and TorchScript's
        shape-specialised plans exist for the sizes batches will have before
        the first request arrives (a lone first request is a batch of 1 row).
        """
        if self.example is None or iters == 0:
            log.warning("no example inputs for %s: skipping warm-up, the first batch will be slower", self.name)
            return 0.0
        start = time.perf_counter()
        for rows in warmup_sizes(_rows(self.example), max_rows):
            batch = _tile_rows(self.example, rows)
            for _ in range(iters):
                try:
                    self.predict(batch, {})
                except Exception as exc:
                    raise ModelLoadError(
                        f"warm-up of {self.name} failed on a batch of {rows} rows: {exc}. "
                        f"If the model cannot batch, start it with --max-batch-rows 1"
                    ) from exc
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


def warmup_sizes(example_rows: int, max_rows: int) -> list[int]:
    """1, the powers of two up to ``max_rows``, ``max_rows`` and the example's own size."""
    sizes = {1, example_rows, max_rows}
    power = 2
    while power < max_rows:
        sizes.add(power)
        power *= 2
    return sorted(sizes)


def _rows(inputs: Any) -> int:
    if isinstance(inputs, np.ndarray):
        return int(inputs.shape[0])
    first = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs[0]
    return int(first.shape[0])


def _tile_rows(inputs: Any, rows: int) -> Any:
    def one(a: np.ndarray) -> np.ndarray:
        reps = -(-rows // a.shape[0])
        return np.ascontiguousarray(np.concatenate([a] * reps)[:rows])

    if isinstance(inputs, np.ndarray):
        return one(inputs)
    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    return [one(v) for v in inputs]


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
        raise ModelLoadError(f"the model's {EXAMPLE_EXTRA_FILE} extra file is not a base64 request body: "
                             f"{exc}") from exc
    return inputs


def _load_torchscript(path: str, device: torch.device) -> tuple[Handler, Any]:
    extra = {EXAMPLE_EXTRA_FILE: ""}
    with warnings.catch_warnings():
        # torch 2.10+ marks TorchScript deprecated; we still serve it on purpose.
        warnings.filterwarnings("ignore", message=r".*torch\.jit", category=DeprecationWarning)
        module = torch.jit.load(path, map_location=device, _extra_files=extra)
    return ModuleHandler(module), _decode_example(extra[EXAMPLE_EXTRA_FILE])


def _load_export(path: str, device: torch.device) -> tuple[Handler, Any]:
    extra = {EXAMPLE_EXTRA_FILE: ""}
    program = torch.export.load(path, extra_files=extra)
    return ModuleHandler(_exported_module(program, device)), _decode_example(extra[EXAMPLE_EXTRA_FILE])


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
        log.warning("torch %s has no torch.export.passes.move_to_device_pass: constants and devices written "
                    "into the .pt2 graph stay on the CPU (upgrade torch)", torch.__version__)
        return program.module().to(device)
    return move(program, device).module()


def _load_handler(spec: str) -> Handler:
    module_name, _, attr = spec.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"cannot import handler {spec!r}: {exc}") from exc
    handler = target() if isinstance(target, type) else target
    if not isinstance(handler, Handler):
        raise ModelLoadError(f"{spec!r} is not a inferfleet.worker.handler.Handler subclass or instance")
    return handler


def is_handler_spec(model: str) -> bool:
    """Whether ``model`` names a ``module:Handler`` to import rather than a file."""
    return ":" in model and not os.path.exists(model)


def _load_onnx(path: str, device: torch.device) -> tuple[Handler, Any]:
    handler = load_onnx(path, device)  # imports onnxruntime (optional) only now
    return handler, _decode_example(handler.metadata.get(EXAMPLE_EXTRA_FILE))


_LOADERS = {".pt2": _load_export, ".onnx": _load_onnx}


def load_model(model: str, device: torch.device) -> tuple[Handler, Any, str]:
    """Load a model of any supported kind; return (handler, example inputs, default version)."""
    if is_handler_spec(model):
        handler = _load_handler(model)
        handler.setup(device)
        return handler, handler.example_inputs(), handler.version or "1"
    if not os.path.isfile(model):
        raise ModelLoadError(f"model file {model!r} does not exist")
    loader = _LOADERS.get(os.path.splitext(model)[1], _load_torchscript)
    try:
        handler, example = loader(model, device)  # the ONNX loader translates its own errors
    except (RuntimeError, ValueError, OSError) as exc:
        kind = "torch.export program" if loader is _load_export else "TorchScript file"
        raise ModelLoadError(f"cannot load {model!r} as a {kind}: {exc}") from exc
    handler.setup(device)
    return handler, example, file_version(model)


def _set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (tests load several models in one process)
        pass


def apply_precision(handler: Handler, precision: str, device: torch.device) -> None:
    """Quantize for int8; refuse a precision that this model kind or device cannot run."""
    if precision == "int8":
        if device.type != "cpu":
            raise ModelLoadError(f"--precision int8 (dynamic quantization) runs on the CPU only; "
                                 f"on {device} use --precision fp16 or bf16, or --device cpu")
        try:
            quantize_handler(handler)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
    elif precision in _AUTOCAST and isinstance(handler, OnnxHandler):
        raise ModelLoadError(f"--precision {precision} is torch autocast, which ONNX Runtime does not use: "
                             f"serve the .onnx model in fp32 or int8, or its torch form in {precision}")
    else:
        warn_emulated_precision(precision, device)


def _load_example_file(path: str) -> Any:
    try:
        return load_inputs(path)
    except ValueError as exc:
        raise ModelLoadError(f"cannot read warm-up input: {exc}") from exc


def c_compiler() -> str | None:
    """The C compiler torch.compile would use ($CC, else cc, gcc or clang on PATH), or None."""
    names = [os.environ["CC"].split()[0]] if os.environ.get("CC", "").strip() else ["cc", "gcc", "clang"]
    return next((found for found in map(shutil.which, names) if found), None)


def _compile(handler: Handler) -> None:
    """``--compile``: refuse up front without a C compiler, which inductor (C++ on the CPU)
    and Triton (its launcher, on GPUs) both build with at the first batch."""
    if c_compiler() is None:
        raise ModelLoadError("--compile needs a C compiler (torch.compile builds kernels and Triton's "
                             "launcher with it) and none is on PATH (cc, gcc, clang or $CC): install one "
                             "(apt-get install gcc; the python:*-slim image has none) or serve without --compile")
    try:
        handler.compile()
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def load_runtime(settings: WorkerSettings) -> ModelRuntime:
    """Load, place and warm up the model that ``settings`` names."""
    if settings.tune_malloc:
        tune_allocator()
    _set_threads(settings.torch_threads)
    device = resolve_device(settings.device)
    select_device(device)  # cuda:N: this thread's (the loop's, or a swap's) current device
    started = time.perf_counter()
    handler, example, version = load_model(settings.model, device)
    if settings.warmup_input:
        example = _load_example_file(settings.warmup_input)
    apply_precision(handler, settings.precision, device)
    if settings.compile:
        _compile(handler)
    runtime = ModelRuntime(handler, settings.name, settings.model_version or version, device, example,
                           settings.precision)
    loaded = time.perf_counter() - started
    warm = runtime.warmup(settings.max_batch_rows, settings.warmup_iters)
    log.info("model %s version %s on %s (%s%s): loaded in %.0f ms, warmed up in %.0f ms",
             settings.name, runtime.version, device, settings.precision,
             ", compiled" if settings.compile else "", loaded * 1000, warm * 1000)
    return runtime
