"""The model contract for custom code: subclass :class:`Handler`.

In the spirit of LitServe's LitAPI, a handler is one small class. The worker
calls ``setup(device)`` once, ``example_inputs()`` to warm up, then, for
every batch::

    x = preprocess(inputs, params)   # numpy arrays, concatenated row-wise
    y = predict(x, params)           # under torch.inference_mode()
    outputs = postprocess(y, params) # tensors or numpy arrays, same row count

Start a worker on it with ``inferfleet worker --model mypkg.mymodule:MyHandler``.
TorchScript and torch.export models are served by :class:`ModuleHandler`,
``.onnx`` files by :class:`inferfleet.worker.runtime.onnx_backend.OnnxHandler`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["Handler", "ModuleHandler", "to_device"]


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

        The default swaps every ``torch.nn.Linear`` inside the handler's
        ``nn.Module`` attributes for a dynamically quantized one
        (:mod:`inferfleet.worker.runtime.quantize`). Raises ValueError when there is none.
        """
        from inferfleet.worker.runtime.quantize import quantize_module

        swapped = 0
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.nn.Module):
                module, count = quantize_module(value)
                setattr(self, name, module)
                swapped += count
        if not swapped:
            raise ValueError(f"--precision int8 found no torch.nn.Linear in the nn.Module attributes of "
                             f"{type(self).__name__}: override Handler.quantize, or serve it in fp32")

    def predict(self, x: Any, params: dict) -> Any:
        """Run the model on one batch."""
        raise NotImplementedError("a Handler must implement predict(x, params)")

    def postprocess(self, y: Any, params: dict) -> Any:
        """Turn model outputs into reply outputs (default: unchanged)."""
        return y


class ModuleHandler(Handler):
    """Serves a callable torch module (TorchScript or torch.export) as it is."""

    accepts_params = False

    def __init__(self, module: Any, example: Any = None) -> None:
        self.module = module
        self._example = example

    def setup(self, device: torch.device) -> None:
        self.device = device
        if isinstance(self.module, torch.jit.ScriptModule):
            self.module.eval()  # exported programs refuse eval(): they are frozen already

    def example_inputs(self) -> Any:
        return self._example

    def compile(self) -> None:
        """Wrap the module in ``torch.compile`` (torch.export programs only)."""
        if isinstance(self.module, torch.jit.ScriptModule):
            raise ValueError("torch.compile cannot compile a TorchScript model: export it with "
                             "torch.export (.pt2) or serve it without --compile")
        self.module = torch.compile(self.module, dynamic=True)

    def quantize(self) -> None:
        """int8 linear layers: an exported graph is rewritten, a TorchScript one has no route."""
        from inferfleet.worker.runtime.quantize import quantize_graph, quantize_module

        if isinstance(self.module, torch.jit.ScriptModule):
            raise ValueError("--precision int8 cannot quantize a TorchScript model: serve its torch.export "
                             "form (.pt2) or its ONNX form (.onnx, see scripts/export_onnx.py) instead, or use fp32")
        if isinstance(self.module, torch.fx.GraphModule):
            swapped = quantize_graph(self.module)
        else:
            self.module, swapped = quantize_module(self.module)
        if not swapped:
            raise ValueError("--precision int8 found no linear layer with constant weights in this model: "
                             "serve it in fp32")

    def predict(self, x: Any, params: dict) -> Any:
        if params:
            raise ValueError("this model takes no params; send the request without 'params'")
        if isinstance(x, dict):
            return self.module(**x)
        if isinstance(x, list):
            return self.module(*x)
        return self.module(x)
