"""``inferfleet swap`` and ``inferfleet alerts``: the model lifecycle commands."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import click

from inferfleet.worker.cli.options import QueueConfig, pass_queue_config

__all__ = [
    "VERSION_RE",
    "CandidateInputs",
    "alerts",
    "candidate_input_options",
    "check_model",
    "fleet_spec",
    "check_wait_and_version",
    "serving_pair",
    "swap",
    "wait_for",
]

VERSION_RE = re.compile(r"[A-Za-z0-9._:+-]{1,64}\Z")


def check_wait_and_version(wait_s: float, version: str | None) -> None:
    """--wait-s is 0 or more, and --version (if given) a version name (a usage error if not)."""
    if wait_s < 0:
        raise click.BadParameter("must be 0 or more", param_hint="--wait-s")
    if version is not None and not VERSION_RE.match(version):
        raise click.BadParameter(
            f"{version!r}: use 1 to 64 of A-Z a-z 0-9 . _ : + -", param_hint="--version"
        )


@dataclass(frozen=True)
class CandidateInputs:
    """What a candidate is checked with besides its own example: ``--input-spec``,
    ``--warmup-input``, and the signature the fleet's workers declare in their heartbeats."""

    input_spec: str | None = None
    warmup_input: str | None = None
    fleet_spec: str | None = None

    def declared(self) -> Hashable | None:
        """The fleet's input spec: the one given, else the one its workers declared."""
        from inferfleet.worker.runtime.signature import SpecError, parse_spec

        if self.input_spec:
            try:
                return parse_spec(self.input_spec)
            except SpecError as exc:
                raise click.BadParameter(str(exc), param_hint="--input-spec") from exc
        try:
            return parse_spec(self.fleet_spec) if self.fleet_spec else None
        except SpecError:
            return None  # a form no spec can be written in (raw inputs): nothing to make

    def example(self) -> Any | None:
        """The inputs of ``--warmup-input``, if given."""
        from inferfleet.worker.npfiles import load_inputs

        if not self.warmup_input:
            return None
        try:
            return load_inputs(self.warmup_input)
        except (OSError, ValueError) as exc:
            raise click.BadParameter(str(exc), param_hint="--warmup-input") from exc


def candidate_input_options(command_name: str) -> Callable[[Callable], Callable]:
    """``--input-spec`` and ``--warmup-input`` of ``swap`` and ``shadow`` (``command_name``: its
    environment variables' part, INFERFLEET_SWAP_INPUT_SPEC ...)."""

    def decorate(command: Callable) -> Callable:
        command = click.option(
            "--warmup-input",
            default=None,
            envvar=f"INFERFLEET_{command_name}_WARMUP_INPUT",
            show_envvar=True,
            help="A .npy/.npz of the fleet's inputs to check the model with (default: the "
            "fleet's declared spec, zeros).",
        )(command)
        return click.option(
            "--input-spec",
            default=None,
            envvar=f"INFERFLEET_{command_name}_INPUT_SPEC",
            show_envvar=True,
            help="The fleet's input spec, e.g. 'float32[N,16]' (default: what its workers "
            "declare: their --input-spec, or their model's signature or example).",
        )(command)

    return decorate


def fleet_spec(client: Any, keys: Any) -> str | None:
    """The input spec the queue's live workers declare (their heartbeats), if one does."""
    from inferfleet.worker.heartbeat import heartbeat_key, read_heartbeats

    for info in read_heartbeats(client, keys):
        raw = client.hget(heartbeat_key(keys, info.consumer), "input_spec")
        if raw:
            return raw.decode(errors="replace")
    return None


