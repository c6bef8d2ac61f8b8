#!/usr/bin/env python3
"""Build the example models, with no downloads, into a folder (default ``models/``).

* ``affine.pt``  y = x W + b, float32[N,16] -> float32[N,4]: the overhead model.
* ``ctr.pt``     the article's ad-ranking case: 26 sparse ids (int64[N,26]) through
                 per-feature embedding tables, 13 dense floats (float32[N,13]), an
                 MLP, a click probability float32[N,1]. Called with a map
                 ``{"dense": ..., "sparse": ...}``.
* ``cnn.pt``     a small image CNN, float32[N,3,32,32] -> 10 logits.
* ``affine.pt2`` the affine model as a torch.export program (dynamic batch).
* ``stack.pt``   a stack of 6 residual MLP blocks (``blocks.0`` ... ``blocks.5``) and a head,
                 float32[N,32] -> float32[N,8]: the model to split into pipeline stages
                 (``stack.pt2`` its torch.export form, ``stack.npy`` an example input for
                 ``inferfleet split``). ``stack(width, depth)`` builds larger ones.
* ``resnet50.pt`` only with ``--only resnet50``: ResNet-50's architecture, random weights.

Every file carries an example request body, base64 (extra file ``inferfleet_example``),
that workers use to warm up and to check request shapes. Weights come from a
fixed seed, so two builds give the same models.

    python scripts/build_models.py [--out models] [--only affine,ctr]
"""

from __future__ import annotations

import argparse
import base64
import os
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inferfleet.producer.protocol import encode_body

EXTRA = "inferfleet_example"
CTR_SPARSE, CTR_DENSE, CTR_VOCAB, CTR_DIM = 26, 13, 1000, 16
STACK_WIDTH = 64


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class CTR(nn.Module):
    """Sparse ids -> per-feature embedding tables, dense -> MLP, both -> click probability."""

    def __init__(self) -> None:
        super().__init__()
        self.vocab = CTR_VOCAB
        self.tables = nn.Embedding(CTR_SPARSE * CTR_VOCAB, CTR_DIM)
        self.register_buffer("offsets", torch.arange(CTR_SPARSE, dtype=torch.int64) * CTR_VOCAB)
        self.dense_mlp = nn.Sequential(nn.Linear(CTR_DENSE, 64), nn.ReLU(), nn.Linear(64, CTR_DIM))
        self.top = nn.Sequential(
            nn.Linear((CTR_SPARSE + 1) * CTR_DIM, 256),
            nn.ReLU(),
            nn.Linear(256, 128),
            nn.ReLU(),
            nn.Linear(128, 1),
        )

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        ids = (
            sparse.remainder(self.vocab) + self.offsets
        )  # hash-bucket every feature into its table
        emb = self.tables(ids).flatten(1)
        x = torch.cat([self.dense_mlp(dense), emb], dim=1)
        return torch.sigmoid(self.top(x))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def example_inputs(kind: str, rows: int = 2, seed: int = 0) -> object:
    """Inputs of the right form for each example model (numpy)."""
    rng = np.random.default_rng(seed)
    if kind == "affine":
        return rng.standard_normal((rows, 16), dtype=np.float32)
    if kind == "ctr":
        return {
            "dense": rng.standard_normal((rows, CTR_DENSE), dtype=np.float32),
            "sparse": rng.integers(0, 10**6, size=(rows, CTR_SPARSE), dtype=np.int64),
        }
    if kind == "cnn":
        return rng.standard_normal((rows, 3, 32, 32), dtype=np.float32)
    if kind == "resnet50":
        return rng.standard_normal((rows, 3, 224, 224), dtype=np.float32)
    if kind == "stack":
        return rng.standard_normal((rows, 32), dtype=np.float32)
    raise ValueError(f"unknown example model {kind!r}: use affine, ctr or cnn")


