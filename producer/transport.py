"""Rounds of XADDs and LPOPs written in one send, their replies read in one go.

The SDK's bulk calls (``map``, ``imap``, ``submit_many``, ``results``) send
thousands of commands a second. redis-py's pipeline spends about 6 us a
command in Python (building the arguments, packing them, parsing each reply
through its callbacks); here a :class:`Round` packs its commands as RESP
bytes from one template per call, writes them with the connection's own
``send_packed_command`` and takes the replies off the connection's hiredis
reader in one loop.

Only commands the producer's ACL user already has are sent (XADD, LPOP and
BLPOP; docs/security.md): no scripts, no new grants.

A plain ``redis.Redis`` (or ``redis.asyncio.Redis``) gets that direct path;
the hiredis loop is used only where the connection is redis-py's stock one
with its stock hiredis parser (RESP3 pushes go to the parser's handler as
``read_response`` would send them), else each reply is read with the
connection's ``read_response``. A ``RedisCluster`` (or a single-connection
client) runs the same commands through redis-py's pipeline, which routes
each command to its slot's node and follows MOVED and ASK.

Errors stay redis-py's: the caller translates them at the one seam,
:func:`inferfleet.producer.connections.translate_errors`. As in a pipeline,
every reply is read before the first error reply is raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection as AsyncConnection
from redis.connection import AbstractConnection

try:  # redis-py's parser internals: without them, every reply goes through read_response
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser, _HiredisParser
except ImportError:  # pragma: no cover - other redis-py versions
    NOT_ENOUGH_DATA = _HiredisParser = _AsyncHiredisParser = None  # type: ignore[assignment,misc]

__all__ = [
    "NAMELESS_CONNECTIONS",
    "Round",
    "arun",
    "bulk",
    "pack_command",
    "raise_first_error",
    "run",
]

#: Whether ConnectionPool.get_connection() takes no command name (redis-py 5.3 on); older ones use
#: the pipeline.
NAMELESS_CONNECTIONS = tuple(int(part) for part in redis.__version__.split(".")[:2]) >= (5, 3)
_SYNC_READ = AbstractConnection.read_response
_ASYNC_READ = AsyncConnection.read_response


def bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


class Round:
    """The commands of one round trip, in order; :func:`run` or :func:`arun` sends them."""

    def __init__(self) -> None:
        self._ops: list[tuple] = []
        #: how many replies the round will read (one a command)
        self.replies = 0

    def xadd(
        self,
        stream: str,
        rids: Sequence[str],
        bodies: Sequence[bytes],
        fields: Sequence[tuple[str, str]] = (),
    ) -> None:
        """``XADD stream * id RID body BODY [FIELD VALUE ...]`` for each request id and body."""
        if rids:
            self._ops.append(("xadd", stream, rids, bodies, tuple(fields)))
            self.replies += len(rids)

    def command(self, args: Sequence[Any]) -> None:
        """Any one command (``FCALL inferfleet_enqueue ...``): one reply."""
        self._ops.append(("command", tuple(args)))
        self.replies += 1

    def wait(self, replicas: int, timeout_ms: int, node: Any = None) -> None:
        """``WAIT replicas timeout_ms`` on the connection that sent the writes before it (on a
        cluster, ``node``'s: the node that took them)."""
        self._ops.append(("wait", ("WAIT", replicas, timeout_ms), node))
        self.replies += 1

    def lpop(self, key: str, count: int | None = None) -> None:
        """``LPOP key [count]``."""
        self._ops.append(("lpop", key, count))
        self.replies += 1

    def blpop(self, keys: Sequence[str], timeout_s: float) -> None:
        """``BLPOP key [key ...] timeout``: the commands after it run once it returns.

        Redis runs a connection's commands in order, so LPOPs queued behind a
        BLPOP wait with it and then take what the write that woke it brought:
        one round trip both waits for a reply and collects its batch.
        """
        self._ops.append(("blpop", tuple(keys), f"{max(timeout_s, 0.01):.3f}"))
        self.replies += 1

    def lpops(self, keys: Sequence[str]) -> None:
        """``LPOP key`` for each key."""
        if keys:
            self._ops.append(("lpops", keys))
            self.replies += len(keys)

    def packed(self) -> list[bytes]:
        """The round as RESP bytes."""
        out = []
        for op in self._ops:
            if op[0] == "xadd":
                out.append(_pack_xadds(*op[1:]))
            elif op[0] == "lpop":
                out.append(_pack_lpop(op[1], op[2]))
            elif op[0] in ("command", "wait"):
                out.append(pack_command(op[1]))
            elif op[0] == "blpop":
                parts = [b"BLPOP", *(key.encode() for key in op[1]), op[2].encode()]
                out.append(b"*%d\r\n%s" % (len(parts), b"".join(bulk(part) for part in parts)))
            else:
                out.append(_pack_lpops(op[1]))
        return out

    def commands(self) -> Iterator[tuple]:
        """The round as redis-py command arguments (for a pipeline)."""
        for args, _ in self.routed():
            yield args

    def routed(self) -> Iterator[tuple[tuple, dict]]:
        """(arguments, redis-py options) of each command: a cluster's ``WAIT`` names its node."""
        for op in self._ops:
            if op[0] == "wait":
                yield op[1], ({} if op[2] is None else {"target_nodes": op[2]})
            else:
                yield from ((args, {}) for args in self._commands(op))

    @staticmethod
    def _commands(op: tuple) -> Iterator[tuple]:
        """The commands of one queued operation (all but ``wait``)."""
        if op[0] == "xadd":
            _, stream, rids, bodies, fields = op
            extra = [part for pair in fields for part in pair]
            for rid, body in zip(rids, bodies):
                yield ("XADD", stream, "*", "id", rid, "body", body, *extra)
        elif op[0] == "lpop":
            yield ("LPOP", op[1]) if op[2] is None else ("LPOP", op[1], op[2])
        elif op[0] == "blpop":
            yield ("BLPOP", *op[1], op[2])
        elif op[0] == "command":
            yield op[1]
        else:
            yield from (("LPOP", key) for key in op[1])


def _pack_xadds(stream: str, rids: Sequence[str], bodies: Sequence[bytes], fields: tuple) -> bytes:
    head = b"*%d\r\n$4\r\nXADD\r\n%s$1\r\n*\r\n$2\r\nid\r\n" % (
        7 + 2 * len(fields),
        bulk(stream.encode()),
    )
    head = head.replace(b"%", b"%%")
    tail = b"".join(bulk(part.encode()) for pair in fields for part in pair).replace(b"%", b"%%")
    raw_ids = "\n".join(rids).encode().split(b"\n")
    if (
        len(raw_ids) == len(rids)
        and len(set(map(len, raw_ids))) == 1
        and len(set(map(len, bodies))) == 1
    ):
        # every id and every body of one length (one producer's, one shape): two strings a command
        sizes = b"$%d\r\n%%s\r\n$4\r\nbody\r\n$%d\r\n%%s\r\n" % (len(raw_ids[0]), len(bodies[0]))
        fixed = head + sizes + tail
        return b"".join([fixed % pair for pair in zip(raw_ids, bodies)])
    template = head + b"$%d\r\n%s\r\n$4\r\nbody\r\n$%d\r\n%s\r\n" + tail
    return b"".join(
        [
            template % (len(rid), rid, len(body), body)
            for rid, body in zip(map(str.encode, rids), bodies)
        ]
    )


def pack_command(args: Sequence[Any]) -> bytes:
    """One command as RESP (bytes as they are, anything else as its ``str``)."""
    parts = [arg if isinstance(arg, bytes) else str(arg).encode() for arg in args]
    return b"*%d\r\n%s" % (len(parts), b"".join([bulk(part) for part in parts]))


def _pack_lpop(key: str, count: int | None) -> bytes:
    if count is None:
        return b"*2\r\n$4\r\nLPOP\r\n" + bulk(key.encode())
    return b"*3\r\n$4\r\nLPOP\r\n%s%s" % (bulk(key.encode()), bulk(b"%d" % count))


def _pack_lpops(keys: Sequence[str]) -> bytes:
    """``LPOP key`` for each key: packed as text and encoded once where every key is ASCII,
    in one join where they all have the same length (one producer's reply keys mostly do)."""
    if not "".join(keys).isascii():
        return b"".join([b"*2\r\n$4\r\nLPOP\r\n" + bulk(key.encode()) for key in keys])
    if len(set(map(len, keys))) == 1:
        head = f"*2\r\n$4\r\nLPOP\r\n${len(keys[0])}\r\n"
        return (head + f"\r\n{head}".join(keys) + "\r\n").encode()
    return "".join([f"*2\r\n$4\r\nLPOP\r\n${len(key)}\r\n{key}\r\n" for key in keys]).encode()


_PLAIN_REPLIES = frozenset({bytes, type(None)})


def raise_first_error(replies: list[Any]) -> list[Any]:
    """``replies`` as they are, unless one is an error reply (or starts with one): raise it."""
    if set(map(type, replies)) <= _PLAIN_REPLIES:  # the common round: entry ids, replies, nils
        return replies
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
        if reply.__class__ is list and reply and isinstance(reply[0], Exception):
            raise reply[0]
    return replies


def _direct(client: Any, plain: type) -> bool:
    return (
        NAMELESS_CONNECTIONS
        and isinstance(client, plain)
        and getattr(client, "connection", None) is None
    )


# --------------------------------------------------------------------------- sync


def run(client: Any, round_: Round, keep_errors: bool = False) -> list[Any]:
    """Send ``round_`` on ``client`` and return one reply a command.

    Raises the first error reply, or with ``keep_errors`` returns it in its
    place (the writes of several callers sent together each get their own).
    """
    if not round_.replies:
        return []
    if not _direct(client, redis.Redis):
        pipe = client.pipeline(transaction=False)
        for args, options in round_.routed():
            pipe.execute_command(*args, **options)
        return list(pipe.execute(raise_on_error=not keep_errors))
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(round_.packed())
        replies = _read(conn, round_.replies)
    finally:
        pool.release(conn)
    return replies if keep_errors else raise_first_error(replies)


def _read(conn: Any, count: int) -> list[Any]:
    parser = getattr(conn, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if (
        reader is None
        or type(conn).read_response is not _SYNC_READ
        or type(parser) is not _HiredisParser
    ):
        return _read_each(conn, count)
    push = getattr(
        parser, "_hiredis_PushNotificationType", None
    )  # RESP3 pushes are handled, not replies
    replies: list[Any] = []
    gets = reader.gets
    try:
        while len(replies) < count:
            got = gets()
            if got is NOT_ENOUGH_DATA:
                parser.read_from_socket()  # type: ignore[union-attr]
            elif push is not None and isinstance(got, push):
                parser.handle_push_response(got)  # type: ignore[union-attr]
            else:
                replies.append(got)
    except OSError as exc:  # what read_response turns into a ConnectionError
        conn.disconnect()
        raise redis.exceptions.ConnectionError(f"Error while reading from Redis: {exc}") from exc
    except BaseException:
        conn.disconnect()  # replies left unread: the connection cannot be reused
        raise
    if conn.health_check_interval:
        conn.next_health_check = time.monotonic() + conn.health_check_interval
    return replies


def _read_each(conn: Any, count: int) -> list[Any]:
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(conn.read_response())
        except redis.exceptions.ResponseError as exc:  # an error reply: the rest still follow
            replies.append(exc)
    return replies


# --------------------------------------------------------------------------- asyncio


async def arun(client: Any, round_: Round, keep_errors: bool = False) -> list[Any]:
    """The asyncio twin of :func:`run`."""
    if not round_.replies:
        return []
    if not _direct(client, aioredis.Redis):
        pipe = client.pipeline(transaction=False)
        for args, options in round_.routed():
            pipe.execute_command(*args, **options)
        return list(await pipe.execute(raise_on_error=not keep_errors))
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        await conn.send_packed_command(round_.packed())
        replies = await _aread(conn, round_.replies)
    finally:
        await pool.release(conn)
    return replies if keep_errors else raise_first_error(replies)


async def _aread(conn: Any, count: int) -> list[Any]:
    parser = getattr(conn, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if (
        reader is None
        or type(conn).read_response is not _ASYNC_READ
        or type(parser) is not _AsyncHiredisParser
    ):
        return await _aread_each(conn, count)
    push = getattr(parser, "_hiredis_PushNotificationType", None)
    timeout_s = conn.socket_timeout  # read_response's bound on each read, kept here
    replies: list[Any] = []
    gets = reader.gets
    try:
        while len(replies) < count:
            got = gets()
            if got is NOT_ENOUGH_DATA:
                await asyncio.wait_for(parser.read_from_socket(), timeout_s)  # type: ignore[union-attr]
            elif push is not None and isinstance(got, push):
                await parser.handle_push_response(got)  # type: ignore[union-attr]
            else:
                replies.append(got)
    except asyncio.TimeoutError as exc:
        await conn.disconnect(nowait=True)
        raise redis.exceptions.TimeoutError("Timeout reading from Redis") from exc
    except OSError as exc:
        await conn.disconnect(nowait=True)
        raise redis.exceptions.ConnectionError(f"Error while reading from Redis: {exc}") from exc
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    return replies


async def _aread_each(conn: Any, count: int) -> list[Any]:
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(await conn.read_response())
        except redis.exceptions.ResponseError as exc:
            replies.append(exc)
    return replies