def check_model(
    model: str,
    version: str | None,
    check: bool,
    fleet_model: str = "",
    inputs: CandidateInputs | None = None,
) -> str:
    """Validate the model here before the fleet sees it; return its version.

    With ``check``: it must load, take the inputs of the version the fleet
    serves now (``fleet_model``, when this machine can load it) and compute
    outputs of the same form from them: its example and the fleet's are run
    through it (:func:`_check_candidate`).
    """
    from inferfleet.worker.runtime.readers import file_version, is_handler_spec

    if os.path.isdir(model):
        return _check_pipeline(model, version)
    is_spec = is_handler_spec(model)
    if not is_spec and not os.path.isfile(model):
        if check or version is None:
            raise click.BadParameter(
                f"model file {model!r} does not exist here (pass --no-check "
                "and --version if only the workers can see it)",
                param_hint="--model",
            )
        return version
    if check:
        handler, example, default_version = _load_checked(model, "the model does not load")
        fleet = _load_fleet_model(fleet_model)
        _check_candidate(handler, example, fleet, inputs or CandidateInputs())
        return version or default_version
    return version or ("1" if is_spec else file_version(model))


def _check_pipeline(directory: str, version: str | None) -> str:
    """A split's directory: every stage file checked against the manifest; its version is the
    split's."""
    from inferfleet.worker.errors import ModelLoadError
    from inferfleet.worker.runtime.pipeline import read_manifest, stage_program

    try:
        manifest = read_manifest(directory)
        for stage in range(manifest.last + 1):
            stage_program(directory, stage)
    except ModelLoadError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from exc
    if version not in (None, manifest.version):
        raise click.BadParameter(
            f"a split's version is its digest {manifest.version}: leave --version out",
            param_hint="--version",
        )
    return manifest.version


def _load_checked(model: str, failure: str) -> tuple[Any, Any, str]:
    import torch

    from inferfleet.worker.errors import ModelLoadError
    from inferfleet.worker.runtime.readers import load_model

    try:
        return load_model(model, torch.device("cpu"))
    except ModelLoadError as exc:
        raise click.BadParameter(f"{failure}: {exc}", param_hint="--model") from exc


def _load_fleet_model(fleet_model: str) -> tuple[Any, Any] | None:
    """The (handler, example) of the version the fleet serves, if this machine can load it."""
    from inferfleet.worker.errors import ModelLoadError
    from inferfleet.worker.runtime.readers import is_handler_spec, load_model

    if not fleet_model or not (is_handler_spec(fleet_model) or os.path.isfile(fleet_model)):
        return None
    try:
        import torch

        handler, example, _ = load_model(fleet_model, torch.device("cpu"))
    except ModelLoadError:
        return None
    return handler, example


def _run_example(handler: Any, inputs: Any, what: str) -> Any:
    import torch

    from inferfleet.worker.runtime.loading import ModelRuntime

    try:
        return ModelRuntime(handler, "check", "check", torch.device("cpu"), inputs).predict(
            inputs, {}
        )
    except Exception as exc:
        raise click.BadParameter(
            f"{what} fails: {type(exc).__name__}: {exc}", param_hint="--model"
        ) from exc


def _check_candidate(
    handler: Any, example: Any, fleet: tuple[Any, Any] | None, given: CandidateInputs
) -> None:
    """Run the candidate on the fleet's inputs (given, the served version's example, or made
    from the fleet's declared spec) or its own; refuse another signature or bad outputs."""
    from inferfleet.worker.runtime.signature import describe_spec, spec_fits, spec_of

    inputs, fleet_form = _fleet_inputs(given, fleet)
    if inputs is None and example is None:
        raise click.BadParameter(
            "the model has no example inputs to check it with: give the fleet's --input-spec "
            "or --warmup-input (workers started with one declare it), embed an example, or "
            "pass --no-check",
            param_hint="--model",
        )
    own = spec_of(example) if example is not None else None
    if own is not None and fleet_form is not None and not spec_fits(own, fleet_form):
        raise click.BadParameter(
            f"its signature {describe_spec(own)} is not the one "
            f"the fleet serves, {describe_spec(fleet_form)}",
            param_hint="--model",
        )
    inputs = inputs if inputs is not None else example
    what = f"running the fleet's inputs {describe_spec(spec_of(inputs))} through it"
    outputs = _run_example(handler, inputs, what)
    _check_outputs(outputs, inputs)
    if fleet is not None:
        served = _run_example(fleet[0], inputs, "running the example through the served version")
        if spec_of(outputs) != spec_of(served):
            raise click.BadParameter(
                f"its outputs {describe_spec(spec_of(outputs))} are not of "
                "the form the served version gives, "
                f"{describe_spec(spec_of(served))}",
                param_hint="--model",
            )


