"""``save_model``: one file that carries a model, its example and its input spec.

A worker started on the file needs nothing else: it checks every request
against the spec (dtypes, and which dimensions vary), warms up on the example,
and the file is recognised by its content whatever its name::

    from inferfleet.worker import save_model

    save_model(model, {"ids": ids, "mask": mask}, "model.pt2", dynamic={"ids": [1], "mask": [1]})

An ``nn.Module`` is exported with ``torch.export`` (dimension 0, the batch,
always varies; ``dynamic`` names the others); a ``torch.jit.ScriptModule`` is
saved as TorchScript with the spec beside it, since TorchScript carries none.
``inferfleet save-model`` is the command-line equivalent.
"""

from __future__ import annotations

import base64
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from inferfleet.producer.protocol import encode_body
from inferfleet.worker.runtime.readers import EXAMPLE_EXTRA_FILE, SPEC_EXTRA_FILE
from inferfleet.worker.runtime.signature import describe_spec, parse_spec, spec_of

__all__ = ["save_model", "spec_with_dynamic"]

#: The largest batch and length an exported program accepts (torch.export needs a bound).
MAX_SIZE = 1 << 16


def _numpy(example: Any) -> Any:
    if isinstance(example, torch.Tensor):
        return example.detach().cpu().numpy()
    if isinstance(example, Mapping):
        return {str(k): _numpy(v) for k, v in example.items()}
    if isinstance(example, (list, tuple)):
        return [_numpy(v) for v in example]
    return np.asarray(example)


def _dims_of(dynamic: Any, count: int) -> list[dict[int, str]]:
    """Per input (in spec order), the varying trailing dimensions as {dim: name}."""
    if dynamic is None:
        return [{} for _ in range(count)]
    if isinstance(dynamic, Mapping) and all(isinstance(k, int) for k in dynamic):
        return [{int(k): str(v) for k, v in dynamic.items()}] * count  # one tensor: {1: "L"}
    if isinstance(dynamic, Sequence) and all(isinstance(d, int) for d in dynamic):
        # [1]: dim 1 varies (named L in every input alike); [1, 2]: L and L2
        return [{d: "L" if i == 0 else f"L{i + 1}" for i, d in enumerate(dynamic)}] * count
    raise ValueError(
        f"dynamic={dynamic!r}: give {{1: 'L'}} or [1] (one tensor or every input alike), "
        f"a list of those per positional input, a dict of them per named input, or a spec string "
        f"such as 'int64[N,L]'"
    )


def _per_input(dynamic: Any, spec: Hashable) -> list[dict[int, str]]:
    kind, parts = cast("tuple[str, Any]", spec)
    count = 1 if kind == "tensor" else len(parts)
    if (
        kind == "map"
        and isinstance(dynamic, Mapping)
        and dynamic
        and all(isinstance(k, str) for k in dynamic)
    ):
        return [_dims_of(dynamic.get(name), 1)[0] for name, _, _ in parts]
    if (
        kind == "list"
        and isinstance(dynamic, list)
        and dynamic
        and not all(isinstance(d, int) for d in dynamic)
    ):
        if len(dynamic) != count:
            raise ValueError(f"dynamic has {len(dynamic)} entries for {count} positional inputs")
        return [_dims_of(d, 1)[0] for d in dynamic]
    return _dims_of(dynamic, count)


def spec_with_dynamic(example: Any, dynamic: Any) -> Hashable:
    """The spec of ``example`` (numpy) with the ``dynamic`` dimensions named (varying)."""
    spec = spec_of(example)
    if isinstance(dynamic, str):
        return parse_spec(dynamic)
    dims = _per_input(dynamic, spec)
    kind, parts = cast("tuple[str, Any]", spec)

    def name(trail: tuple[int, ...], varying: dict[int, str]) -> tuple[int | str, ...]:
        if any(not 1 <= d <= len(trail) for d in varying):
            raise ValueError(
                f"dynamic dimensions {sorted(varying)} are not trailing dimensions 1..{len(trail)}"
            )
        return tuple(varying.get(i + 1, size) for i, size in enumerate(trail))

    if kind == "tensor":
        return ("tensor", (parts[0], name(parts[1], dims[0])))
    if kind == "map":
        return ("map", tuple((k, d, name(t, v)) for (k, d, t), v in zip(parts, dims)))
    return ("list", tuple((d, name(t, v)) for (d, t), v in zip(parts, dims)))


