"""Rounds of packed commands: the bytes they pack, the commands they stand for, the replies they
return.

Against fakeredis (whose connections read each reply with read_response);
tests/integration/test_transport.py runs the hiredis loop on a real Redis.
"""

from __future__ import annotations

import asyncio

import fakeredis
import fakeredis.aioredis
import hiredis
import pytest
import redis

from inferfleet.producer.transport import Round, arun, run

STREAM = "inferfleet:{q}:requests"


def sample_round() -> Round:
    round_ = Round()
    round_.xadd(
        STREAM,
        ["r1", "r-22"],
        [b"\x81\xa6inputs\xc0", b"%s%d\r\n" * 3],
        [("deadline", "1700000000000"), ("reply_to", "inferfleet:{q}:inbox:p-1")],
    )
    round_.xadd(STREAM, [], [], [])  # nothing to send: no command
    round_.xadd("inferfleet:{q.1}:requests", ["r3"], [b"body"])
    round_.lpop("inferfleet:{q}:inbox:p-1", 1000)
    round_.lpop("inferfleet:{q}:reply:r1")
    round_.lpops(["inferfleet:{q}:reply:a", "inferfleet:{q}:reply:b%d"])
    return round_


def test_a_round_packs_what_hiredis_packs_for_its_commands() -> None:
    round_ = sample_round()
    commands = list(round_.commands())
    assert [c[0] for c in commands] == ["XADD", "XADD", "XADD", "LPOP", "LPOP", "LPOP", "LPOP"]
    assert round_.replies == len(commands)
    assert commands[0] == (
        "XADD",
        STREAM,
        "*",
        "id",
        "r1",
        "body",
        b"\x81\xa6inputs\xc0",
        "deadline",
        "1700000000000",
        "reply_to",
        "inferfleet:{q}:inbox:p-1",
    )
    assert commands[3] == ("LPOP", "inferfleet:{q}:inbox:p-1", 1000)
    assert commands[4] == ("LPOP", "inferfleet:{q}:reply:r1")
    expected = b"".join(
        hiredis.pack_command(tuple(str(a).encode() if isinstance(a, (str, int)) else a for a in c))
        for c in commands
    )
    assert b"".join(round_.packed()) == expected


@pytest.mark.parametrize(
    "rids,bodies",
    [
        (
            ["a1", "a2", "a3"],
            [b"%s\r\n", b"%d%%", b"\x00\x01\x02\x03"],
        ),  # ids of one length, bodies not
        (["a1", "a2"], [b"%s%d", b"%%%%"]),  # both of one length
        (["a1", "a22"], [b"xy", b"zw"]),  # bodies of one length, ids not
    ],
)
def test_xadds_pack_the_same_bytes_whatever_their_lengths(
    rids: list[str], bodies: list[bytes]
) -> None:
    round_ = Round()
    round_.xadd("s%d", rids, bodies, [("deadline", "5%"), ("reply_to", "x")])
    expected = [
        hiredis.pack_command(
            (
                b"XADD",
                b"s%d",
                b"*",
                b"id",
                rid.encode(),
                b"body",
                body,
                b"deadline",
                b"5%",
                b"reply_to",
                b"x",
            )
        )
        for rid, body in zip(rids, bodies)
    ]
    assert b"".join(round_.packed()) == b"".join(expected)


@pytest.mark.parametrize("keys", [["k1", "k2", "k3"], ["k1", "k22", "k3"], ["k"]])
def test_lpops_pack_the_same_bytes_whatever_their_lengths(keys: list[str]) -> None:
    round_ = Round()
    round_.lpops(keys)
    assert b"".join(round_.packed()) == b"".join(
        hiredis.pack_command((b"LPOP", key.encode())) for key in keys
    )


def test_lpops_of_keys_beyond_ascii_count_bytes_not_characters() -> None:
    round_ = Round()
    round_.lpops(["plain", "clé", "ключ"])
    assert b"".join(round_.packed()) == b"".join(
        hiredis.pack_command((b"LPOP", key.encode())) for key in ("plain", "clé", "ключ")
    )


@pytest.mark.parametrize("single_connection", [False, True])  # the direct path, the pipeline path
def test_run_returns_a_reply_per_command_in_order(single_connection: bool) -> None:
    client = fakeredis.FakeRedis(single_connection_client=single_connection)
    client.rpush("inferfleet:{q}:inbox:p-1", b"a", b"b")
    client.rpush("inferfleet:{q}:reply:r1", b"one")
    replies = run(client, sample_round())
    assert len(replies) == 7
    assert all(isinstance(entry_id, bytes) and b"-" in entry_id for entry_id in replies[:3])
    assert replies[3:] == [[b"a", b"b"], b"one", None, None]
    (_, fields), (_, second) = client.xrange(STREAM)
    assert fields == {
        b"id": b"r1",
        b"body": b"\x81\xa6inputs\xc0",
        b"deadline": b"1700000000000",
        b"reply_to": b"inferfleet:{q}:inbox:p-1",
    }
    assert second[b"body"] == b"%s%d\r\n" * 3
    assert client.xrange("inferfleet:{q.1}:requests")[0][1] == {b"id": b"r3", b"body": b"body"}
    assert run(client, Round()) == []


def test_an_error_reply_is_raised_after_every_command_ran() -> None:
    client = fakeredis.FakeRedis()
    client.set("inferfleet:{q}:reply:r1", b"a string")
    round_ = Round()
    round_.xadd(STREAM, ["r1"], [b"b1"])
    round_.lpop("inferfleet:{q}:reply:r1")  # WRONGTYPE
    round_.xadd(STREAM, ["r2"], [b"b2"])
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        run(client, round_)
    assert [f[b"id"] for _, f in client.xrange(STREAM)] == [b"r1", b"r2"]
    assert client.ping()  # the connection is still in step


def test_arun_on_the_asyncio_clients() -> None:
    async def main() -> None:
        for single_connection in (False, True):
            client = fakeredis.aioredis.FakeRedis(single_connection_client=single_connection)
            await client.rpush("inferfleet:{q}:inbox:p-1", b"x")
            replies = await arun(client, sample_round())
            assert replies[3:] == [[b"x"], None, None, None]
            assert len(await client.xrange(STREAM)) == 2
            assert await arun(client, Round()) == []
            await client.aclose()

    asyncio.run(main())
