"""ONNX Runtime behind the model contract: ``.onnx`` files served by :class:`OnnxHandler`.

A ``.onnx`` file loads into an ``onnxruntime.InferenceSession`` (the CUDA
provider on a GPU device, else the CPU one) with ``--torch-threads`` intra-op
threads. Requests map onto the graph's inputs by name: a single array for a
one-input graph, a list in input order, or a map keyed by input name. A
one-output graph answers an array, a graph with several answers a map keyed
by output name. The example request body for warm-up and input checks rides
in the model's ``metadata_props`` under ``inferfleet_example`` (base64, the
same body as the TorchScript extra file; ``tests/fixtures/export_onnx.py`` writes it).

``--precision int8`` quantizes the graph's MatMul and Gemm weights with
``onnxruntime.quantization.quantize_dynamic`` at load (:func:`quantize_onnx`):
signed int8 weights where the CPU has VNNI (or is not x86), unsigned ones on
x86 without it, whose u8 x s8 kernels saturate (:func:`int8_weight_kind`).
onnxruntime is an optional dependency (``pip install -e '.[onnx]'`` in a checkout):
this module imports it only when a ``.onnx`` model is loaded.
"""

from __future__ import annotations

import logging
import os
import platform
import tempfile
from typing import Any

import numpy as np
import torch

from inferfleet.worker.errors import ModelLoadError
from inferfleet.worker.handler import Handler
from inferfleet.worker.runtime.formats import onnx_spec

__all__ = ["EXAMPLE_METADATA_KEY", "OnnxHandler", "int8_weight_kind", "load_onnx", "quantize_onnx"]

log = logging.getLogger(__name__)

#: The metadata_props key holding the example body (the TorchScript extra file's name).
EXAMPLE_METADATA_KEY = "inferfleet_example"
#: What int8 quantizes: the linear layers (MatMul, Gemm), like the torch route; not Conv.
INT8_OP_TYPES = ["MatMul", "Gemm"]


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise ModelLoadError(
            "serving an ONNX model needs onnxruntime: pip install onnxruntime (or, in a "
            "checkout, pip install -e '.[onnx]')"
        ) from exc
    return onnxruntime


def _providers(ort: Any, device: torch.device) -> list[Any]:
    if device.type == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ModelLoadError(
            f"device {device} asked for, but this onnxruntime has no CUDA provider: "
            f"install onnxruntime-gpu, or start the worker with --device cpu"
        )
    return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]


def _session(model: str | bytes, device: torch.device, threads: int) -> Any:
    ort = _ort()
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1  # one batch at a time, like torch.set_num_interop_threads(1)
    options.log_severity_level = (
        3  # errors only: ORT's own warnings would go to stderr, not our log
    )
    try:
        session = ort.InferenceSession(model, options, providers=_providers(ort, device))
    except ModelLoadError:
        raise
    except (
        Exception
    ) as exc:  # onnxruntime's errors (InvalidProtobuf, Fail, ...) derive from Exception only
        raise ModelLoadError(f"onnxruntime cannot load the model: {exc}") from exc
    if device.type == "cuda":
        _require_cuda(session, device)
    return session


def _require_cuda(session: Any, device: torch.device) -> None:
    """On a GPU, the CUDA provider must be the session's first, and stay so.

    When the CUDA or cuDNN libraries fail to load, onnxruntime logs a warning
    and builds a CPU-only session: a "GPU" worker would serve at CPU speed.
    Refuse that; and disable the fallback that would rerun a failed CUDA call
    on the CPU (a lost device must fail the batch, not slow it down).
    """
    providers = list(session.get_providers())
    if not providers or providers[0] != "CUDAExecutionProvider":
        raise ModelLoadError(
            f"device {device}: onnxruntime fell back to {', '.join(providers) or 'no provider'} "
            f"(its CUDA provider did not load: the CUDA or cuDNN libraries are missing or do "
            f"not match this onnxruntime-gpu build); fix them, or start with --device cpu"
        )
    session.disable_fallback()


