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
import re
import weakref
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.retry import Retry

from inferfleet.producer.connections import (
    HEALTH_CHECK_INTERVAL_S,
    MAX_BLOCK_S,
    client_options,
    redis_url,
)
from inferfleet.worker.resp import raw_xreadgroup

__all__ = [
    "admin_client",
    "lua_constant",
    "lua_source",
    "redis_url",
    "script",
    "stream_entries",
    "worker_client",
]


def _connect(url: str, cluster: bool, block_s: float, health_check_s: int = 0) -> redis.Redis:
    factory = RedisCluster.from_url if cluster else redis.Redis.from_url
    return factory(url, retry=Retry(NoBackoff(), 0), **client_options(block_s, health_check_s))


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
