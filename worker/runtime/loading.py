"""The model runtime: load once, warm up, predict a batch.

:func:`load_runtime` accepts four kinds of model, files recognised by their
content (:mod:`inferfleet.worker.runtime.formats`), whatever their name:

* a TorchScript file (``torch.jit.load``);
* a ``torch.export`` program (``torch.export.load``);
* an ONNX model (ONNX Runtime: :mod:`inferfleet.worker.runtime.onnx_backend`);
* a :class:`~inferfleet.worker.handler.Handler` given as ``module:attr``.

The worker checks each request's dtypes and trailing shapes against the
model's input spec, and warms up on an example, each taken from the first
that has one: ``--input-spec`` / ``--warmup-input``; the file (an example
request body in its extra files ``inferfleet_example``, base64, or ONNX
metadata_props; a spec in ``inferfleet_input_spec``; the signature a
torch.export program or an ONNX graph carries, with its varying dimensions);
the model's example. With a spec and no example, the example is synthesised
(zeros: valid token ids and embedding indices too). This is the only module that knows about
devices, threads and precision: fp16 and bf16 run under ``torch.autocast``, int8 is dynamic
quantization of the linear layers on the CPU (:mod:`inferfleet.worker.runtime.quantize` for torch
models, ONNX Runtime's quantizer for ``.onnx``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ModelLoadError, OutputError
from inferfleet.worker.handler import Handler
from inferfleet.worker.npfiles import load_inputs
from inferfleet.worker.runtime.devices import (
    apply_tf32,
    drop_frames,
    is_out_of_memory,
    release_device_memory,
    select_device,
    warn_emulated_precision,
)
from inferfleet.worker.runtime.memory import tune_allocator
from inferfleet.worker.runtime.onnx_backend import OnnxHandler
from inferfleet.worker.runtime.pipeline import Manifest, is_pipeline, stage_program
from inferfleet.worker.runtime.quantize import quantize_handler
from inferfleet.worker.runtime.readers import (
    load_model,
)
from inferfleet.worker.runtime.signature import (
    RAW_SPECS,
    SpecError,
    describe_spec,
    parse_spec,
    spec_fits,
    spec_of,
    synthesize,
)

__all__ = [
    "ModelRuntime",
    "apply_precision",
    "apply_process_settings",
    "c_compiler",
    "cast_floats",
    "cast_handler",
    "is_out_of_memory",
    "load_runtime",
    "resolve_device",
    "resolve_spec",
    "to_numpy",
]

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """``auto`` -> the first GPU if there is one, else the CPU. Validates cuda:N."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} asked for, but this machine has no usable GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {device!r}: only {torch.cuda.device_count()} GPUs visible"
            )
    return dev


def to_numpy(outputs: Any) -> Any:
    """Model outputs (tensors, numpy arrays, lists or dicts of them) as numpy arrays."""
    if isinstance(outputs, torch.Tensor):
        t = outputs.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()  # numpy has no bfloat16; float32 holds it exactly
        return t.cpu().numpy()
    if isinstance(outputs, (np.ndarray, str, bytes)):
        return (
            outputs  # arrays, or raw text or bytes (protocol 1.2) from a handler's encode_response
        )
    if isinstance(outputs, dict):
        return {str(k): to_numpy(v) for k, v in outputs.items()}
    if isinstance(outputs, (list, tuple)):
        return [to_numpy(v) for v in outputs]
    raise OutputError(
        f"a model output must be a tensor, list or dict of tensors, got {type(outputs).__name__}"
    )


#: Precisions that cast the weights and the floating inputs (the article's ``model.half()``).
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: Precisions that run the fp32 model under torch.autocast.
_AUTOCAST = {"amp": torch.float16}


