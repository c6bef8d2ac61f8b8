"""Click options shared by the modules of the ``inferfleet`` command line.

The queue options (``--name``, ``--redis-url``, ``--prefix``, ``--shards``, ``--cluster``) come
as one decorator, :func:`pass_queue_config`, that hands the command one frozen
:class:`QueueConfig` (as rq's ``rq/cli/helpers.py`` does with ``pass_cli_config``); the
single options are here too, for the commands that take only some of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Callable

import click

from inferfleet.producer import errors
from inferfleet.producer.protocol import DEFAULT_PREFIX
from inferfleet.worker.config import ENV_VARS

__all__ = ["CONNECTION_OPTIONS", "QueueConfig", "cluster_option", "name_option", "pass_queue_config", "prefix_option",
           "queue_context", "queue_options", "redis_url_option", "shards_option"]

#: What a click option is to a command's function: a decorator.
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

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

#: The options that say how to reach the queue, in the order --help shows them.
CONNECTION_OPTIONS = (redis_url_option, prefix_option, shards_option, cluster_option)


@dataclass(frozen=True)
class QueueConfig:
    """The queue a command works on and how to reach it, as the queue options give them."""

    name: str  # "" only in status without --name: every queue under the prefix
    redis_url: str | None
    prefix: str
    shards: int
    cluster: bool

    def connect(self) -> tuple[Any, list]:
        """A client (no silent retries) and the keys of every shard: :func:`queue_context`."""
        return queue_context(self.name, self.redis_url, self.prefix, self.shards, self.cluster)


_QUEUE_PARAMS = tuple(f.name for f in fields(QueueConfig))


def queue_options(name: Decorator = name_option) -> Decorator:
    """The queue options, handed to the command as one :class:`QueueConfig` in its ``queue`` argument.

    ``name`` is the --name option (``status`` takes an optional one). --help shows --name first and
    the connection options last, around the command's own options, as every command always has.
    """

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def call(**params: Any) -> Any:
            queue = QueueConfig(**{key: params.pop(key) for key in _QUEUE_PARAMS})
            return command(queue=queue, **params)

        # click keeps a function's options in __click_params__ in the order they were applied
        # (innermost first) and shows them reversed: the connection options go first, --name last.
        own = call.__dict__.pop("__click_params__", [])
        for option in reversed(CONNECTION_OPTIONS):
            option(call)
        call.__click_params__.extend(own)  # type: ignore[attr-defined]
        return name(call)

    return decorate


#: The queue options with a required --name; the command takes ``queue: QueueConfig``.
pass_queue_config: Decorator = queue_options()


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