def _at_least_two_rows(example: Any) -> Any:
    """torch.export treats a size of 1 as fixed: an example of one row is doubled."""
    if isinstance(example, dict):
        return {k: _at_least_two_rows(v) for k, v in example.items()}
    if isinstance(example, list):
        return [_at_least_two_rows(v) for v in example]
    return np.concatenate([example, example]) if example.shape[0] < 2 else example


def _export(module: torch.nn.Module, example: Any, spec: Hashable) -> Any:
    """``torch.export.export`` with dimension 0 and every named dimension dynamic."""
    dims: dict[str, Any] = {"N": torch.export.Dim("batch", min=1, max=MAX_SIZE)}

    def shapes(trail: tuple[int | str, ...]) -> dict[int, Any]:
        named = {}
        for i, d in enumerate(trail):
            if isinstance(
                d, str
            ):  # "*" varies on its own; a name is one length wherever it appears
                key = d if d != "*" else f"any{len(dims)}"
                named[i + 1] = dims.setdefault(key, torch.export.Dim(key, min=1, max=MAX_SIZE))
        return {0: dims["N"], **named}

    kind, parts = cast("tuple[str, Any]", spec)
    tensors = _at_least_two_rows(example)
    if kind == "tensor":
        return torch.export.export(
            module, (torch.from_numpy(tensors),), dynamic_shapes=(shapes(parts[1]),)
        )
    if kind == "map":
        kwargs = {k: torch.from_numpy(tensors[k]) for k in tensors}
        return torch.export.export(
            module, (), kwargs, dynamic_shapes={k: shapes(t) for k, _, t in parts}
        )
    args = tuple(torch.from_numpy(a) for a in tensors)
    return torch.export.export(module, args, dynamic_shapes=tuple(shapes(t) for _, t in parts))


def save_model(module: Any, example: Any, path: str, dynamic: Any = None) -> str:
    """Save ``module`` with ``example`` (one request's inputs) and its input spec to ``path``.

    ``example``: a tensor, a list of tensors (positional arguments) or a dict (keyword
    arguments), numpy or torch. ``dynamic``: the trailing dimensions that vary besides the
    batch: ``[1]`` or ``{1: "L"}`` for every input alike, a list of those per positional
    input, a dict per named input, or a spec string (``"{ids: int64[N,L], mask: bool[N,L]}"``).
    Returns the spec written (the form ``--input-spec`` takes). Raises ValueError when the
    module cannot be exported with those dimensions (the message is torch's).
    """
    arrays = _numpy(example)
    spec = spec_with_dynamic(arrays, dynamic)
    extra = {
        EXAMPLE_EXTRA_FILE: base64.b64encode(encode_body(arrays)).decode("ascii"),
        SPEC_EXTRA_FILE: describe_spec(spec),
    }
    if isinstance(module, torch.jit.ScriptModule):
        torch.jit.save(module, path, _extra_files=extra)
        return extra[SPEC_EXTRA_FILE]
    if not isinstance(module, torch.nn.Module):
        raise ValueError(
            f"save_model takes a torch.nn.Module or a ScriptModule, got {type(module).__name__}"
        )
    try:
        program = _export(module.eval(), arrays, spec)
    except (
        Exception
    ) as exc:  # torch.export raises many kinds (UserError, GuardOnDataDependentSymNode...)
        raise ValueError(
            f"torch.export cannot export this module with the spec {describe_spec(spec)}: "
            f"{str(exc).strip().splitlines()[0]}"
        ) from exc
    torch.export.save(program, path, extra_files=extra)
    return extra[SPEC_EXTRA_FILE]