def cast_floats(inputs: Any, dtype: torch.dtype) -> Any:
    """Floating tensors of ``inputs`` (a tensor, or a dict, list or tuple of them) as ``dtype``;
    integer ones (embedding ids, token ids) and anything else left as they are."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, dict):
        return {k: cast_floats(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(cast_floats(v, dtype) for v in inputs)
    return inputs


def cast_handler(handler: Handler, dtype: torch.dtype) -> None:
    """Cast every ``nn.Module`` attribute of ``handler`` (the model) to ``dtype``: its weights
    take half the memory. Raises ModelLoadError when there is none to cast."""
    cast = 0
    for name, value in list(vars(handler).items()):
        if isinstance(value, torch.nn.Module):
            setattr(handler, name, value.to(dtype))
            cast += 1
    if not cast:
        raise ModelLoadError(
            f"--precision {_DTYPE_NAMES[dtype]} casts the model's weights, and "
            f"{type(handler).__name__} holds no torch.nn.Module attribute: serve it with "
            "--precision amp (autocast) or fp32"
        )


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


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

    def __init__(
        self,
        handler: Handler,
        name: str,
        version: str,
        device: torch.device,
        example: Any = None,
        precision: str = "fp32",
        input_spec: Hashable | None = None,
    ) -> None:
        self.handler = handler
        self.precision = precision
        self._autocast = _AUTOCAST.get(precision)
        self._cast = _CAST.get(precision)
        self.name = name
        self.version = version
        self.device = device
        self.example = example
        #: The spec (form, dtypes, trailing shapes; named dimensions vary) the model takes, if
        #: known.
        self.input_spec: Hashable | None = input_spec
        if input_spec is None and example is not None:
            self.input_spec = spec_of(example)
        #: TorchScript, export and ONNX models take no params; handlers may.
        self.accepts_params = handler.accepts_params
        #: The split this runtime is one stage of (``--stage``), else None.
        self.pipeline: Manifest | None = None
        #: The handler decodes, collates and splits request by request (:meth:`predict_requests`).
        self.per_request = handler.per_request
        #: The largest batch the warm-up found fits the device, when a larger one ran out of
        #: memory (None: every size fitted, or no warm-up ran): the consumer's row ceiling.
        self.fits_rows: int | None = None

    @property
    def model_meta(self) -> tuple[str, str]:
        return (self.name, self.version)

    def predict(self, inputs: Any, params: dict) -> Any:
        """Run one batch (numpy in, numpy out) under ``torch.inference_mode``."""
        with torch.inference_mode():
            x = self.handler.preprocess(inputs, params)
            y = self._forward(self.handler, x, params)
            out = to_numpy(self.handler.postprocess(y, params))
        return out

    def _forward(self, handler: Handler, x: Any, params: dict) -> Any:
        """The handler's predict in this runtime's precision; reduced floats back to float32."""
        if self._cast is not None:
            return _as_float32(handler.predict(cast_floats(x, self._cast), params))
        if self._autocast is not None:
            with torch.autocast(self.device.type, dtype=self._autocast):
                return _as_float32(handler.predict(x, params))
        return handler.predict(x, params)

    def predict_requests(self, inputs: list[Any], rows: list[int], params: dict) -> list[Any]:
        """Run one batch through a per-request handler: one output (numpy, text or bytes) per
        request."""
        handler = self.handler
        with torch.inference_mode():
            items = [handler.decode_request(x, params) for x in inputs]
            x = handler.preprocess(handler.batch(items, params), params)
            y = self._forward(handler, x, params)
            parts = handler.unbatch(handler.postprocess(y, params), rows, params)
            if len(parts) != len(inputs):
                raise OutputError(
                    f"unbatch returned {len(parts)} outputs for {len(inputs)} requests"
                )
            return [to_numpy(handler.encode_response(part, params)) for part in parts]

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
            if iters:
                log.warning(
                    "no example inputs for %s: skipping warm-up and input checks, the first batch "
                    "will be slower; give one with --warmup-input FILE.npz or --input-spec "
                    "'float32[N,16]' "
                    "(docs/handlers.md)",
                    self.name,
                )
            return 0.0
        start = time.perf_counter()
        example_rows = _rows(self.example)
        sizes = (
            warmup_sizes(1, max(1, max_rows // example_rows))
            if self.per_request
            else warmup_sizes(example_rows, max_rows)
        )
        # per request, the sizes count requests of the example's rows each
        fitted, each = 0, example_rows if self.per_request else 1
        for size in sizes:
            out_of_memory = self._warm(size, iters)
            if out_of_memory is not None:
                self._too_big(size * each, fitted, out_of_memory)
                break
            fitted = size * each
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _warm(self, rows: int, iters: int) -> BaseException | None:
        """``iters`` passes of ``rows`` rows; the out-of-memory error (its frames dropped) that
        stopped them, or None. Any other failure is a ModelLoadError."""
        try:
            for _ in range(iters):
                if self.per_request:  # ``rows`` copies of the example request
                    rows_each = _rows(self.example)
                    self.predict_requests([self.example] * rows, [rows_each] * rows, {})
                else:
                    self.predict(_tile_rows(self.example, rows), {})
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise ModelLoadError(
                    f"warm-up of {self.name} failed on a batch of {rows} rows: {exc}. "
                    f"If the model cannot batch, start it with --max-batch-rows 1"
                ) from exc
            return drop_frames(exc)
        return None

    def _too_big(self, rows: int, fitted: int, exc: BaseException) -> None:
        """A warm-up batch of ``rows`` ran out of memory: serve batches of ``fitted`` rows at
        most (the largest that fitted), or fail to load if not even the smallest fits."""
        release_device_memory(self.device)
        if not fitted:
            raise ModelLoadError(
                f"warm-up of {self.name} ran out of memory on a batch of {rows} rows, the "
                f"smallest it tries: {exc}. The model does not fit {self.device} beside what "
                "else runs there"
            )
        self.fits_rows = fitted
        log.warning(
            "model %s: out of memory warming up a batch of %d rows on %s; batches are limited "
            "to %d rows (set --max-batch-rows %d to skip this)",
            self.name,
            rows,
            self.device,
            fitted,
            fitted,
        )


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
    if isinstance(inputs, (str, bytes)):
        return 1
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


def resolve_spec(handler: Handler, example: Any, input_spec: str | None) -> Hashable | None:
    """The spec to check requests against: ``--input-spec``, else the model's own (file signature or
    the handler's), where the example fits it, else the example's."""
    if input_spec:
        try:
            return parse_spec(input_spec)
        except SpecError as exc:
            raise ModelLoadError(str(exc)) from exc
    declared = handler.input_spec
    if isinstance(declared, str):
        try:
            declared = parse_spec(declared)
        except SpecError as exc:
            raise ModelLoadError(f"{type(handler).__name__}.input_spec: {exc}") from exc
    if example is None:
        return declared
    own = spec_of(example)
    return declared if declared is not None and spec_fits(own, declared) else own


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
            raise ModelLoadError(
                f"--precision int8 (dynamic quantization) runs on the CPU only; "
                f"on {device} use --precision fp16 or bf16, or --device cpu"
            )
        try:
            quantize_handler(handler)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
    elif (precision in _AUTOCAST or precision in _CAST) and isinstance(handler, OnnxHandler):
        raise ModelLoadError(
            f"--precision {precision} casts torch weights or runs torch autocast, which ONNX "
            f"Runtime does not use: serve the .onnx model in fp32 or int8, or its torch form "
            f"in {precision}"
        )
    else:
        warn_emulated_precision(precision, device)
        if precision in _CAST:
            cast_handler(handler, _CAST[precision])


def _load_example_file(path: str) -> Any:
    try:
        return load_inputs(path)
    except ValueError as exc:
        raise ModelLoadError(f"cannot read warm-up input: {exc}") from exc


def c_compiler() -> str | None:
    """The C compiler torch.compile would use ($CC, else cc, gcc or clang on PATH), or None."""
    names = (
        [os.environ["CC"].split()[0]]
        if os.environ.get("CC", "").strip()
        else ["cc", "gcc", "clang"]
    )
    return next((found for found in map(shutil.which, names) if found), None)


def _compile(handler: Handler) -> None:
    """``--compile``: refuse up front without a C compiler, which inductor (C++ on the CPU)
    and Triton (its launcher, on GPUs) both build with at the first batch."""
    if c_compiler() is None:
        raise ModelLoadError(
            "--compile needs a C compiler (torch.compile builds kernels and Triton's "
            "launcher with it) and none is on PATH (cc, gcc, clang or $CC): install one "
            "(apt-get install gcc; the python:*-slim image has none) or serve without --compile"
        )
    try:
        handler.compile()
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def _load_any(
    settings: WorkerSettings, device: torch.device
) -> tuple[Handler, Any, str, Manifest | None]:
    """The model, or with ``stage`` set the stage's program of the split in ``settings.model``.

    A stage's version is always its split's digest (one version for every
    stage of one split); a ``--model-version`` that differs is ignored, said so.
    """
    if settings.stage is None:
        if is_pipeline(settings.model):
            raise ModelLoadError(
                f"{settings.model!r} is a split model (inferfleet split): serve one of its "
                f"stages with --stage K"
            )
        return (*load_model(settings.model, device), None)
    path, manifest = stage_program(settings.model, settings.stage)
    if settings.model_version not in (None, manifest.version):
        log.warning(
            "stage %d of %s: --model-version %s ignored, a stage reports its split's version %s",
            settings.stage,
            settings.model,
            settings.model_version,
            manifest.version,
        )
    handler, example, _ = load_model(path, device)
    return handler, example, manifest.version, manifest


def apply_process_settings(settings: WorkerSettings) -> None:
    """What every model of the process runs under, set before it loads: glibc's allocator
    thresholds (``tune_malloc``) and torch's threads (``torch_threads``, one inter-op thread).
    A step-wise model is loaded without :func:`load_runtime`: its worker calls this first."""
    if settings.tune_malloc:
        tune_allocator()
    _set_threads(settings.torch_threads)


def load_runtime(settings: WorkerSettings) -> ModelRuntime:
    """Load, place and warm up the model that ``settings`` names."""
    apply_process_settings(settings)
    device = resolve_device(settings.device)
    select_device(device)  # cuda:N: this thread's (the loop's, or a swap's) current device
    tf32 = apply_tf32(settings.tf32)  # process-wide flags: every model of the process
    started = time.perf_counter()
    handler, example, version, manifest = _load_any(settings, device)
    if settings.warmup_input:
        example = _load_example_file(settings.warmup_input)
    apply_precision(handler, settings.precision, device)
    if settings.compile:
        _compile(handler)
    spec = resolve_spec(handler, example, settings.input_spec)
    if example is None and spec is not None and spec not in RAW_SPECS:
        example = synthesize(spec)  # zeros: a valid warm-up for token ids and embedding indices too
        log.info(
            "model %s: warming up on zeros of its input spec %s", settings.name, describe_spec(spec)
        )
    runtime = ModelRuntime(
        handler,
        settings.name,
        version if manifest else settings.model_version or version,
        device,
        example,
        settings.precision,
        spec,
    )
    runtime.pipeline = manifest
    loaded = time.perf_counter() - started
    warm = runtime.warmup(settings.max_batch_rows, settings.warmup_iters)
    log.info(
        "model %s version %s on %s (%s%s%s): loaded in %.0f ms, warmed up in %.0f ms",
        settings.name,
        runtime.version,
        device,
        settings.precision,
        ", compiled" if settings.compile else "",
        f", {tf32}" if device.type == "cuda" else "",
        loaded * 1000,
        warm * 1000,
    )
    return runtime
