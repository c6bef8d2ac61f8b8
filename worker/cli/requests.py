"""``inferfleet enqueue`` and ``inferfleet result``: send one request, wait for its reply.

A reply that is an error exits with status 1 (after printing it); bad input exits with status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import numpy as np

from inferfleet.producer import Producer, errors
from inferfleet.producer.protocol import Reply
from inferfleet.producer.sharing import PRIORITIES
from inferfleet.producer.streaming import ChunkStream
from inferfleet.worker.cli.options import QueueConfig, pass_queue_config
from inferfleet.worker.npfiles import load_inputs, save_outputs

__all__ = ["enqueue", "producer_for", "result"]


def _parse_params(pairs: tuple[str, ...]) -> dict:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--param")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


def _describe(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        text = {"dtype": str(value.dtype), "shape": list(value.shape)}
        if value.size <= 32:
            text["values"] = value.tolist()
        return text
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return {"bytes": len(value)}
    if isinstance(value, str):
        return value  # raw text outputs (protocol 1.2)
    return [_describe(v) for v in value]


def _show_reply(reply: Reply, output: str | None, pretty: bool = True) -> None:
    summary: dict[str, Any] = {
        "id": reply.id,
        "ok": reply.ok,
        "model": {"name": reply.model_name, "version": reply.model_version},
        "timing": reply.timing,
    }
    if reply.ok:
        summary["outputs"] = _describe(reply.outputs)
        if output:
            save_outputs(output, reply.outputs)
    else:
        summary["error"] = {"code": reply.error_code, "message": reply.error_message}
    click.echo(json.dumps(summary, indent=2 if pretty else None))
    if not reply.ok:
        sys.exit(1)


def producer_for(queue: QueueConfig, tenant: str | None = None) -> Producer:
    """A Producer on the queue the options name (bad options exit with status 2)."""
    try:
        return Producer(
            queue.redis_url,
            queue.name,
            prefix=queue.prefix,
            shards=queue.shards,
            cluster=queue.cluster,
            tenant=tenant,
        )
    except errors.ProtocolError as exc:
        raise click.BadParameter(str(exc)) from exc
    except errors.InferfleetError as exc:  # a cluster client connects at once
        raise click.ClickException(str(exc)) from exc


@click.command(
    epilog="""\b
