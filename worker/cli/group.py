"""The ``inferfleet`` group's own behaviour: help grouped by task, and errors without tracebacks.

:class:`InferfleetGroup` lists commands under headings (:data:`SECTIONS`; a
command not named there is listed under "Other commands", so a new command
needs no change here) and is the one seam where a Redis or inferfleet error
that escaped a command becomes an ``Error:`` line with what to do, and exit
status 1: a Redis that is down, not a cluster, or a cluster. Usage mistakes
stay click's (status 2).
"""

from __future__ import annotations

import re
from typing import Any

import click

from inferfleet.producer.sentinel import SENTINEL_SCHEMES

__all__ = ["InferfleetGroup", "SECTIONS", "check_redis_url", "with_hint"]

#: Help headings, in order, and the commands under each.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Serve a model": ("worker", "supervise", "scaler", "save-model"),
    "Send requests": ("enqueue", "result"),
    "Watch and manage a queue": ("status", "dead", "alerts", "swap"),
    "Measure": ("bench",),
}

_SCHEMES = ("redis://", "rediss://", "unix://", *SENTINEL_SCHEMES)

#: (what a Redis error says, what to do about it)
_HINTS = (
    (
        "No master found",
        "no Sentinel named a primary: are the Sentinels of the URL reachable, do they monitor "
        "that service name, and does the URL give their ?sentinel_password if they need one?",
    ),
    (
        "Cluster mode is not enabled",
        "this Redis is not a cluster: drop --cluster (and INFERFLEET_CLUSTER)",
    ),
    ("MOVED", "this Redis is a cluster: add --cluster"),
    ("CROSSSLOT", "this Redis is a cluster: add --cluster"),
    (
        "Connection refused",
        "is redis-server running there? Give its URL with --redis-url or REDIS_URL",
    ),
    ("Name or service not known", "is the host right? Give the URL with --redis-url or REDIS_URL"),
    ("Timeout connecting", "is redis-server reachable? Give its URL with --redis-url or REDIS_URL"),
    ("NOAUTH", "this Redis needs a password: redis://:PASSWORD@HOST:6379/0"),
    ("WRONGPASS", "the user or password in the URL is wrong"),
)


def with_hint(message: str) -> str:
    """``message`` with what to do appended when it is a Redis error we know."""
    # redis-py's MasterNotFoundError carries its Sentinel client's whole repr: keep the sense
    text = re.sub(r" : <redis\.client\.Redis\(.*\)>", "", message.rstrip())
    for needle, hint in _HINTS:
        if needle in text and hint not in text:
            return f"{text} ({hint})"
    return text


def check_redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A --redis-url callback: a URL without a scheme is a usage error that shows the fix."""
    if value is not None and not value.startswith(_SCHEMES):
        fixed = f"redis://{value}" if "/" not in value else f"redis://{value.split('://')[-1]}"
        raise click.BadParameter(
            f"{value!r} needs a scheme: {fixed}{'/0' if '/' not in value else ''} "
            f"(or rediss:// for TLS, unix:// for a socket, redis+sentinel:// for Sentinels)"
        )
    return value


def _from_redis(exc: BaseException) -> bool:
    return any(
        cls.__module__.split(".")[0] in ("redis", "inferfleet") for cls in type(exc).__mro__[:-1]
    )


class InferfleetGroup(click.Group):
    """A click group with sectioned help and one-line errors."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            exc.message = with_hint(exc.message)  # type: ignore[misc]  # click's Final: we only add a hint
            raise
        except (click.exceptions.Exit, click.exceptions.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:
            if not _from_redis(exc):
                raise
            raise click.ClickException(with_hint(f"{type(exc).__name__}: {exc}")) from exc

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        commands = {name: self.get_command(ctx, name) for name in self.list_commands(ctx)}
        shown = {name: cmd for name, cmd in commands.items() if cmd is not None and not cmd.hidden}
        width = formatter.width - 6 - max((len(name) for name in shown), default=0)
        placed: set[str] = set()
        for title, names in [*SECTIONS.items(), ("Other commands", tuple(shown))]:
            rows = [
                (n, shown[n].get_short_help_str(width))
                for n in names
                if n in shown and n not in placed
            ]
            placed.update(n for n, _ in rows)
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
