"""What a device error means, and choosing the device: the runtime's GPU-only decisions.

Two kinds of device error change what the worker does with a failed batch:

* **out of memory** (:func:`is_out_of_memory`): the batch was too big; the
  consumer lowers its row limit and the bisection retries the halves. torch's
  own class (``torch.OutOfMemoryError`` from torch 2.5, ``torch.cuda.OutOfMemoryError``
  before), and the allocation failures that reach us as plain errors: cuBLAS
  and cuDNN workspace allocations, ONNX Runtime's arena.
* **a broken device** (:func:`is_device_broken`): a device-side assert (an
  out-of-range embedding id on a GPU), an illegal memory access, a launch
  failure. These are *sticky*: the process's CUDA context is unusable and
  every later CUDA call fails, so retrying the batch, or any other, only
  answers ``model_error`` to everything. The consumer raises
  :class:`~inferfleet.worker.errors.DeviceBroken` instead, without
  acknowledging: the process exits, the restarted worker replays the entries
  one at a time, and the delivery limit dead-letters the one that breaks it.

Both are decided from the exception's class and message (and those of the
exceptions it was raised from), so errors from torch, from custom handlers
that wrap them and from ONNX Runtime's CUDA provider read the same.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Mapping

import torch

__all__ = [
    "BROKEN_DEVICE_MESSAGES",
    "apply_tf32",
    "device_label",
    "OUT_OF_MEMORY_MESSAGES",
    "drop_frames",
    "is_device_broken",
    "is_out_of_memory",
    "out_of_memory_types",
    "peak_memory_mib",
    "release_device_memory",
    "select_device",
    "tf32_state",
    "warn_emulated_precision",
]

log = logging.getLogger(__name__)

#: Fragments (lower case) of allocation failures that arrive as plain RuntimeErrors.
OUT_OF_MEMORY_MESSAGES = (
    "out of memory",  # torch's allocator, cudaErrorMemoryAllocation ("CUDA error: out of memory")
    "cublas_status_alloc_failed",  # cublasCreate or a cuBLAS workspace
    "cudnn_status_alloc_failed",
    "failed to allocate memory",  # ONNX Runtime's BFC arena
)

#: Fragments (lower case) of the sticky CUDA errors: after one, the process's context is lost.
BROKEN_DEVICE_MESSAGES = (
    "device-side assert triggered",  # cudaErrorAssert: e.g. an embedding id out of range
    "illegal memory access",  # cudaErrorIllegalAddress
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "illegal instruction",  # cudaErrorIllegalInstruction
    "misaligned address",  # cudaErrorMisalignedAddress
    "invalid program counter",  # cudaErrorInvalidPc
    "hardware stack error",  # cudaErrorHardwareStackError
    "launch timed out and was terminated",  # cudaErrorLaunchTimeout
    "uncorrectable ecc error",  # cudaErrorECCUncorrectable
    "operation not supported on global/shared address space",  # cudaErrorInvalidAddressSpace
    "cublas_status_execution_failed",  # what cuBLAS reports after one of the above
    "cudnn_status_execution_failed",
)


def out_of_memory_types() -> tuple[type[BaseException], ...]:
    """torch's out-of-memory classes on this torch: ``torch.OutOfMemoryError`` is 2.5+ only."""
    found = [
        getattr(torch, "OutOfMemoryError", None),
        getattr(torch.cuda, "OutOfMemoryError", None),
    ]
    return tuple(t for t in found if isinstance(t, type))


def _messages(exc: BaseException, depth: int = 4) -> list[str]:
    """The exception's message and those of the ones it was raised from, lower case."""
    seen: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < depth:
        seen.append(str(current).lower())
        current = current.__cause__ or current.__context__
    return seen


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device (or host allocator) out-of-memory error: shrink the batch and retry."""
    if isinstance(exc, out_of_memory_types()):
        return True
    return any(fragment in text for text in _messages(exc) for fragment in OUT_OF_MEMORY_MESSAGES)


def drop_frames(exc: BaseException) -> BaseException:
    """``exc`` without the frames its traceback (and those of the exceptions chained to it) keeps
    alive, returned for re-raising.

    The frames of a forward pass that ran out of memory hold its device tensors (the input
    batch, activations): while they live, ``empty_cache()`` frees none of that memory, and the
    retries of the halves run beside it. Frames still executing (the caller's) are left whole.
    """
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            current.__traceback__ = None
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return exc


def is_device_broken(exc: BaseException) -> bool:
    """True for a sticky CUDA error: this process's device context is lost, so it must exit.

    Out of memory never is (the context survives it).
    """
    if is_out_of_memory(exc):
        return False
    return any(fragment in text for text in _messages(exc) for fragment in BROKEN_DEVICE_MESSAGES)


def apply_tf32(choice: str) -> str:
    """Set TF32 for fp32 matmuls and cuDNN convolutions (``torch``: leave torch's defaults;
    ``on``; ``off``: exact fp32) and say what now runs, for the load log and the bench."""
    if choice in ("on", "off"):
        torch.backends.cuda.matmul.allow_tf32 = choice == "on"
        torch.backends.cudnn.allow_tf32 = choice == "on"
    return tf32_state()


def tf32_state() -> str:
    """TF32 as torch will use it on Ampere and newer GPUs: matmuls, then convolutions."""
    matmul = "on" if torch.backends.cuda.matmul.allow_tf32 else "off"
    conv = "on" if torch.backends.cudnn.allow_tf32 else "off"
    return f"TF32 matmul {matmul}, conv {conv}"


def device_label(device: torch.device, environ: Mapping[str, str] = os.environ) -> str:
    """``cuda:N`` with the physical GPU it is, for the heartbeat and ``status``: a supervised
    child sees its one GPU as ``cuda:0`` whichever it is (its ``CUDA_VISIBLE_DEVICES`` names
    it), so ``cuda:0 (GPU 3)``, or ``(GPU MIG-...)`` for a MIG instance; other devices as is."""
    if device.type != "cuda":
        return str(device)
    index = device.index or 0
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    physical = visible[index] if index < len(visible) else str(index)
    return f"cuda:{index} (GPU {physical})"


def select_device(device: torch.device) -> None:
    """Make ``cuda:N`` this thread's current device, so a handler's ``.cuda()``, the
    allocator and streams all use it (not device 0). A no-op elsewhere."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def release_device_memory(device: torch.device) -> None:
    """Return the allocator's cached blocks on ``device`` to the driver (CUDA only).

    Only blocks no tensor uses are returned: drop and collect what held the
    memory first, or it stays reserved.
    """
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_mib(device: torch.device) -> tuple[float, float] | None:
    """(peak allocated, peak reserved) MiB of torch's allocator on a CUDA ``device``; None
    elsewhere."""
    if device.type != "cuda":
        return None
    mib = 1024.0 * 1024.0
    return torch.cuda.max_memory_allocated(device) / mib, torch.cuda.max_memory_reserved(
        device
    ) / mib


def warn_emulated_precision(precision: str, device: torch.device) -> bool:
    """Warn (and return True) when ``bf16`` asks a pre-Ampere GPU for what it only emulates."""
    if precision != "bf16" or device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return False
    log.warning(
        "--precision bf16 on %s (compute capability %d.%d, before Ampere): the GPU has no bf16 "
        "units, so bf16 is emulated and slower than fp32; use --precision fp16 there",
        device,
        major,
        minor,
    )
    return True