class Block(nn.Module):
    """x + W2 relu(W1 x): one residual MLP block of :class:`Stack`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.relu(self.inner(x)))


class Stack(nn.Module):
    """``depth`` residual MLP blocks of ``width`` between an input and an output layer: stages of equal cost."""

    def __init__(
        self, width: int = STACK_WIDTH, depth: int = 6, inputs: int = 32, outputs: int = 8
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def stack(width: int = STACK_WIDTH, depth: int = 6) -> nn.Module:
    """A :class:`Stack` with fixed weights (``inferfleet split --model scripts.build_models:stack``)."""
    torch.manual_seed(5)
    return Stack(width, depth).eval()


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU(),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class ResNet50(nn.Module):
    """ResNet-50's architecture (25.6 M parameters, random weights): the article's cold-start example.

    Not built by default (about 100 MB): ``--only resnet50``. Input float32[N,3,224,224].
    """

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        ]
        cin = 64
        for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for b in range(blocks):
                layers.append(Bottleneck(cin, mid, stride if b == 0 else 1))
                cin = mid * 4
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(2048, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


MODELS = {"affine": Affine, "ctr": CTR, "cnn": SmallCNN, "resnet50": ResNet50, "stack": Stack}
DEFAULT_MODELS = ("affine", "ctr", "cnn", "stack")


def make_model(kind: str) -> nn.Module:
    """The example model ``kind`` in eval mode, its weights from a fixed seed (the same every build)."""
    if kind == "stack":
        return stack()
    torch.manual_seed({"affine": 1, "ctr": 2, "cnn": 3, "resnet50": 4}[kind])
    return MODELS[kind]().eval()


def example_body(kind: str) -> str:
    """The base64 example request body that every saved form of ``kind`` carries."""
    return base64.b64encode(encode_body(example_inputs(kind))).decode()


def export_args(kind: str) -> tuple[tuple, dict, object]:
    """(args, kwargs, dynamic_shapes) to export ``kind``: its example, dim 0 of every input dynamic."""
    example = example_inputs(kind)
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    if isinstance(example, dict):
        kwargs = {k: torch.from_numpy(v) for k, v in example.items()}
        return (), kwargs, {k: {0: batch} for k in kwargs}
    assert isinstance(example, np.ndarray)
    return (torch.from_numpy(example),), {}, ({0: batch},)


def save_export(kind: str, path: str) -> str:
    """Save ``kind`` as a torch.export program (dynamic batch) with its example body; return the path."""
    args, kwargs, dynamic = export_args(kind)
    program = torch.export.export(make_model(kind), args, kwargs, dynamic_shapes=dynamic)
    torch.export.save(program, path, extra_files={EXTRA: example_body(kind)})
    return path


def save_ctr_extras(out: str) -> list[str]:
    """What the README's walkthrough uses besides ctr.pt: a second version to hot-swap to
    (``ctr-v2.pt``: the same model, retrained weights) and one request's inputs (``features.npz``)."""
    model = make_model("ctr")
    torch.manual_seed(20)
    with torch.no_grad():
        for param in model.top.parameters():
            param.add_(0.01 * torch.randn_like(param))
    v2 = os.path.join(out, "ctr-v2.pt")
    torch.jit.save(torch.jit.script(model), v2, _extra_files={EXTRA: example_body("ctr")})
    features = os.path.join(out, "features.npz")
    np.savez(features, **example_inputs("ctr", rows=1, seed=7))  # type: ignore[arg-type]
    return [v2, features]


def build(kind: str, out: str) -> list[str]:
    path = os.path.join(out, f"{kind}.pt")
    torch.jit.save(
        torch.jit.script(make_model(kind)), path, _extra_files={EXTRA: example_body(kind)}
    )
    written = [path]
    if kind in ("affine", "stack"):
        written.append(save_export(kind, os.path.join(out, f"{kind}.pt2")))
    if kind == "stack":  # the example `inferfleet split --example` takes
        written.append(os.path.join(out, "stack.npy"))
        np.save(written[-1], example_inputs(kind, rows=4))
    if kind == "ctr":
        written.extend(save_ctr_extras(out))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models", help="output folder (default: models)")
    parser.add_argument(
        "--only",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated subset of {', '.join(MODELS)} (default: {', '.join(DEFAULT_MODELS)})",
    )
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for kind in args.only.split(","):
        if kind not in MODELS:
            parser.error(f"unknown model {kind!r}: use {', '.join(MODELS)}")
        for path in build(kind, args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
