"""``inferfleet status`` and ``inferfleet dead``: what a queue looks like, and its dead letters.

The ``dead`` group lists, shows, replays and purges the requests a queue gave up on,
shard by shard for a sharded queue.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import click

from inferfleet.producer import errors
from inferfleet.worker.cli.options import QueueConfig, pass_queue_config, queue_options
from inferfleet.worker.config import ENV_VARS

__all__ = ["dead", "status"]


@click.command()
@queue_options(
    name=click.option(
        "--name",
        default="",
        envvar=ENV_VARS["name"],
        show_envvar=True,
        help="One queue (default: every queue under the prefix).",
    )
)
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option(
    "--interval-s",
    type=float,
    default=1.0,
    show_default=True,
    envvar="INFERFLEET_STATUS_INTERVAL_S",
    show_envvar=True,
    help="Refresh period with --watch.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    envvar="INFERFLEET_STATUS_JSON",
    show_envvar=True,
    help="Print one JSON document (for scripts) instead of tables.",
)
def status(queue: QueueConfig, watch: bool, interval_s: float, as_json: bool) -> None:
    """Show each queue: length, lag, pending, dead letters, consumers, workers and candidate.

    A sharded queue shows each shard (NAME.0, NAME.1 ...) as a queue of its own, a pipelined
    model each stage (NAME stage 1, ...) with its stream's lag, its workers and their rates; a
    candidate version (inferfleet shadow) shows with how many workers have it loaded. Piped,
    the tables keep every column (not cut to 80 characters); --json prints the same as JSON.
    """
    import redis

    from inferfleet.producer.protocol import QueueKeys, shard_keys
    from inferfleet.worker.cli.status import find_queues, gather, render, server_line, with_stages
    from inferfleet.worker.connections import admin_client

    try:
        keys_list = list(shard_keys(queue.name, queue.shards, queue.prefix)) if queue.name else None
        client = admin_client(queue.redis_url, queue.cluster)
    except (errors.ProtocolError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from exc
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc

    def queues() -> list[QueueKeys]:
        return keys_list or [QueueKeys(q, queue.prefix) for q in find_queues(client, queue.prefix)]

    def snapshot() -> Any:
        from rich.console import Group

        found = queues()
        if not found:
            return f"no queues under prefix {queue.prefix!r}"
        return Group(*(render(gather(client, k)) for q in found for k in with_stages(client, q)))

    console = _console()
    try:
        server = server_line(client)
        if as_json:
            states = [asdict(gather(client, k)) for k in queues()]
            click.echo(json.dumps({"server": server, "queues": states}, default=str))
        elif not watch:
            console.print(f"server: {server}", soft_wrap=True)
            console.print(snapshot())
        else:
            _watch(console, snapshot, interval_s)
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc
    except KeyboardInterrupt:
        pass


def _watch(console: Any, snapshot: Callable[[], Any], interval_s: float) -> None:
    """Redraw ``snapshot()`` every ``interval_s`` in place until interrupted."""
    import time

    from rich.live import Live

    with Live(snapshot(), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval_s)
            live.update(snapshot())


def _console() -> Any:
    """A rich console; piped, as wide as any table needs, so columns are never cut or folded."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=1000)


def _find_dead_in(client: Any, shards: list, ident: str) -> tuple[Any, Any]:
    """(shard keys, dead letter) of IDENT in the first shard that holds it, else a clear error."""
    from inferfleet.worker.serving.deadletter import find_dead

    for keys in shards:
        letter = find_dead(client, keys, ident)
        if letter is not None:
            return keys, letter
    raise click.ClickException(f"no dead letter {ident!r} in {', '.join(k.dead for k in shards)}")


@click.group()
def dead() -> None:
    """Inspect, replay or purge a queue's dead letters (requests given up on)."""


@dead.command("list")
@pass_queue_config
@click.option(
    "--count",
    type=int,
    default=100,
    show_default=True,
    envvar="INFERFLEET_DEAD_LIST_COUNT",
    show_envvar=True,
    help="Most entries to show.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    envvar="INFERFLEET_DEAD_LIST_JSON",
    show_envvar=True,
    help="Print one JSON document (for scripts) instead of a table.",
)
def dead_list(queue: QueueConfig, count: int, as_json: bool) -> None:
    """List dead letters, oldest first (shard by shard)."""
    from datetime import datetime, timezone

    from rich.table import Table

    from inferfleet.worker.serving.deadletter import list_dead

    client, shard_keys = queue.connect()
    if as_json:
        letters = [
            {**{k: v for k, v in vars(letter).items() if k != "fields"}, "queue": keys.name}
            for keys in shard_keys
            for letter in list_dead(client, keys, count)
        ]
        click.echo(json.dumps({"queue": queue.name, "dead": letters}))
        return
    table = Table(title=f"dead letters of {queue.name}", title_justify="left")
    for column in ("dead id", "request id", "when (UTC)", "deliveries", "reason") + ("queue",) * (
        queue.shards > 1
    ):
        table.add_column(column)
    for keys in shard_keys:
        for letter in list_dead(client, keys, count):
            when = datetime.fromtimestamp(letter.dead_ms / 1000, timezone.utc).strftime(
                "%Y-%m-%d %H:%M:%S"
            )
            table.add_row(
                letter.dead_id,
                letter.request_id,
                when,
                str(letter.deliveries),
                letter.reason,
                *[keys.name] * (queue.shards > 1),
            )
    _console().print(
        table if table.row_count else f"no dead letters in {', '.join(k.dead for k in shard_keys)}"
    )


@dead.command("show")
@pass_queue_config
@click.argument("ident")
def dead_show(queue: QueueConfig, ident: str) -> None:
    """Show one dead letter (IDENT: its dead id or its request id) as JSON."""
    client, shard_keys = queue.connect()
    _, letter = _find_dead_in(client, shard_keys, ident)
    shown = {k: v for k, v in vars(letter).items() if k != "fields"}
    shown["fields"] = sorted(k.decode(errors="replace") for k in letter.fields)
    click.echo(json.dumps(shown, indent=2))


@dead.command("replay")
@pass_queue_config
@click.argument("ident", required=False)
@click.option("--all", "replay_all", is_flag=True, help="Replay every dead letter.")
def dead_replay(queue: QueueConfig, ident: str | None, replay_all: bool) -> None:
    """Put a dead letter (or --all) back on the request stream it came from, same request id."""
    from inferfleet.worker.serving.deadletter import list_dead, replay_dead

    if bool(ident) == replay_all:
        raise click.UsageError("give a dead id or request id, or --all")
    client, shard_keys = queue.connect()
    found = (
        [(keys, letter) for keys in shard_keys for letter in list_dead(client, keys, 1_000_000)]
        if replay_all
        else [_find_dead_in(client, shard_keys, ident or "")]
    )
    for keys, letter in found:
        new_id = replay_dead(client, keys, letter)
        click.echo(f"replayed {letter.request_id} as entry {new_id.decode()}")


@dead.command("purge")
@pass_queue_config
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def dead_purge(queue: QueueConfig, yes: bool) -> None:
    """Delete every dead letter of the queue (of every shard)."""
    from inferfleet.worker.serving.deadletter import purge_dead

    client, shard_keys = queue.connect()
    streams = ", ".join(k.dead for k in shard_keys)
    if not yes:
        click.confirm(f"delete every dead letter in {streams}?", abort=True)
    click.echo(f"purged {sum(purge_dead(client, keys) for keys in shard_keys)} dead letters")