def _fleet_inputs(
    given: CandidateInputs, fleet: tuple[Any, Any] | None
) -> tuple[Any | None, Hashable | None]:
    """(inputs of the fleet's form to run a candidate on, that form): ``--warmup-input``, else
    the served version's example, else zeros of the declared spec; each None where unknown."""
    from inferfleet.worker.runtime.signature import spec_of, synthesize

    declared = given.declared()
    inputs = given.example()
    if inputs is None and fleet is not None:
        inputs = fleet[1]
    if inputs is None and declared is not None:
        inputs = synthesize(declared, rows=2)  # zeros are valid wherever any value is
    if declared is None and inputs is not None:
        declared = spec_of(inputs)
    return inputs, declared


def _check_outputs(outputs: Any, inputs: Any) -> None:
    import numpy as np

    from inferfleet.producer.protocol import row_count

    arrays = (
        list(outputs.values())
        if isinstance(outputs, dict)
        else ([outputs] if isinstance(outputs, np.ndarray) else list(outputs))
    )
    rows = row_count(inputs)
    for array in arrays:
        if not isinstance(array, np.ndarray) or array.ndim == 0 or array.shape[0] != rows:
            raise click.BadParameter(
                f"on the {rows}-row example it returned "
                f"{getattr(array, 'shape', array)!r}, not {rows} rows",
                param_hint="--model",
            )
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise click.BadParameter("on the example it returned NaN or Inf", param_hint="--model")


def serving_pair(client: Any, keys: Any) -> tuple[str, str]:
    """The (model, version) the live workers run, for a first publish's rollback target."""
    from inferfleet.worker.heartbeat import heartbeat_key, read_heartbeats

    for info in read_heartbeats(client, keys):
        raw = client.hget(heartbeat_key(keys, info.consumer), "model")
        if raw:
            return raw.decode(errors="replace"), info.version
    return "", ""


def wait_for(client: Any, shards: list, version: str, timeout_s: float) -> bool:
    """Until every live worker serves ``version`` or reports a failed load; print each."""
    from inferfleet.worker.heartbeat import read_heartbeats

    deadline = time.monotonic() + timeout_s
    while True:
        workers = [w for keys in shards for w in read_heartbeats(client, keys)]
        failed = [w for w in workers if w.swap_error and version in w.swap_error]
        pending = [w for w in workers if w.version != version and w not in failed]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for w in workers:
        state = (
            "ok"
            if w.version == version
            else ("FAILED: " + w.swap_error if w in failed else "still " + w.version)
        )
        click.echo(f"  {w.consumer}: {state}")
    if not workers:
        click.echo("  no live workers (new ones load this version at start)")
    return not failed and not pending


