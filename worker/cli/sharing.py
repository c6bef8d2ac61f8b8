"""``inferfleet limit`` and ``inferfleet cancel``: a shared fleet's limits, and taking a request
back.

Limits live in Redis (``PREFIX:{NAME}:limits``), so every producer and worker
sees the same ones; a sharded queue gets them on every shard (each shard
then admits up to ``--max-backlog`` and each tenant's rate on its own).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click
import redis

from inferfleet.producer import errors
from inferfleet.producer.protocol import QueueKeys
from inferfleet.producer.sharing import (
    LIBRARY,
    MAX_TENANTS,
    limits_key,
    tenants_key,
    validate_rate,
    validate_tenant,
)
from inferfleet.worker.cli.options import QueueConfig, pass_queue_config

__all__ = ["cancel", "limit", "read_limits"]

#: The largest --max-backlog: far above any real queue, so a typo is caught.
MAX_BACKLOG = 1_000_000_000


def read_limits(client: Any, keys: QueueKeys) -> dict[str, Any]:
    """The limits in force on one queue (or shard) and its per-tenant counts, as plain values."""
    raw = {k.decode(): v.decode() for k, v in client.hgetall(limits_key(keys)).items()}
    tenants: dict[str, dict[str, Any]] = {}
    for name, value in raw.items():
        kind, _, tenant = name.partition(":")
        if kind in ("rate", "burst"):
            tenants.setdefault(tenant, {})[kind] = float(value)
    counts: dict[str, dict[str, int]] = {}
    for name, value in client.hgetall(tenants_key(keys)).items():
        kind, _, tenant = name.decode().partition(":")
        counts.setdefault(tenant, {"accepted": 0, "refused": 0})[kind] = int(value)
    backlog = raw.get("max_backlog")
    return {
        "queue": keys.name,
        "max_backlog": int(backlog) if backlog else None,
        "tenants": tenants,
        "counts": counts,
    }


def _check_limit_options(
    max_backlog: int | None, tenant: str | None, rate: float | None, burst: float | None
) -> None:
    if max_backlog is not None and not 1 <= max_backlog <= MAX_BACKLOG:
        raise click.BadParameter(
            f"must be from 1 to {MAX_BACKLOG}, got {max_backlog}", param_hint="--max-backlog"
        )
    if (rate is not None or burst is not None) and tenant is None:
        raise click.BadParameter("--rate and --burst need --tenant", param_hint="--tenant")
    try:
        if tenant is not None:
            validate_tenant(tenant)
        if rate is not None:
            validate_rate(rate, burst)
        elif burst is not None:
            raise click.BadParameter("--burst needs --rate", param_hint="--rate")
    except errors.ProtocolError as exc:
        raise click.BadParameter(str(exc)) from exc


def _apply(
    client: Any,
    keys: QueueKeys,
    clear: bool,
    max_backlog: int | None,
    tenant: str | None,
    rate: float | None,
    burst: float | None,
) -> None:
    key = limits_key(keys)
    if (
        clear and tenant is not None and rate is None
    ):  # --clear --tenant T: that tenant's quota only
        client.hdel(key, f"rate:{tenant}", f"burst:{tenant}")
        if client.hkeys(key) == [b"stamp"]:
            client.delete(key)
        return
    if clear:
        client.delete(key, tenants_key(keys))
        return
    if tenant is not None and rate is not None:
        quotas = {name for name in client.hkeys(key) if name.startswith(b"rate:")}
        if f"rate:{tenant}".encode() not in quotas and len(quotas) >= MAX_TENANTS:
            raise click.BadParameter(
                f"queue {keys.name} already has {MAX_TENANTS} tenant quotas (the most)",
                param_hint="--tenant",
            )
    fields: dict[str, Any] = {}
    if max_backlog is not None:
        fields["max_backlog"] = max_backlog
    if tenant is not None and rate is not None:
        fields[f"rate:{tenant}"], fields[f"burst:{tenant}"] = (
            repr(v) for v in validate_rate(rate, burst)
        )
    if fields:
        fields.setdefault("stamp", client.hget(key, "stamp") or os.urandom(8).hex())
        client.hset(key, mapping=fields)


@click.command()
@pass_queue_config
@click.option(
    "--max-backlog",
    envvar="INFERFLEET_LIMIT_MAX_BACKLOG",
    show_envvar=True,
    type=int,
    default=None,
    help="Fleet-wide backlog limit (requests waiting in all lanes).",
)
@click.option(
    "--tenant",
    envvar="INFERFLEET_TENANT",
    show_envvar=True,
    default=None,
    help="The tenant whose quota --rate/--burst set (or --clear clears).",
)
@click.option(
    "--rate",
    envvar="INFERFLEET_LIMIT_RATE",
    show_envvar=True,
    type=float,
    default=None,
    help="The tenant's sustained rate, requests a second.",
)
@click.option(
    "--burst",
    envvar="INFERFLEET_LIMIT_BURST",
    show_envvar=True,
    type=float,
    default=None,
    help="The tenant's burst (token bucket size; default: --rate).",
)
@click.option(
    "--show", is_flag=True, help="Print the limits in force and per-tenant counts as JSON."
)
@click.option(
    "--clear", is_flag=True, help="Remove every limit (with --tenant: that tenant's quota only)."
)
def limit(
    queue: QueueConfig,
    max_backlog: int | None,
    tenant: str | None,
    rate: float | None,
    burst: float | None,
    show: bool,
    clear: bool,
) -> None:
    """Set, show or clear a queue's fleet-wide limits: backlog and per-tenant rate quotas."""
    _check_limit_options(max_backlog, tenant, rate, burst)
    if clear and (max_backlog is not None or rate is not None):
        raise click.UsageError("--clear removes limits: it takes no --max-backlog or --rate")
    client, shards = queue.connect()
    try:
        client.function_load(LIBRARY, replace=True)
        for keys in shards:
            _apply(client, keys, clear, max_backlog, tenant, rate, burst)
        if show or (max_backlog is None and rate is None and not clear):
            click.echo(json.dumps([read_limits(client, keys) for keys in shards], indent=2))
    except redis.exceptions.RedisError as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc


@click.command()
@pass_queue_config
@click.argument("request_ids", nargs=-1, required=True)
def cancel(queue: QueueConfig, request_ids: tuple[str, ...]) -> None:
    """Cancel requests no worker has computed yet: each is answered 'cancelled', never computed.

    Prints one line per id: cancelled, answered (its reply stands) or unknown (in no lane: nothing
    written; exit status 1).
    """
    from inferfleet.worker.cli.requests import producer_for

    with producer_for(queue) as producer:
        try:
            statuses = producer.cancel_many(list(request_ids))
        except errors.ProtocolError as exc:
            raise click.BadParameter(str(exc), param_hint="REQUEST_IDS") from exc
        except errors.InferfleetError as exc:
            raise click.ClickException(str(exc)) from exc
    for rid, status in zip(request_ids, statuses):
        click.echo(f"{rid} {status}")
    if "unknown" in statuses:
        sys.exit(1)
