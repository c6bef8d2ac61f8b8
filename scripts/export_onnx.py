#!/usr/bin/env python3
"""Export the example models to ONNX (``affine.onnx``, ``ctr.onnx``, ``cnn.onnx``) for ONNX Runtime.

Each file is self-contained (weights inside), has a dynamic batch axis on
every input, the same weights as ``scripts/build_models.py`` builds (same
seeds) and the same example request body in its metadata_props
(``inferfleet_example``), so a worker warms up and checks inputs as it does
for the TorchScript files. ``--int8`` also writes ``KIND.int8.onnx``: the
MatMul/Gemm weights quantized by ONNX Runtime (what ``--precision int8`` does
at load). Needs ``onnx`` and ``onnxscript`` (the ``test`` extra).

    python scripts/export_onnx.py [--out models] [--only affine,ctr,cnn] [--int8]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inferfleet.worker.runtime.onnx_backend import quantize_onnx
from scripts.build_models import DEFAULT_MODELS, EXTRA, example_body, export_args, make_model


def export_onnx(kind: str, path: str) -> str:
    """Write example model ``kind`` to ``path`` as one self-contained ONNX file; return the path."""
    import onnx

    args, kwargs, dynamic = export_args(kind)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" notes
    with warnings.catch_warnings():
        # raised inside torch.export/torch.onnx (torch 2.13), not by this script: pytree and axis-name notes
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r".*axis name", category=UserWarning)
        program = torch.onnx.export(
            make_model(kind),
            args,
            kwargs=kwargs,
            dynamo=True,
            dynamic_shapes=dynamic,
            verbose=False,
        )
    assert program is not None
    proto = program.model_proto
    onnx.helper.set_model_props(proto, {EXTRA: example_body(kind)})
    onnx.save(proto, path)  # under 2 GB: weights inline, no .data file beside it
    return path


def export_all(kinds: list[str], out: str, int8: bool = False) -> list[str]:
    """Export ``kinds`` into ``out`` (plus ``KIND.int8.onnx`` copies with ``int8``); return the paths."""
    os.makedirs(out, exist_ok=True)
    written = []
    for kind in kinds:
        path = export_onnx(kind, os.path.join(out, f"{kind}.onnx"))
        written.append(path)
        if int8:
            quantized = os.path.join(out, f"{kind}.int8.onnx")
            quantize_onnx(path, quantized)
            written.append(quantized)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models", help="output folder (default: models)")
    parser.add_argument(
        "--only",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated subset of {', '.join(DEFAULT_MODELS)} (default: all)",
    )
    parser.add_argument(
        "--int8", action="store_true", help="also write KIND.int8.onnx (ONNX Runtime dynamic int8)"
    )
    args = parser.parse_args()
    kinds = args.only.split(",")
    for kind in kinds:
        if kind not in DEFAULT_MODELS:
            parser.error(f"unknown model {kind!r}: use {', '.join(DEFAULT_MODELS)}")
    try:
        for path in export_all(kinds, args.out, args.int8):
            print(f"wrote {path}")
    except ImportError as exc:
        sys.exit(f"export_onnx: {exc}: pip install -e '.[test]' (onnx and onnxscript)")


if __name__ == "__main__":
    main()
