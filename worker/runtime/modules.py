"""The runtime's own handler for TorchScript and torch.export models: the module served as it is."""

from __future__ import annotations

from typing import Any

import torch

from inferfleet.worker.handler import Handler
from inferfleet.worker.runtime.quantize import quantize_graph, quantize_module

__all__ = ["ModuleHandler"]


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
            raise ValueError(
                "torch.compile cannot compile a TorchScript model: export it with "
                "torch.export (.pt2) or serve it without --compile"
            )
        self.module = torch.compile(self.module, dynamic=True)

    def quantize(self) -> None:
        """int8 linear layers: an exported graph is rewritten, a TorchScript one has no route."""
        if isinstance(self.module, torch.jit.ScriptModule):
            raise ValueError(
                "--precision int8 cannot quantize a TorchScript model: serve its torch.export "
                "form (.pt2) or its ONNX form (.onnx, see tests/fixtures/export_onnx.py) instead, "
                "or use fp32"
            )
        if isinstance(self.module, torch.fx.GraphModule):
            swapped = quantize_graph(self.module)
        else:
            self.module, swapped = quantize_module(self.module)
        if not swapped:
            raise ValueError(
                "--precision int8 found no linear layer with constant weights in this model: "
                "serve it in fp32"
            )

    def predict(self, x: Any, params: dict) -> Any:
        if params:
            raise ValueError("this model takes no params; send the request without 'params'")
        if isinstance(x, dict):
            return self.module(**x)
        if isinstance(x, list):
            return self.module(*x)
        return self.module(x)
