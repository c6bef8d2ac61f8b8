"""The model contract for custom code: subclass :class:`Handler`.

In the spirit of LitServe's LitAPI, a handler is one small class. The worker
calls ``setup(device)`` once, ``example_inputs()`` to warm up, then, for
every batch::

    x = preprocess(inputs, params)   # numpy arrays, concatenated row-wise
    y = predict(x, params)           # under torch.inference_mode()
    outputs = postprocess(y, params) # tensors or numpy arrays, same row count

A handler that overrides any of the per-request hooks (as LitServe's are
named) is called instead as::

    items = [decode_request(inputs, params) for each request]   # raw text/bytes or numpy, one
    request x = batch(items, params)                                    # collate, e.g. pad_batch()
    to one length y = postprocess(predict(preprocess(x, params), params), params) parts = unbatch(y,
    rows, params)                            # one output per request outputs =
    [encode_response(part, params) for each part]     # tensors, arrays, text or bytes

so requests of any shape, and raw text or bytes (protocol version 1.2), share
one batch. docs/handlers.md has complete examples.

Start a worker on it with ``inferfleet worker --model mypkg.mymodule:MyHandler``
(the current directory is on the import path, as with ``python -m``).
The runtime serves TorchScript and torch.export files with its own handler
(:class:`inferfleet.worker.runtime.modules.ModuleHandler`) and ``.onnx`` files
with :class:`inferfleet.worker.runtime.onnx_backend.OnnxHandler`. This module
imports nothing of the worker: it is the contract the runtime builds on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Handler", "pad_batch", "split_rows", "to_device"]

#: The per-request hooks: a handler that overrides any of them is served request by request.
PER_REQUEST_HOOKS = ("decode_request", "batch", "unbatch", "encode_response")


def to_device(inputs: Any, device: torch.device) -> Any:
    """Numpy inputs (a tensor, list or dict of them) as torch tensors on ``device``."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, np.ndarray):
        tensor = torch.from_numpy(inputs)
        if device.type == "cpu":
            return tensor
        # pinned host memory lets the copy run asynchronously with the host's next work
        return tensor.pin_memory().to(device, non_blocking=True)
    if isinstance(inputs, dict):
        return {k: to_device(v, device) for k, v in inputs.items()}
    return [to_device(v, device) for v in inputs]


def pad_batch(
    arrays: Sequence[np.ndarray],
    pad_value: Any = 0,
    buckets: Sequence[int] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """Stack arrays of shape (rows, length, ...) of varying lengths into one padded batch and its
    mask.

    Returns ``(batch, mask)``: ``batch`` of shape (sum of rows, L, ...) filled with ``pad_value``
    past each array's length, ``mask`` (sum of rows, L) True where a value is real. L is the
    longest length, rounded up to the next of ``buckets`` (ascending) when given, so a model sees
    a few lengths only (its warm-up and any shape-specialised plans cover them).
    """
    if not arrays:
        raise ValueError("pad_batch needs at least one array")
    longest = max(a.shape[1] for a in arrays)
    length = next((b for b in buckets if b >= longest), longest)
    rows = sum(a.shape[0] for a in arrays)
    batch = np.full((rows, length, *arrays[0].shape[2:]), pad_value, dtype=arrays[0].dtype)
    mask = np.zeros((rows, length), dtype=bool)
    start = 0
    for a in arrays:
        batch[start : start + a.shape[0], : a.shape[1]] = a
        mask[start : start + a.shape[0], : a.shape[1]] = True
        start += a.shape[0]
    return batch, mask


def split_rows(outputs: Any, rows: Sequence[int]) -> list[Any]:
    """Cut batched outputs (a tensor or array, or a list, tuple or dict of them) into per-request
    parts."""
    bounds = [0]
    for n in rows:
        bounds.append(bounds[-1] + n)
    if isinstance(outputs, dict):
        cut = {k: split_rows(v, rows) for k, v in outputs.items()}
        return [{k: cut[k][i] for k in cut} for i in range(len(rows))]
    if isinstance(outputs, (list, tuple)):
        columns = [split_rows(v, rows) for v in outputs]
        return [[c[i] for c in columns] for i in range(len(rows))]
    if len(outputs) != bounds[-1]:
        raise ValueError(f"the model returned {len(outputs)} rows for a batch of {bounds[-1]}")
    return [outputs[bounds[i] : bounds[i + 1]] for i in range(len(rows))]


def _concat(items: Sequence[Any]) -> Any:
    first = items[0]
    if isinstance(first, dict):
        return {k: _concat([item[k] for item in items]) for k in first}
    if isinstance(first, (list, tuple)):
        return [_concat([item[i] for item in items]) for i in range(len(first))]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(items))
    return np.concatenate(items)


