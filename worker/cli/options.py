"""Click options shared by the modules of the ``inferfleet`` command line."""

from __future__ import annotations

from typing import Any

import click

from inferfleet.producer import errors
from inferfleet.producer.protocol import DEFAULT_PREFIX
from inferfleet.worker.config import ENV_VARS

__all__ = ["cluster_option", "name_option", "prefix_option", "queue_context", "redis_url_option", "shards_option"]

redis_url_option = click.option("--redis-url", envvar="REDIS_URL", show_envvar=True, default=None,
                                help="Redis URL (redis://, rediss://, unix://); default redis://localhost:6379/0.")
name_option = click.option("--name", required=True, envvar=ENV_VARS["name"], show_envvar=True,
                           help="Queue (model) name: 1-64 of A-Z a-z 0-9 . _ -")
prefix_option = click.option("--prefix", default=DEFAULT_PREFIX, envvar=ENV_VARS["prefix"], show_envvar=True,
                             show_default=True, help="Key prefix of every Redis key.")
shards_option = click.option("--shards", type=int, default=1, show_default=True, envvar=ENV_VARS["shards"],
                             show_envvar=True, help="Streams the queue is sharded into (queues NAME.0, NAME.1 ...); "
                             "a request's shard is CRC-32 of its id mod this.")
cluster_option = click.option("--cluster/--no-cluster", default=False, show_default=True, envvar=ENV_VARS["cluster"],
                              show_envvar=True, help="Connect to a Redis Cluster (the URL names any one node).")


def queue_context(name: str, redis_url: str | None, prefix: str, shards: int = 1,
                  cluster: bool = False) -> tuple[Any, list]:
    """A client (no silent retries) and the keys of every shard of the queue (one, unsharded)."""
    import redis

    from inferfleet.producer.protocol import shard_keys
    from inferfleet.worker.cli.status import admin_client

    try:
        keys = list(shard_keys(name, shards, prefix))
    except errors.ProtocolError as exc:
        raise click.BadParameter(str(exc), param_hint="--name/--shards") from exc
    try:
        return admin_client(redis_url, cluster), keys
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc
