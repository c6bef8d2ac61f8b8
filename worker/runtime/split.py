"""``inferfleet split``: cut a model by layers into stages, one torch.export program each.

The cut is torch's own: :func:`torch.distributed.pipelining.pipeline` with
``SplitPoint.BEGINNING`` at each named submodule traces the model with
torch.export (on the CPU, with no process group) and returns one graph module
per stage. Each stage is then exported again on its own with a dynamic batch
dimension and saved with its example inputs (:mod:`inferfleet.worker.runtime.pipeline`
describes the directory). Before the manifest is written, the saved programs
are loaded back and chained on the example, and on the example with one row
more (the batch dimension really is dynamic): the result must equal the
unsplit model's within ``atol``, or nothing is written.
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from inferfleet.producer.protocol import DTYPES, encode_body
from inferfleet.worker.errors import SplitError
from inferfleet.worker.runtime.loading import to_numpy
from inferfleet.worker.runtime.pipeline import (
    Manifest,
    StageInfo,
    is_pipeline,
    pipeline_digest,
    sha256_of,
    stage_file,
    write_manifest,
)
from inferfleet.worker.runtime.readers import EXAMPLE_EXTRA_FILE

__all__ = ["ATOL", "candidates", "load_splittable", "split_model"]

log = logging.getLogger(__name__)

#: How close the chained stages' outputs must be to the unsplit model's.
ATOL = 1e-5
#: Most candidate split points an error message names.
_CANDIDATES = 24


def load_splittable(model: str) -> torch.nn.Module:
    """The module ``model`` names: ``package.module:callable`` (returning an nn.Module) or a
    ``.pt2`` file."""
    if model.endswith(".pt2"):
        if not os.path.isfile(model):
            raise SplitError(f"model file {model!r} does not exist")
        try:
            return torch.export.unflatten(
                torch.export.load(model)
            )  # the submodules come back as modules
        except Exception as exc:
            raise SplitError(f"cannot load {model!r} as a torch.export program: {exc}") from exc
    module_name, _, attr = model.partition(":")
    if not module_name or not attr:
        raise SplitError(
            f"--model {model!r}: give package.module:callable (returning an nn.Module) or a .pt2 "
            "file"
        )
    try:
        target = getattr(importlib.import_module(module_name), attr)
        built = target() if callable(target) and not isinstance(target, torch.nn.Module) else target
    except Exception as exc:
        raise SplitError(f"cannot build {model!r}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(built, torch.nn.Module):
        raise SplitError(f"{model!r} gave a {type(built).__name__}, not a torch.nn.Module")
    return built.eval()


def candidates(module: torch.nn.Module) -> list[str]:
    """Submodules that usually make good split points: the children of the root and of its
    containers."""
    found = [name for name, _ in module.named_children()]
    for name, child in module.named_modules():
        if name and isinstance(child, (torch.nn.Sequential, torch.nn.ModuleList)):
            found += [f"{name}.{sub}" for sub, _ in child.named_children()]
    return list(dict.fromkeys(found))


def _named(candidate_list: list[str]) -> str:
    shown = ", ".join(candidate_list[:_CANDIDATES])
    more = len(candidate_list) - _CANDIDATES
    return shown + (f" and {more} more" if more > 0 else "")


def _check_names(module: torch.nn.Module, names: list[str]) -> list[str]:
    """The split points in the order the model defines them; SplitError for unknown or repeated
    ones."""
    order = {name: i for i, (name, _) in enumerate(module.named_modules()) if name}
    if not names:
        raise SplitError("give at least one --split-at name")
    if len(set(names)) != len(names):
        raise SplitError(f"--split-at names a submodule twice: {','.join(names)}")
    unknown = [n for n in names if n not in order]
    if unknown:
        raise SplitError(
            f"{', '.join(unknown)} is not a submodule of the model; candidates: "
            f"{_named(candidates(module))}"
        )
    return sorted(names, key=order.__getitem__)


@dataclass
class _Call:
    """A call's positional and keyword tensors (a stage's inputs)."""

    args: tuple
    kwargs: dict

    @classmethod
    def of(cls, inputs: Any) -> _Call:
        if isinstance(inputs, dict):
            return cls((), {k: torch.as_tensor(v) for k, v in inputs.items()})
        if isinstance(inputs, (list, tuple)):
            return cls(tuple(torch.as_tensor(v) for v in inputs), {})
        return cls((torch.as_tensor(inputs),), {})

    def run(self, module: Any) -> Any:
        return module(*self.args, **self.kwargs)

    def wire(self) -> Any:
        """The inputs as a request carries them (what the stage's worker receives)."""
        if self.kwargs:
            return {k: v.numpy() for k, v in self.kwargs.items()}
        return self.args[0].numpy() if len(self.args) == 1 else [a.numpy() for a in self.args]

    def dynamic_shapes(self) -> Any:
        batch = torch.export.Dim("batch", min=1, max=1 << 24)
        if self.kwargs:
            return {k: {0: batch} for k in self.kwargs}
        return tuple({0: batch} for _ in self.args)


def _next_call(outputs: Any) -> _Call:
    """A stage's outputs as the next stage's call (what a worker forwards)."""
    if isinstance(outputs, (tuple, list)):
        if len(outputs) == 1:
            return _Call((outputs[0],), {})  # one tensor: forwarded as a tensor
        return _Call(tuple(outputs), {})
    return _Call((outputs,), {})


def _signature(call: _Call, names: list[str]) -> dict:
    tensors = list(call.kwargs.items()) if call.kwargs else list(zip(names, call.args))
    form = "map" if call.kwargs else ("tensor" if len(call.args) == 1 else "list")
    return {
        "form": form,
        "tensors": [
            {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": ["N", *t.shape[1:]]}
            for n, t in tensors
        ],
    }


def _outputs_signature(outputs: Any) -> dict:
    call = _next_call(outputs)
    return _signature(call, [f"output_{i}" for i in range(len(call.args))])


def _tile(inputs: Any, rows: int) -> Any:
    def one(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.concatenate([a] * (-(-rows // a.shape[0])))[:rows])

    if isinstance(inputs, dict):
        return {k: one(v) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return [one(v) for v in inputs]
    return one(inputs)


def _rows(inputs: Any) -> int:
    first = (
        next(iter(inputs.values()))
        if isinstance(inputs, dict)
        else (inputs[0] if isinstance(inputs, (list, tuple)) else inputs)
    )
    return int(np.asarray(first).shape[0])


def _check_example(example: Any) -> None:
    leaves = (
        list(example.values())
        if isinstance(example, dict)
        else (list(example) if isinstance(example, (list, tuple)) else [example])
    )
    for leaf in leaves:
        if not isinstance(leaf, np.ndarray) or leaf.ndim == 0 or leaf.dtype.name not in DTYPES:
            raise SplitError(
                "the example must hold tensors with a batch dimension, of a dtype the "
                f"contract carries ({', '.join(DTYPES)})"
            )


def _cut(module: torch.nn.Module, call: _Call, names: list[str]) -> list[torch.nn.Module]:
    """torch's splitter: one graph module per stage, or SplitError naming the candidates."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's tracer warns about its own internals
            pipe = pipeline(
                module,
                mb_args=call.args,
                mb_kwargs=call.kwargs or None,
                split_spec=dict.fromkeys(names, SplitPoint.BEGINNING),
            )
    except Exception as exc:
        raise SplitError(
            f"torch cannot trace and cut the model at {', '.join(names)}: "
            f"{type(exc).__name__}: {str(exc)[:500]}; candidates: {_named(candidates(module))}"
        ) from exc
    if pipe.num_stages != len(names) + 1:
        raise SplitError(
            f"the graph cannot be cut at {', '.join(names)}: torch found {pipe.num_stages} stages, "
            f"not {len(names) + 1} (a split point must be called once, on the main path, not "
            f"inside a branch or a loop); candidates: {_named(candidates(module))}"
        )
    return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]


def _export(stage: torch.nn.Module, call: _Call, where: str) -> torch.export.ExportedProgram:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.export(
                stage, call.args, call.kwargs, dynamic_shapes=call.dynamic_shapes()
            )
    except Exception as exc:
        raise SplitError(
            f"{where} cannot be exported with a dynamic batch dimension: "
            f"{type(exc).__name__}: {str(exc)[:500]}"
        ) from exc


def _save_stage(
    program: torch.export.ExportedProgram,
    stage: torch.nn.Module,
    call: _Call,
    outputs: Any,
    index: int,
    starts_at: str,
    out: str,
) -> StageInfo:
    path = os.path.join(out, stage_file(index))
    example = base64.b64encode(encode_body(call.wire())).decode("ascii")
    torch.export.save(program, path, extra_files={EXAMPLE_EXTRA_FILE: example})
    placeholders = list(program.graph_signature.user_inputs)
    tensors = list(stage.parameters()) + list(stage.buffers())
    return StageInfo(
        index,
        stage_file(index),
        sha256_of(path),
        starts_at,
        _signature(call, [str(p) for p in placeholders]),
        _outputs_signature(outputs),
        sum(p.numel() for p in stage.parameters()),
        sum(t.numel() * t.element_size() for t in tensors),
    )


def _chain(paths: list[str], inputs: Any) -> Any:
    """Run the saved programs one after another, as the workers will."""
    call = _Call.of(inputs)
    for path in paths:
        outputs = call.run(torch.export.load(path).module())
        call = _next_call(outputs)
    return outputs


def _leaves(value: Any) -> list[np.ndarray]:
    value = to_numpy(value)
    if isinstance(value, dict):
        return [value[k] for k in sorted(value)]
    return list(value) if isinstance(value, list) else [value]


def _same(expected: Any, got: Any, atol: float) -> str | None:
    """None if ``got`` equals ``expected`` within ``atol``, else what differs."""
    want, have = _leaves(expected), _leaves(got)
    if len(want) != len(have):
        return f"the stages give {len(have)} outputs, the model {len(want)}"
    for i, (a, b) in enumerate(zip(want, have)):
        if a.shape != b.shape:
            return f"output {i} has shape {b.shape}, the model's {a.shape}"
        diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
        if not diff <= atol:
            return f"output {i} differs by up to {diff:.3g} (more than {atol:g})"
    return None


def _verify(module: torch.nn.Module, paths: list[str], example: Any, atol: float) -> None:
    for inputs in (example, _tile(example, _rows(example) + 1)):
        with torch.inference_mode():
            expected = _Call.of(inputs).run(module)
            problem = _same(expected, _chain(paths, inputs), atol)
        if problem:
            raise SplitError(
                f"the chained stages do not reproduce the model on the example "
                f"({_rows(inputs)} rows): {problem}; nothing was written"
            )


def split_model(
    model: str, example: Any, names: list[str], out: str, atol: float = ATOL
) -> Manifest:
    """Split ``model`` at ``names`` into ``out`` (created; its old stages are replaced). Returns the
    manifest.

    The saved stages are checked against the unsplit model on ``example``
    before the manifest is written, so a directory with a manifest always
    holds a split that reproduces its model.
    """
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", FutureWarning
        )  # torch's export internals warn about themselves
        warnings.simplefilter("ignore", UserWarning)
        return _split(model, example, names, out, atol)


def _split(model: str, example: Any, names: list[str], out: str, atol: float) -> Manifest:
    _check_example(example)
    if os.path.exists(out) and not is_pipeline(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise SplitError(f"--out {out!r} exists and is not a split: give a new or empty directory")
    module = load_splittable(model)
    ordered = _check_names(module, names)
    example = _tile(
        example, max(_rows(example), 2)
    )  # a batch of 1 would be specialised away by export
    stages = _cut(module, _Call.of(example), ordered)
    work = out.rstrip("/") + ".partial"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    infos, call = [], _Call.of(example)
    with torch.inference_mode():
        for index, stage in enumerate(stages):
            where = f"stage {index}" + (f" (from {ordered[index - 1]})" if index else "")
            outputs = call.run(stage)
            infos.append(
                _save_stage(
                    _export(stage, call, where),
                    stage,
                    call,
                    outputs,
                    index,
                    ordered[index - 1] if index else "",
                    work,
                )
            )
            call = _next_call(outputs)
    _verify(module, [os.path.join(work, info.file) for info in infos], example, atol)
    manifest = Manifest(model, ordered, pipeline_digest([i.sha256 for i in infos], ordered), infos)
    write_manifest(work, manifest)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(work, out)
    log.info(
        "split %s at %s into %d stages in %s (version %s)",
        model,
        ",".join(ordered),
        len(infos),
        out,
        manifest.version,
    )
    return manifest
