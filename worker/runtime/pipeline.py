"""A split model on disk: the manifest ``pipeline.json`` and one torch.export program per stage.

``inferfleet split`` (:mod:`inferfleet.worker.runtime.split`) writes a directory::

    DIR/pipeline.json     the manifest (below)
    DIR/stage-0.pt2       stage 0: the model's inputs -> the activations at the first split point
    DIR/stage-1.pt2       ...
    DIR/stage-N.pt2       the last stage: -> the model's outputs

Each program is self-contained (a worker needs no Python source of the
model), has a dynamic batch dimension, and carries its own example inputs
(extra file ``inferfleet_example``), so a stage loads, warms up and checks
its inputs like any ``.pt2`` model. The manifest names each stage's file,
its SHA-256, its input and output signature, its parameter count and bytes,
and ``version``: a digest of the whole split (every stage file's hash and the
split points), the version every stage reports. A worker refuses a stage
file whose hash differs from the manifest's, so stages of two splits never
serve under one version.

No torch here: reading and checking a manifest is plain JSON and hashing.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from inferfleet.worker.errors import ModelLoadError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "Manifest",
    "StageInfo",
    "is_pipeline",
    "pipeline_digest",
    "read_manifest",
    "sha256_of",
    "stage_file",
    "stage_program",
    "write_manifest",
]

#: The manifest's file name inside a split's directory.
MANIFEST = "pipeline.json"
#: The manifest format this code reads and writes.
FORMAT = "inferfleet-pipeline/1"


def stage_file(stage: int) -> str:
    """The file name of stage ``stage``'s program inside the directory."""
    return f"stage-{stage}.pt2"


def sha256_of(path: str) -> str:
    """The SHA-256 of a file, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pipeline_digest(stage_hashes: list[str], split_at: list[str]) -> str:
    """The version of a split: 12 hex digits of the hash of its stage hashes and split points."""
    text = json.dumps({"stages": stage_hashes, "split_at": split_at}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class StageInfo:
    """One stage in the manifest. A signature is ``{"form": tensor|list|map, "tensors": [...]}``,
    each tensor ``{"name", "dtype", "shape"}`` with ``"N"`` for the batch dimension."""

    stage: int
    file: str
    sha256: str
    starts_at: str  # the submodule the stage starts at ("" for stage 0)
    inputs: dict
    outputs: dict
    parameters: int
    bytes: int


@dataclass(frozen=True)
class Manifest:
    """A split model: where it came from, where it was cut, its stages and its version."""

    model: str
    split_at: list[str]
    version: str
    stages: list[StageInfo]

    @property
    def last(self) -> int:
        """The last stage's number (the one that answers)."""
        return len(self.stages) - 1

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2) + "\n"


def is_pipeline(path: str) -> bool:
    """Whether ``path`` is a directory holding a manifest."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def write_manifest(directory: str, manifest: Manifest) -> str:
    """Write ``pipeline.json`` (atomically: a reader never sees half of it); returns its path."""
    path = os.path.join(directory, MANIFEST)
    with open(path + ".tmp", "w") as fh:
        fh.write(manifest.to_json())
    os.replace(path + ".tmp", path)
    return path


def _stage(raw: Any, index: int) -> StageInfo:
    if not isinstance(raw, dict):
        raise ValueError(f"stage {index} is not an object")
    try:
        info = StageInfo(**{k: raw[k] for k in StageInfo.__dataclass_fields__})
    except KeyError as exc:
        raise ValueError(f"stage {index} lacks the field {exc.args[0]!r}") from None
    if info.stage != index or info.file != stage_file(index):
        raise ValueError(f"stage {index} is listed as stage {info.stage!r}, file {info.file!r}")
    return info


def _parse(text: str) -> Manifest:
    raw = json.loads(text)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"format is {found!r}, not {FORMAT!r}")
    stages = raw.get("stages")
    if not isinstance(stages, list) or len(stages) < 2:
        raise ValueError("a split has a list of at least 2 stages")
    split_at = raw.get("split_at")
    if not isinstance(split_at, list) or len(split_at) != len(stages) - 1:
        raise ValueError(
            f"split_at must list {len(stages) - 1} names, one per stage after the first"
        )
    version = raw.get("version")
    if not isinstance(version, str) or not version:
        raise ValueError("version is missing")
    return Manifest(
        str(raw.get("model", "")), split_at, version, [_stage(s, i) for i, s in enumerate(stages)]
    )


def read_manifest(directory: str) -> Manifest:
    """Read and check a split's manifest; ModelLoadError says what is wrong with it."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise ModelLoadError(
            f"pipeline {directory!r} is not a directory (make one with `inferfleet split`)"
        )
    try:
        with open(path) as fh:
            manifest = _parse(fh.read())
    except FileNotFoundError:
        raise ModelLoadError(
            f"pipeline {directory!r} has no {MANIFEST} (make one with `inferfleet split`)"
        ) from None
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"bad pipeline manifest {path}: {exc}") from exc
    if manifest.version != pipeline_digest([s.sha256 for s in manifest.stages], manifest.split_at):
        raise ModelLoadError(
            f"bad pipeline manifest {path}: its version {manifest.version} is not the digest "
            f"of its stages (edited by hand?)"
        )
    return manifest


def stage_program(directory: str, stage: int) -> tuple[str, Manifest]:
    """The checked path of stage ``stage``'s program and the manifest (ModelLoadError if absent or
    altered)."""
    manifest = read_manifest(directory)
    if not 0 <= stage <= manifest.last:
        raise ModelLoadError(f"pipeline {directory!r} has stages 0 to {manifest.last}, not {stage}")
    info = manifest.stages[stage]
    path = os.path.join(directory, info.file)
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"pipeline {directory!r}: stage {stage}'s program {info.file} is missing"
        )
    if sha256_of(path) != info.sha256:
        raise ModelLoadError(
            f"pipeline {directory!r}: {info.file} is not the file the manifest names "
            f"(SHA-256 differs): a stage of another split?"
        )
    return path, manifest
