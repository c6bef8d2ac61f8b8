"""The worker's fence (worker/resp.py) packs what hiredis packs; its scripts resolve once a client.

The hand-packed commands are checked byte for byte against
``hiredis.pack_command`` of the same arguments, keys of one length (the
joined fast path) and of several; the script registry of
worker/connections.py registers a script once a client and lets the
client go.
"""

from __future__ import annotations

import gc
import weakref

import hiredis
import pytest
import redis

from inferfleet.worker import connections
from inferfleet.worker.resp import pack_evalsha, pack_exists, pack_xreadgroup
from inferfleet.worker.serving.replies import REPLY_SCRIPT, RUN_MAX

SHA = "0123456789abcdef0123456789abcdef01234567"


def _bulks(values: list[bytes]) -> bytes:
    return b"".join(b"$%d\r\n%b\r\n" % (len(v), v) for v in values)


@pytest.mark.parametrize(
    "keys",
    [[b"q:reply:a1", b"q:reply:b2"], [b"q:reply:a", b"q:reply:b22", b"q:x"], [], [b"k"]],
)
def test_evalsha_packs_what_hiredis_packs(keys: list[bytes]) -> None:
    pairs = [b"1-0", b"payload\r\n%s", b"2-0", b""] * len(keys)
    packed = pack_evalsha(
        SHA, b"q:requests", keys, (b"workers", b"60000"), _bulks(pairs), len(pairs)
    )
    args = (b"EVALSHA", SHA.encode(), b"%d" % (len(keys) + 1), b"q:requests", *keys)
    assert packed == hiredis.pack_command((*args, b"workers", b"60000", *pairs))


def test_the_lane_read_packs_what_hiredis_packs() -> None:
    streams = ["q:requests:high", "q:requests", "q:requests:low"]
    assert pack_xreadgroup("workers", "c-1", 64, streams) + pack_exists("q:cancels") == (
        hiredis.pack_command(
            ("XREADGROUP", "GROUP", "workers", "c-1", "COUNT", "64", "STREAMS", *streams)
            + (">",) * 3
        )
        + hiredis.pack_command(("EXISTS", "q:cancels"))
    )


def test_a_script_is_registered_once_a_client_and_lets_the_client_go() -> None:
    client = redis.Redis()  # never connects: registering reads nothing from Redis
    reply = connections.script(client, "reply")
    assert connections.script(client, "reply") is reply
    assert connections.script(redis.Redis(), "reply") is not reply
    assert reply.script == REPLY_SCRIPT == connections.lua_source("reply")
    gone = weakref.ref(client)
    del client, reply
    gc.collect()
    assert gone() is None


def test_constants_python_needs_are_read_from_the_lua_file() -> None:
    assert RUN_MAX == 1024
    assert f"local RUN_MAX = {RUN_MAX}\n" in REPLY_SCRIPT
    with pytest.raises(LookupError):
        connections.lua_constant("reply", "NO_SUCH")
