"""The worker's one fence for redis-py internals: commands packed by hand, sent and read by hand.

Where the hot path needs more than redis-py's public API, this module holds
it, and only this one (``tests/unit/test_architecture.py``), as
:mod:`inferfleet.producer.transport` does for the SDK, whose :func:`bulk`
and :func:`pack_command` it builds on:

- the commands the worker packs itself: the reply script's EVALSHA
  (:func:`pack_evalsha`), the lanes' XREADGROUP (:func:`pack_xreadgroup`)
  and the EXISTS that rides with it (:func:`pack_exists`);
- a connection checked out of a client's pool and given back once its
  answer is read (:func:`checkout`, :func:`read_answer`), with the redis-py
  version check that decides how a connection is asked for;
- :func:`call_packed`: a packed script call, loading the script again when
  Redis answers NOSCRIPT;
- the held call (send now, read later: :func:`send_held`,
  :func:`read_answer`, :func:`drop_held`), for
  :mod:`~inferfleet.worker.serving.behind`;
- the XREADGROUP response callback that keeps hiredis's form
  (:func:`raw_xreadgroup`).

The supported redis-py range is tested by
``tests/integration/test_redis_py_range.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

from inferfleet.producer.transport import NAMELESS_CONNECTIONS, bulk, pack_command

__all__ = [
    "call_packed",
    "checkout",
    "drop_held",
    "pack_evalsha",
    "pack_exists",
    "pack_xreadgroup",
    "raw_xreadgroup",
    "read_answer",
    "send_held",
    "send_packed",
]


def _as_sent(response: Any, **options: Any) -> Any:
    return response


def raw_xreadgroup(client: redis.Redis) -> None:
    """Have ``client`` return XREADGROUP replies as hiredis parsed them.

    redis-py's per-entry conversion to tuples and dicts is a quarter of a
    draining worker's CPU; the consumer reads either form
    (:func:`~inferfleet.worker.connections.stream_entries`).
    """
    client.set_response_callback("XREADGROUP", _as_sent)


def pack_evalsha(
    sha: str,
    first_key: bytes,
    keys: Sequence[bytes],
    args: Sequence[bytes],
    packed_args: bytes = b"",
    packed: int = 0,
) -> bytes:
    """EVALSHA of the script ``sha`` over ``first_key`` and ``keys``, then ``args``, then
    ``packed`` more arguments already RESP-packed in ``packed_args``.

    ``keys`` mostly have one length (one producer's reply keys): they are
    joined in one go. ``packed_args`` are bulk strings the caller joined
    itself (the reply writer's (entry id, payload) pairs).
    """
    head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n%b%b" % (
        4 + len(keys) + len(args) + packed,
        sha.encode("ascii"),
        bulk(b"%d" % (len(keys) + 1)),
        bulk(first_key),
    )
    return b"".join((head, _bulks(keys), *map(bulk, args), packed_args))


def _bulks(values: Sequence[bytes]) -> bytes:
    """RESP bulk strings, joined (in one join where they all have one length: one producer's keys
    mostly do)."""
    if len(set(map(len, values))) == 1:
        head = b"$%d\r\n" % len(values[0])
        return head + (b"\r\n" + head).join(values) + b"\r\n"
    return b"".join([b"$%d\r\n%b\r\n" % (len(value), value) for value in values])


def pack_xreadgroup(group: str, consumer: str, count: int, streams: Sequence[str]) -> bytes:
    """``XREADGROUP GROUP group consumer COUNT count STREAMS streams... > ...`` (not blocking)."""
    return pack_command(
        ["XREADGROUP", "GROUP", group, consumer, "COUNT", count, "STREAMS", *streams]
        + [">"] * len(streams)
    )


def pack_exists(key: str) -> bytes:
    """``EXISTS key``."""
    return pack_command(["EXISTS", key])


def checkout(pool: redis.ConnectionPool) -> Any:
    """A connection of ``pool`` for packed commands sent by hand (give it back with
    :func:`read_answer`)."""
    # redis-py 5.3 and newer take no command name (and warn when given one); older ones need one
    return pool.get_connection() if NAMELESS_CONNECTIONS else pool.get_connection("EVALSHA")


def read_answer(pool: redis.ConnectionPool, conn: Any) -> Any:
    """Read one answer on ``conn``, then give it back to ``pool``, closed unless the answer was
    read whole."""
    try:
        return conn.read_response()
    except redis.exceptions.ResponseError:
        raise  # an error answer, read whole: the connection is fine
    except BaseException:
        conn.disconnect()  # the answer may still come: this connection must not be read again
        raise
    finally:
        pool.release(conn)


def send_packed(pool: redis.ConnectionPool, packed: bytes) -> Any:
    """Send one packed command on a connection of ``pool`` and return its answer."""
    conn = checkout(pool)
    try:
        conn.send_packed_command([packed])
    except BaseException:
        conn.disconnect()  # part of it may have gone: this connection must not be read again
        pool.release(conn)
        raise
    return read_answer(pool, conn)


def send_packed_then(pool: redis.ConnectionPool, packed: bytes, then: bytes) -> tuple[Any, Any]:
    """Send ``packed`` and ``then`` on one connection of ``pool`` (``then`` is a ``WAIT``: it
    must follow the writes on their own connection); both answers, an error answer in its
    place."""
    conn = checkout(pool)
    answers: list[Any] = []
    try:
        conn.send_packed_command([packed, then])
        for _ in range(2):
            try:
                answers.append(conn.read_response())
            except redis.exceptions.ResponseError as exc:  # read whole: the next one follows
                answers.append(exc)
    except BaseException:
        conn.disconnect()  # an answer may still come: this connection must not be read again
        raise
    finally:
        pool.release(conn)
    return answers[0], answers[1]


def call_packed(pool: redis.ConnectionPool, packed: bytes, load: Callable[[], None]) -> Any:
    """Send a packed script call and return its answer; on NOSCRIPT (Redis restarted or flushed
    its scripts: nothing ran) ``load`` the script and send it again."""
    try:
        return send_packed(pool, packed)
    except redis.exceptions.NoScriptError:
        load()
        return send_packed(pool, packed)


def send_held(
    pool: redis.ConnectionPool, before: bytes, held: bytes, answers: int
) -> tuple[Any, list[Any]]:
    """Send ``before`` (commands that answer ``answers`` times), then ``held``, in one write.

    Returns the connection ``held`` went out on, its answer not read yet
    (:func:`read_answer` reads it and gives the connection back;
    :func:`drop_held` forgets it), and the answers to ``before``. On any
    error the connection is closed and given back.
    """
    conn = checkout(pool)
    try:
        conn.send_packed_command([before, held])
        out = [conn.read_response() for _ in range(answers)]
    except BaseException:
        conn.disconnect()
        pool.release(conn)
        raise
    return conn, out


def drop_held(pool: redis.ConnectionPool, conn: Any) -> None:
    """Close a connection whose held answer will never be read, and give it back."""
    conn.disconnect()
    pool.release(conn)
