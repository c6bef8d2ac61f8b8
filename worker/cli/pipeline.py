"""``inferfleet split``: cut a model by layers into stages that workers serve as a pipeline.

Each stage then runs as ``inferfleet worker --pipeline DIR --stage K`` (or
``inferfleet supervise ... --stage K``); see docs/operations.md, "Pipelines".
"""

from __future__ import annotations

import logging
from typing import Any

import click

from inferfleet.worker.cli.process import setup_logging
from inferfleet.worker.npfiles import load_inputs

__all__ = ["split"]


def _names(_ctx: click.Context, _param: click.Parameter, value: str) -> list[str]:
    names = [n.strip() for n in value.split(",")]
    if not all(names):
        raise click.BadParameter(
            f"{value!r}: give submodule names separated by commas, e.g. layers.2,layers.4"
        )
    return names


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes / 1e3:.1f} kB"


def _signature(sig: dict) -> str:
    return ", ".join(f"{t['dtype']}[{','.join(map(str, t['shape']))}]" for t in sig["tensors"])


def _report(manifest: Any, out: str) -> None:
    click.echo(
        f"split {manifest.model} into {len(manifest.stages)} stages in {out} (version "
        f"{manifest.version}); the chained stages reproduce the model on the example"
    )
    click.echo(
        f"{'stage':>5}  {'starts at':<20} {'parameters':>12} {'bytes':>10}  inputs -> outputs"
    )
    for s in manifest.stages:
        click.echo(
            f"{s.stage:>5}  {s.starts_at or '(inputs)':<20} {s.parameters:>12,} "
            f"{_size(s.bytes):>10}  {_signature(s.inputs)} -> {_signature(s.outputs)}"
        )
    total = sum(s.bytes for s in manifest.stages)
    click.echo(
        f"total {sum(s.parameters for s in manifest.stages):,} parameters, {_size(total)}; the "
        f"largest stage holds {max(s.bytes for s in manifest.stages) / max(total, 1):.0%} of the "
        "bytes"
    )


@click.command()
@click.option(
    "--model",
    required=True,
    envvar="INFERFLEET_SPLIT_MODEL",
    show_envvar=True,
    help="package.module:callable returning an nn.Module (from PYTHONPATH), or a .pt2 "
    "torch.export file.",
)
@click.option(
    "--example",
    required=True,
    type=click.Path(dir_okay=False),
    envvar="INFERFLEET_SPLIT_EXAMPLE",
    show_envvar=True,
    help="Example inputs (.npy, or .npz for several): traced, and checked against the stages.",
)
@click.option(
    "--split-at",
    "split_at",
    required=True,
    callback=_names,
    envvar="INFERFLEET_SPLIT_AT",
    show_envvar=True,
    help="Submodule names (as in named_modules()), comma-separated; each starts a new stage.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    envvar="INFERFLEET_SPLIT_OUT",
    show_envvar=True,
    help="Directory to write the split to.",
)
@click.option(
    "--log-level",
    default="warning",
    show_default=True,
    envvar="INFERFLEET_LOG_LEVEL",
    show_envvar=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Logging level.",
)
def split(model: str, example: str, split_at: list[str], out: str, log_level: str) -> None:
    """Split a model by layers into pipeline stages, one torch.export program each, plus a manifest.

    N names give N+1 stages. The stages are checked on the example to reproduce the model's
    outputs before anything is written; each stage's parameters and bytes are printed.
    """
    setup_logging(log_level, "text")
    logging.getLogger("torch").setLevel(logging.ERROR)
    from inferfleet.worker.errors import SplitError
    from inferfleet.worker.runtime.split import split_model  # torch only for this command

    try:
        inputs = load_inputs(example)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--example") from exc
    try:
        manifest = split_model(model, inputs, split_at, out)
    except SplitError as exc:
        raise click.ClickException(str(exc)) from exc
    _report(manifest, out)