class Handler:
    """Base class of custom model code. Override ``setup`` and ``predict`` at least."""

    #: Reported in every reply; None lets the worker use --model-version or "1".
    version: str | None = None
    device: torch.device = torch.device("cpu")
    #: Whether requests may carry ``params`` (graph models take none: they are refused up front).
    accepts_params: bool = True
    #: The inputs it takes, checked on every request (``"int64[N,L]"``: L varies; see
    #: :mod:`inferfleet.worker.runtime.signature`); None takes the example's, if any.
    input_spec: Any = None

    def setup(self, device: torch.device) -> None:
        """Load weights and place them on ``device``. Called once, before warm-up."""
        self.device = device

    def example_inputs(self) -> Any:
        """Inputs (numpy) the worker runs at start-up to warm up; None skips warm-up."""
        return None

    def preprocess(self, inputs: Any, params: dict) -> Any:
        """Turn the batch's numpy inputs into what ``predict`` takes (default: tensors)."""
        return to_device(inputs, self.device)

    def compile(self) -> None:
        """Compile the model for ``--compile``; a handler that supports it overrides this."""
        raise ValueError(
            f"{type(self).__name__} does not support --compile (override Handler.compile)"
        )

    def quantize(self) -> None:
        """Make the model int8 for ``--precision int8`` (CPU); called once, after ``setup``.

        Left as it is, the runtime applies its default: every ``torch.nn.Linear``
        inside the handler's ``nn.Module`` attributes becomes a dynamically
        quantized one (:func:`inferfleet.worker.runtime.quantize.quantize_handler`).
        Override it for anything else; raise ValueError when it cannot be done.
        """
        raise NotImplementedError(
            "the runtime quantizes a Handler that does not override quantize()"
        )

    def predict(self, x: Any, params: dict) -> Any:
        """Run the model on one batch."""
        raise NotImplementedError("a Handler must implement predict(x, params)")

    def postprocess(self, y: Any, params: dict) -> Any:
        """Turn model outputs into reply outputs (default: unchanged)."""
        return y

    # -- per-request hooks (override any of them to be served request by request)

    def decode_request(self, inputs: Any, params: dict) -> Any:
        """One request's inputs (numpy, or raw ``str``/``bytes``) as an item of a batch (default:
        unchanged)."""
        return inputs

    def batch(self, items: list[Any], params: dict) -> Any:
        """Collate the decoded items of one batch (default: concatenate row-wise; see
        :func:`pad_batch`)."""
        return _concat(items)

    def unbatch(self, outputs: Any, rows: list[int], params: dict) -> list[Any]:
        """Split the batch's outputs per request; ``rows`` are the requests' row counts (raw: 1
        each)."""
        return split_rows(outputs, rows)

    def encode_response(self, output: Any, params: dict) -> Any:
        """One request's output as its reply's outputs: tensors, arrays, text or bytes (default:
        unchanged)."""
        return output

    @property
    def per_request(self) -> bool:
        """Whether this handler overrides any per-request hook (:data:`PER_REQUEST_HOOKS`)."""
        return any(
            getattr(type(self), hook) is not getattr(Handler, hook) for hook in PER_REQUEST_HOOKS
        )
