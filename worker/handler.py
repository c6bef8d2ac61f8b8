"""The model contract for custom code: subclass :class:`Handler`.

In the spirit of LitServe's LitAPI, a handler is one small class. The worker
calls ``setup(device)`` once, ``example_inputs()`` to warm up, then, for
every batch::

    x = preprocess(inputs, params)   # numpy arrays, concatenated row-wise
    y = predict(x, params)           # under torch.inference_mode()
    outputs = postprocess(y, params) # tensors or numpy arrays, same row count

Start a worker on it with ``inferfleet worker --model mypkg.mymodule:MyHandler``.
The runtime serves TorchScript and torch.export files with its own handler
(:class:`inferfleet.worker.runtime.modules.ModuleHandler`) and ``.onnx`` files
with :class:`inferfleet.worker.runtime.onnx_backend.OnnxHandler`. This module
imports nothing of the worker: it is the contract the runtime builds on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["Handler", "to_device"]


def to_device(inputs: Any, device: torch.device) -> Any:
    """Numpy inputs (a tensor, list or dict of them) as torch tensors on ``device``."""
    if isinstance(inputs, np.ndarray):
        tensor = torch.from_numpy(inputs)
        if device.type == "cpu":
            return tensor
        # pinned host memory lets the copy run asynchronously with the host's next work
        return tensor.pin_memory().to(device, non_blocking=True)
    if isinstance(inputs, dict):
        return {k: to_device(v, device) for k, v in inputs.items()}
    return [to_device(v, device) for v in inputs]


class Handler:
    """Base class of custom model code. Override ``setup`` and ``predict`` at least."""

    #: Reported in every reply; None lets the worker use --model-version or "1".
    version: str | None = None
    device: torch.device = torch.device("cpu")
    #: Whether requests may carry ``params`` (graph models take none: they are refused up front).
    accepts_params: bool = True

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
        raise ValueError(f"{type(self).__name__} does not support --compile (override Handler.compile)")

    def quantize(self) -> None:
        """Make the model int8 for ``--precision int8`` (CPU); called once, after ``setup``.

        Left as it is, the runtime applies its default: every ``torch.nn.Linear``
        inside the handler's ``nn.Module`` attributes becomes a dynamically
        quantized one (:func:`inferfleet.worker.runtime.quantize.quantize_handler`).
        Override it for anything else; raise ValueError when it cannot be done.
        """
        raise NotImplementedError("the runtime quantizes a Handler that does not override quantize()")

    def predict(self, x: Any, params: dict) -> Any:
        """Run the model on one batch."""
        raise NotImplementedError("a Handler must implement predict(x, params)")

    def postprocess(self, y: Any, params: dict) -> Any:
        """Turn model outputs into reply outputs (default: unchanged)."""
        return y
