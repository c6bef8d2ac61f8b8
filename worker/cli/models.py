"""``inferfleet save-model``: one file with a model, its example and its input spec
(``save_model``)."""

from __future__ import annotations

import os

import click

__all__ = ["save_model_command"]


def _module_of(source: str) -> object:
    """An ``nn.Module`` from ``module:attr`` (a module, a class or a factory) or a TorchScript
    file."""
    import torch

    from inferfleet.worker.errors import ModelLoadError
    from inferfleet.worker.runtime.formats import detect_kind
    from inferfleet.worker.runtime.readers import import_target, is_handler_spec

    if is_handler_spec(source):
        try:
            target = import_target(source)
        except ModelLoadError as exc:
            raise click.BadParameter(str(exc), param_hint="SOURCE") from exc
        return (
            target if isinstance(target, torch.nn.Module) else target()
        )  # a class or a factory: call it
    if not os.path.isfile(source):
        raise click.BadParameter(
            f"{source!r} is neither a file nor module:attr", param_hint="SOURCE"
        )
    if detect_kind(source) != "torchscript":
        raise click.BadParameter(
            f"{source!r} is not a TorchScript file: give module:attr to export an nn.Module",
            param_hint="SOURCE",
        )
    return torch.jit.load(source)


@click.command(
    "save-model",
    epilog="""\b
Examples:
  inferfleet save-model tests.fixtures.build_models:CTR --example models/features.npz \\
      --out ctr-packed.pt2""",
)
@click.argument("source")
@click.option(
    "--example",
    "example_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    envvar="INFERFLEET_SAVE_MODEL_EXAMPLE",
    show_envvar=True,
    help="One request's inputs: .npy (one tensor) or .npz (arr_0.. positional, other names "
    "keyword).",
)
@click.option(
    "--out",
    required=True,
    envvar="INFERFLEET_SAVE_MODEL_OUT",
    show_envvar=True,
    help="The file to write (.pt2 for an nn.Module, TorchScript for a .pt).",
)
@click.option(
    "--input-spec",
    "input_spec",
    default=None,
    envvar="INFERFLEET_SAVE_MODEL_INPUT_SPEC",
    show_envvar=True,
    help="Which dimensions vary, e.g. 'int64[N,L]' (default: only the batch, N).",
)
def save_model_command(source: str, example_path: str, out: str, input_spec: str | None) -> None:
    """Save SOURCE (module:attr giving an nn.Module, or a TorchScript file) with its example and
    input spec.

    A worker started on the result checks every request against the spec and warms up on the
    example, with no other option. The Python equivalent is inferfleet.worker.save_model.
    """
    from inferfleet.worker.npfiles import load_inputs
    from inferfleet.worker.runtime.saving import save_model
    from inferfleet.worker.runtime.signature import SpecError

    try:
        example = load_inputs(example_path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--example") from exc
    try:
        written = save_model(_module_of(source), example, out, dynamic=input_spec)
    except SpecError as exc:
        raise click.BadParameter(str(exc), param_hint="--input-spec") from exc
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"wrote {out}: inputs {written}; serve it with: inferfleet worker --name NAME --model {out}"
    )
