"""int8 for ``--precision int8``: dynamic quantization of linear layers, on the CPU.

Each linear layer keeps its weights as int8 with one scale per output channel
(symmetric, computed once at load); every call quantizes its input rows to
int8 with one scale per row (computed on the fly: "dynamic"), multiplies in
int8 with int32 accumulation (``torch._int_mm``) and rescales to float32.
Everything else in the model (embeddings, convolutions, activations) stays
float32, and so do the outputs.

Why not ``torch.ao.quantization.quantize_dynamic``: torch 2.10+ deprecates it
and the quantized tensor dtypes it builds on (both warn on every call), and it
only swaps ``nn.Linear`` submodules, which a ``torch.export`` program no longer
has. The same arithmetic here applies to both an ``nn.Module``
(:func:`quantize_module`) and an exported graph (:func:`quantize_graph`), and
measured as fast as fbgemm's on the example models. TorchScript graphs have no
route: serve their ``.pt2`` or ``.onnx`` form (ONNX Runtime quantizes those).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from inferfleet.worker.handler import Handler

__all__ = [
    "DynamicInt8Linear",
    "int8_linear",
    "quantize_graph",
    "quantize_handler",
    "quantize_module",
    "quantize_weight",
]

_EPS = 1e-12  # keeps an all-zero row or channel from dividing by zero


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 weight [out, in], float32 scale [out])``: symmetric, one scale per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=_EPS) / 127.0
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def int8_linear(
    x: torch.Tensor,
    weight_int8: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W.T + b`` with ``x`` quantized per row and ``W`` per channel; float32 out."""
    rows = x.reshape(-1, x.shape[-1]).float()
    x_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=_EPS) / 127.0
    x_int8 = torch.round(rows / x_scale).to(torch.int8)
    # int8 x int8 -> int32 on the CPU (oneDNN/fbgemm kernels); no quantized tensor types involved
    y = torch._int_mm(x_int8, weight_int8.t()).float() * x_scale * weight_scale
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight_int8.shape[0])


class DynamicInt8Linear(nn.Module):
    """A drop-in for a float ``nn.Linear`` whose weights are int8 (see the module docstring)."""

    weight_int8: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight_int8, scale = quantize_weight(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight_int8, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_module(module: nn.Module) -> tuple[nn.Module, int]:
    """Swap every ``nn.Linear`` in ``module`` (in place) for :class:`DynamicInt8Linear`.

    Returns the module (a new one if ``module`` itself is a Linear) and how
    many layers were swapped.
    """
    if isinstance(module, nn.Linear):
        return DynamicInt8Linear(module), 1
    count = 0
    for name, child in list(module.named_children()):
        new_child, swapped = quantize_module(child)
        if new_child is not child:
            setattr(module, name, new_child)
        count += swapped
    return module, count


def _attr(gm: fx.GraphModule, node: object) -> torch.Tensor | None:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value: object = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value if isinstance(value, torch.Tensor) else None


def quantize_graph(gm: fx.GraphModule) -> int:
    """Rewrite each ``aten.linear`` whose weight is a constant of ``gm`` into :func:`int8_linear`.

    For ``torch.export`` programs (``ExportedProgram.module()``). Edits ``gm``
    in place and returns how many calls were rewritten.
    """
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
            continue
        weight = _attr(gm, node.args[1])
        bias_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if weight is None or weight.dim() != 2:
            continue  # a weight computed at run time: leave the float call
        weight_int8, scale = quantize_weight(weight)
        names = (f"_int8_weight_{count}", f"_int8_scale_{count}")
        gm.register_buffer(names[0], weight_int8)
        gm.register_buffer(names[1], scale)
        with gm.graph.inserting_before(node):
            args = (
                node.args[0],
                gm.graph.get_attr(names[0]),
                gm.graph.get_attr(names[1]),
                bias_node,
            )
            node.replace_all_uses_with(gm.graph.call_function(int8_linear, args))
        gm.graph.erase_node(node)
        count += 1
    # no eliminate_dead_code(): it would also drop the export's input guards (_guards_fn)
    gm.recompile()
    return count


def quantize_handler(handler: Handler) -> None:
    """int8 for a handler: its own ``quantize()`` if it overrides it, else the default,
    every ``nn.Linear`` inside its ``nn.Module`` attributes. Raises ValueError when there is
    none."""
    if type(handler).quantize is not Handler.quantize:
        handler.quantize()
        return
    swapped = 0
    for name, value in list(vars(handler).items()):
        if isinstance(value, nn.Module):
            module, count = quantize_module(value)
            setattr(handler, name, module)
            swapped += count
    if not swapped:
        raise ValueError(
            f"--precision int8 found no torch.nn.Linear in the nn.Module attributes of "
            f"{type(handler).__name__}: override Handler.quantize, or serve it in fp32"
        )
