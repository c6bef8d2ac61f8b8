"""Click options shared by the modules of the ``inferfleet`` command line.

An option that sets a field of a settings dataclass (``WorkerSettings``, ``SupervisorSettings``,
``PolicySettings``) is built from the field by :func:`setting_option`, with the field's default,
environment variable and help, so that the dataclass stays the one source of each.

The queue options (``--name``, ``--redis-url``, ``--prefix``, ``--shards``, ``--cluster``) come
as one decorator, :func:`pass_queue_config`, that hands the command one frozen
:class:`QueueConfig` (as rq's ``rq/cli/helpers.py`` does with ``pass_cli_config``); the
single options are here too, for the commands that take only some of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any

import click

from inferfleet.producer import errors
from inferfleet.worker.cli.group import check_redis_url
from inferfleet.worker.config import WorkerSettings, env_var

__all__ = [
    "CONNECTION_OPTIONS",
    "QueueConfig",
    "SettingOption",
    "cluster_option",
    "name_option",
    "pass_queue_config",
    "prefix_option",
    "queue_context",
    "queue_options",
    "redis_url_option",
    "setting_option",
    "settings_field",
    "shards_option",
]

#: What a click option is to a command's function: a decorator.
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class SettingOption(click.Option):
    """A click option built from a settings dataclass field by :func:`setting_option`
    (``setting``)."""

    def __init__(self, *args: Any, setting: Field[Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.setting = setting


def settings_field(settings: type, name: str) -> Field[Any]:
    """The field ``name`` of the settings dataclass ``settings``."""
    found = [f for f in fields(settings) if f.name == name]
    if not found:
        raise TypeError(f"{settings.__name__} has no field {name!r}")
    return found[0]


def setting_option(settings: type, name: str, *decls: str, **attrs: Any) -> Decorator:
    """A click option for the field ``name`` of ``settings``: the field's default, environment
    variable and help.

    ``decls`` name the option as click takes them (``--max-batch-rows``,
    ``--compile/--no-compile``); ``attrs`` are the rest (``type``). A field without a default is a
    required option; one with a default factory defaults to None, which the command leaves out so
    that the dataclass computes it.
    """
    setting = settings_field(settings, name)
    if setting.default is not MISSING:
        attrs.update(default=setting.default, show_default=True)
    elif setting.default_factory is not MISSING:
        attrs.update(default=None)
    else:
        attrs.update(required=True)
    return click.option(
        *decls,
        cls=SettingOption,
        setting=setting,
        envvar=env_var(setting),
        show_envvar=True,
        help=setting.metadata["help"],
        **attrs,
    )


redis_url_option = setting_option(
    WorkerSettings, "redis_url", "--redis-url", callback=check_redis_url
)
name_option = setting_option(WorkerSettings, "name", "--name")
prefix_option = setting_option(WorkerSettings, "prefix", "--prefix")
shards_option = setting_option(WorkerSettings, "shards", "--shards", type=int)
cluster_option = setting_option(WorkerSettings, "cluster", "--cluster/--no-cluster")

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
    """The queue options, handed to the command as one :class:`QueueConfig` in its ``queue``
    argument.

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


def queue_context(
    name: str, redis_url: str | None, prefix: str, shards: int = 1, cluster: bool = False
) -> tuple[Any, list]:
    """A client (no silent retries) and the keys of every shard of the queue (one, unsharded)."""
    import redis

    from inferfleet.producer.protocol import shard_keys
    from inferfleet.worker.connections import admin_client

    try:
        keys = list(shard_keys(name, shards, prefix))
    except errors.ProtocolError as exc:
        raise click.BadParameter(str(exc), param_hint="--name/--shards") from exc
    try:
        return admin_client(redis_url, cluster), keys
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise click.ClickException(f"Redis error: {exc}") from exc