@click.command()
@pass_queue_config
@click.option(
    "--model",
    default=None,
    envvar="INFERFLEET_SWAP_MODEL",
    show_envvar=True,
    help="The new model: a file every worker can read, module:Handler, or a "
    "split's directory (every stage of a pipeline swaps to it).",
)
@click.option(
    "--version",
    "version",
    default=None,
    envvar="INFERFLEET_SWAP_VERSION",
    show_envvar=True,
    help="Its version (default: the file's hash).",
)
@click.option(
    "--rollback",
    is_flag=True,
    help="Return to the last version the fleet served before the current one (never one "
    "that failed).",
)
@click.option(
    "--check/--no-check",
    default=True,
    show_default=True,
    envvar="INFERFLEET_SWAP_CHECK",
    show_envvar=True,
    help="Load the model here first and run its example (and the served version's) "
    "through it: a broken file, another signature or bad outputs never reach the "
    "fleet.",
)
@click.option(
    "--wait-s",
    type=float,
    default=60.0,
    show_default=True,
    envvar="INFERFLEET_SWAP_WAIT_S",
    show_envvar=True,
    help="Wait this long for every live worker to switch (0: do not wait).",
)
@candidate_input_options("SWAP")
def swap(
    queue: QueueConfig,
    model: str | None,
    version: str | None,
    rollback: bool,
    check: bool,
    wait_s: float,
    input_spec: str | None,
    warmup_input: str | None,
) -> None:
    """Publish a new model version to a queue's workers (hot swap), or roll back.

    Workers load and warm the new version in the background and switch between
    batches; in-flight batches finish on the old copy. Exit status 1 if a live
    worker failed to load it or did not switch within --wait-s.
    """
    import redis

    from inferfleet.worker.cli.status import with_stages
    from inferfleet.worker.serving.lifecycle import NoPreviousVersion, publish
    from inferfleet.worker.serving.lifecycle import rollback as do_rollback

    if rollback == (model is not None):
        raise click.UsageError("give either --model (to publish a version) or --rollback")
    check_wait_and_version(wait_s, version)
    client, shard_list = queue.connect()
    try:
        if model is not None:
            served = serving_pair(client, shard_list[0])[0]
            inputs = CandidateInputs(input_spec, warmup_input, fleet_spec(client, shard_list[0]))
            version = check_model(model, version, check, served, inputs)
        # one shard after another: each shard's switch is atomic, not all of them
        for keys in shard_list:
            if rollback:
                published = do_rollback(client, keys)
            else:
                assert model is not None and version is not None
                published = publish(client, keys, model, version, serving_pair(client, keys))
            click.echo(
                f"{keys.name}: version {published.version} ({published.model}) published as "
                f"#{published.seq}; previous {published.previous_version or 'none'}"
            )
        # a pipeline's stages too
        every_stage = [k for keys in shard_list for k in with_stages(client, keys)]
        if wait_s and not wait_for(client, every_stage, published.version, wait_s):
            sys.exit(1)
    except NoPreviousVersion as exc:
        raise click.ClickException(str(exc)) from exc
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc


@click.command()
@pass_queue_config
@click.option(
    "--count",
    type=int,
    default=20,
    show_default=True,
    envvar="INFERFLEET_ALERTS_COUNT",
    show_envvar=True,
    help="Most alerts to show.",
)
@click.option(
    "--kind",
    default=None,
    envvar="INFERFLEET_ALERTS_KIND",
    show_envvar=True,
    type=click.Choice(
        [
            "low_confidence",
            "non_finite",
            "inconsistent",
            "swap_failed",
            "shadow_failed",
            "shadow_divergence",
            "canary_rollback",
            "many",
        ]
    ),
    help="Only alerts of this kind.",
)
@click.option("--follow", is_flag=True, help="Keep printing new alerts until interrupted.")
def alerts(queue: QueueConfig, count: int, kind: str | None, follow: bool) -> None:
    """Show a queue's alerts: low confidence, NaN/Inf outputs, inconsistent results, failed swaps,
    candidates that failed to load, diverged or were rolled back."""
    import redis

    from inferfleet.worker.serving.alerts import Alert, alerts_key, read_alerts

    if count < 1:
        raise click.BadParameter("must be at least 1", param_hint="--count")
    client, shard_list = queue.connect()

    def show(alert: Alert) -> None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(alert.time_ms / 1000))
        click.echo(
            f"{when} {alert.kind:<15} v{alert.version} {alert.consumer} "
            f"{alert.rid or '-'}: {alert.detail}"
        )

    try:
        found = [(keys, a) for keys in shard_list for a in read_alerts(client, keys, count, kind)]
        shown = sorted(found, key=lambda pair: pair[1].time_ms)[-count:]
        for _, alert in shown:
            show(alert)
        if not follow:
            if not shown:
                click.echo(f"no alerts in {', '.join(alerts_key(k) for k in shard_list)}")
            return
        last = {}
        # from each stream's newest entry ("$" would skip any between two reads)
        for keys in shard_list:
            newest = client.xrevrange(alerts_key(keys), count=1)
            last[alerts_key(keys)] = newest[0][0] if newest else "0-0"
        while True:  # one XREAD per shard: a cluster cannot read keys of several slots at once
            for stream in last:
                for _, entries in (
                    client.xread({stream: last[stream]}, block=1000 // len(last)) or []
                ):
                    for entry_id, raw in entries:
                        last[stream] = entry_id
                        alert = Alert.from_entry(entry_id, raw)
                        if kind is None or alert.kind == kind:
                            show(alert)
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc
    except KeyboardInterrupt:
        pass