class OnnxHandler(Handler):
    """Serves one ``onnxruntime.InferenceSession``; inputs stay numpy (no torch tensors)."""

    accepts_params = False

    def __init__(self, path: str, session: Any, threads: int) -> None:
        self.path = path
        self.session = session
        self.threads = threads
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]
        #: The model's metadata_props (where the example body is).
        self.metadata: dict[str, str] = dict(session.get_modelmeta().custom_metadata_map)
        #: The graph's own signature: dtypes, and symbolic dimensions as varying ones.
        self.input_spec = onnx_spec(session.get_inputs())

    def setup(self, device: torch.device) -> None:
        self.device = device

    def preprocess(self, inputs: Any, params: dict) -> dict[str, np.ndarray]:
        """The session's feed: inputs keyed by the graph's input names."""
        names = self.input_names
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        if isinstance(inputs, dict):
            if set(inputs) != set(names):
                raise ValueError(
                    f"this model takes inputs named {', '.join(names)}; got {', '.join(inputs)}"
                )
            return dict(inputs)
        if len(inputs) != len(names):
            raise ValueError(
                f"this model takes {len(names)} inputs ({', '.join(names)}); got {len(inputs)}"
            )
        return dict(zip(names, inputs))

    def predict(self, x: Any, params: dict) -> Any:
        if params:
            raise ValueError("this model takes no params; send the request without 'params'")
        outputs = self.session.run(None, x)
        return outputs[0] if len(outputs) == 1 else dict(zip(self.output_names, outputs))

    def quantize(self) -> None:
        """Swap the session for one over a dynamically quantized copy (MatMul and Gemm int8)."""
        with tempfile.TemporaryDirectory(prefix="inferfleet-int8-") as tmp:
            target = os.path.join(tmp, "model.int8.onnx")
            quantize_onnx(self.path, target)
            with open(target, "rb") as fh:
                self.session = _session(fh.read(), self.device, self.threads)


def int8_weight_kind(cpu_flags: str | None = None, machine: str | None = None) -> str:
    """``"s8"`` or ``"u8"``: the weight type whose int8 kernels are exact on this CPU.

    Dynamic quantization makes activations u8. On x86 without VNNI, ONNX Runtime's
    u8 x s8 kernels add pairs of products in int16 and saturate (ORT's own docs
    say so): CI measured the CTR model 2.3% off fp32 there, 2.5e-3 with VNNI. The
    u8 x u8 kernels do not saturate, and their integer results, so their error, are
    the same on every CPU. ``cpu_flags`` (``/proc/cpuinfo``'s text) and ``machine``
    default to this host's; an x86 host whose flags cannot be read gets ``"u8"``.
    ``INFERFLEET_INT8_WEIGHTS=s8|u8`` overrides the choice (a wrong guess, a copy
    written for another kind of host).
    """
    forced = os.environ.get("INFERFLEET_INT8_WEIGHTS", "").strip().lower()
    if forced:
        if forced not in ("s8", "u8"):
            raise ValueError(f"INFERFLEET_INT8_WEIGHTS must be s8 or u8, not {forced!r}")
        return forced
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return "s8"
    if cpu_flags is None:
        try:
            with open("/proc/cpuinfo") as fh:
                cpu_flags = fh.read()
        except OSError:
            return "u8"
    return "s8" if "vnni" in cpu_flags else "u8"


def quantize_onnx(source: str, target: str, weights: str | None = None) -> None:
    """Write ``target``: ``source`` with its MatMul/Gemm weights int8 (per channel), activations
    dynamic.

    ``weights`` is ``"s8"`` or ``"u8"`` (default :func:`int8_weight_kind`). A
    written copy suits CPUs of the kind it was written on: an ``s8`` copy saturates
    on x86 without VNNI. Raises ValueError when the quantizer refuses the model.
    """
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as exc:
        raise ValueError(
            "int8 for .onnx models needs the onnx package: pip install 'inferfleet[onnx]'"
        ) from exc
    weight_type = {"s8": QuantType.QInt8, "u8": QuantType.QUInt8}[weights or int8_weight_kind()]
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer's advice to pre-process goes to the root logger
    try:
        quantize_dynamic(
            source,
            target,
            op_types_to_quantize=INT8_OP_TYPES,
            per_channel=True,
            weight_type=weight_type,
        )
    except Exception as exc:  # the quantizer raises whatever onnx or numpy raised
        raise ValueError(f"onnxruntime cannot quantize {source}: {exc}") from exc
    finally:
        root.setLevel(level)


def load_onnx(path: str, device: torch.device, threads: int | None = None) -> OnnxHandler:
    """An :class:`OnnxHandler` over ``path`` on ``device``; ``threads`` defaults to torch's."""
    threads = threads or torch.get_num_threads()
    return OnnxHandler(path, _session(path, device, threads), threads)