Examples:
  inferfleet enqueue --name ctr --input models/features.npz --wait
  inferfleet enqueue --name ctr --input models/features.npz      # prints the id for 'result'
  inferfleet enqueue --name tokens --text "docker compose" --stream --as-text"""
)
@pass_queue_config
@click.option(
    "--input",
    "input_path",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help=".npy (one tensor) or .npz (arr_0.. positional, other names keyword) inputs.",
)
@click.option(
    "--text",
    default=None,
    help="Send this text as the raw input instead of --input (a model that takes text).",
)
@click.option(
    "--param", "params", multiple=True, help="KEY=VALUE (VALUE parsed as JSON if it can be)."
)
@click.option(
    "--deadline-s",
    type=float,
    default=None,
    envvar="INFERFLEET_DEADLINE_S",
    show_envvar=True,
    help="Answer 'expired' if not picked up in time.",
)
@click.option("--request-id", default=None, help="Choose the request id (default: a fresh one).")
@click.option(
    "--priority",
    type=click.Choice(PRIORITIES),
    default="normal",
    show_default=True,
    envvar="INFERFLEET_PRIORITY",
    show_envvar=True,
    help="The lane: high, normal or low.",
)
@click.option(
    "--tenant",
    default=None,
    envvar="INFERFLEET_TENANT",
    show_envvar=True,
    help="The caller's name, which fleet-wide quotas apply to.",
)
@click.option(
    "--wait/--no-wait",
    default=False,
    envvar="INFERFLEET_ENQUEUE_WAIT",
    show_envvar=True,
    help="Wait for the reply and print it as one line of JSON.",
)
@click.option(
    "--timeout-s",
    type=float,
    default=30.0,
    show_default=True,
    envvar="INFERFLEET_RESULT_TIMEOUT_S",
    show_envvar=True,
    help="With --wait: longest wait.",
)
@click.option(
    "--output",
    default=None,
    envvar="INFERFLEET_OUTPUT",
    show_envvar=True,
    help="With --wait: save outputs to this .npy/.npz file.",
)
@click.option(
    "--stream",
    is_flag=True,
    envvar="INFERFLEET_ENQUEUE_STREAM",
    show_envvar=True,
    help="Ask for a streamed reply (a step-wise model) and print each chunk as it arrives, "
    "one JSON line each.",
)
@click.option(
    "--as-text",
    is_flag=True,
    envvar="INFERFLEET_ENQUEUE_AS_TEXT",
    show_envvar=True,
    help="With --stream: print a byte-level model's tokens as text as they arrive.",
)
def enqueue(
    queue: QueueConfig,
    input_path: str | None,
    text: str | None,
    params: tuple[str, ...],
    deadline_s: float | None,
    request_id: str | None,
    priority: str,
    tenant: str | None,
    wait: bool,
    timeout_s: float,
    output: str | None,
    stream: bool,
    as_text: bool,
) -> None:
    """Enqueue one request from a .npy/.npz file or a text; print its request id (or, with
    --wait, the reply; with --stream, its chunks as they arrive)."""
    inputs = _inputs_of(input_path, text)
    if as_text and not stream:
        raise click.UsageError("--as-text goes with --stream")
    with producer_for(queue, tenant) as producer:
        try:
            if stream:
                chunks = producer.stream(
                    inputs,
                    _parse_params(params),
                    deadline_s,
                    request_id=request_id,
                    priority=priority,
                    timeout_s=timeout_s,
                )
                _show_chunks(chunks, as_text)
                return
            rid = producer.submit(
                inputs, _parse_params(params), deadline_s, request_id=request_id, priority=priority
            )
            if not wait:
                click.echo(rid)
                return
            _show_reply(producer.result(rid, timeout_s, raise_errors=False), output, pretty=False)
        except errors.ProtocolError as exc:
            raise click.BadParameter(str(exc)) from exc
        except errors.InferfleetError as exc:
            raise click.ClickException(str(exc)) from exc


def _inputs_of(input_path: str | None, text: str | None) -> Any:
    """The request's inputs: the file's tensors, or the text (exactly one of the two)."""
    if (input_path is None) == (text is None):
        raise click.UsageError("give one of --input FILE or --text TEXT")
    if text is not None:
        return text
    assert input_path is not None  # one of the two, checked above
    try:
        return load_inputs(input_path)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--input") from exc


def _show_chunks(chunks: ChunkStream, as_text: bool) -> None:
    """Print each chunk as it comes: a JSON line (n, attempt, tokens; the last with final and
    finish_reason), or the tokens as text; a final error chunk exits with status 1."""
    try:
        for chunk in chunks:
            tokens = [int(t) for t in chunk.tokens]
            if as_text:
                sys.stdout.write(
                    bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", "replace")
                )
                sys.stdout.flush()
                if chunk.final:
                    sys.stdout.write("\n")
                    click.echo(f"[{chunk.finish_reason}, {chunks.fold.next_n} chunks]", err=True)
                continue
            line: dict[str, Any] = {"n": chunk.n, "attempt": chunk.attempt, "tokens": tokens}
            if chunk.final:
                line.update(final=True, finish_reason=chunk.finish_reason)
            click.echo(json.dumps(line))
    except errors.ReplyError as exc:
        if as_text:
            sys.stdout.write("\n")
        click.echo(
            json.dumps(
                {"id": chunks.request_id, "error": {"code": exc.code, "message": exc.message}}
            )
        )
        sys.exit(1)


@click.command()
@pass_queue_config
@click.argument("request_id")
@click.option(
    "--timeout-s",
    type=float,
    default=30.0,
    show_default=True,
    envvar="INFERFLEET_RESULT_TIMEOUT_S",
    show_envvar=True,
    help="Longest wait for the reply.",
)
@click.option(
    "--output",
    default=None,
    envvar="INFERFLEET_OUTPUT",
    show_envvar=True,
    help="Save outputs to this .npy/.npz file.",
)
def result(queue: QueueConfig, request_id: str, timeout_s: float, output: str | None) -> None:
    """Wait for the reply to REQUEST_ID and print it (exit 1 if it failed)."""
    with producer_for(queue) as producer:
        try:
            reply = producer.result(request_id, timeout_s, raise_errors=False)
        except errors.ProtocolError as exc:
            raise click.BadParameter(str(exc), param_hint="REQUEST_ID") from exc
        except errors.InferfleetError as exc:
            raise click.ClickException(str(exc)) from exc
    _show_reply(reply, output)
