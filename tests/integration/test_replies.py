"""The reply script on a real Redis: every answered reply key gets its TTL once; a full Redis
answers nothing."""

from __future__ import annotations

import msgpack
import pytest
import redis

from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.worker.counters import Counters
from inferfleet.worker.serving.consumer import ensure_group
from inferfleet.worker.serving.intake import Answer
from inferfleet.worker.serving.replies import RUN_MAX, ReplyWriter

KEYS = QueueKeys("replies")
TTL_S = 60


def _pending(client: redis.Redis, count: int) -> list[bytes]:
    ensure_group(client, KEYS.requests)
    ids = [client.xadd(KEYS.requests, {"id": f"r{i}"}) for i in range(count)]
    client.xreadgroup(GROUP, "c1", {KEYS.requests: ">"}, count=count)
    return ids


def test_replies_to_a_shared_inbox_and_to_their_own_keys_all_get_the_ttl(
    redis_client: redis.Redis,
) -> None:
    ids = _pending(redis_client, 5)
    inbox = KEYS.inbox("p1")
    keys = [inbox, inbox, KEYS.reply("r2"), inbox, KEYS.reply("r4")]
    writer = ReplyWriter(redis_client, KEYS, TTL_S, ("m", "1"), Counters())
    writer.write(
        [
            Answer(i, k, b"reply %d" % n, True, rid=f"r{n}")
            for n, (i, k) in enumerate(zip(ids, keys))
        ]
    )
    assert redis_client.lrange(inbox, 0, -1) == [b"reply 0", b"reply 1", b"reply 3"]
    for key in set(keys):
        assert 0 < redis_client.pttl(key) <= TTL_S * 1000, key
    assert redis_client.xpending(KEYS.requests, GROUP)["pending"] == 0


def test_a_full_redis_refuses_the_whole_call_and_the_round_is_retried(
    redis_client: redis.Redis,
) -> None:
    """Redis refuses a script's first write when over maxmemory and never a later one (it would
    leave half a call), so a full Redis answers nothing of the round: all of it stays pending."""
    ids = _pending(redis_client, 2)
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", 1)  # over the limit already
    try:
        writer = ReplyWriter(redis_client, KEYS, TTL_S, ("m", "1"), Counters())
        answers = [
            Answer(i, KEYS.reply(f"r{n}"), b"reply", True, rid=f"r{n}") for n, i in enumerate(ids)
        ]
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            writer.write(answers)
    finally:
        redis_client.config_set("maxmemory", 0)
    assert not redis_client.exists(KEYS.reply("r0"), KEYS.reply("r1"))
    assert redis_client.xpending(KEYS.requests, GROUP)["pending"] == 2
    writer.write(answers)  # the retried round answers both, with their TTL
    assert all(0 < redis_client.pttl(KEYS.reply(f"r{n}")) <= TTL_S * 1000 for n in range(2))


def _answers(ids: list[bytes], keys: list[str]) -> list[Answer]:
    return [
        Answer(i, k, b"reply %d" % n, True, rid=f"r{n}") for n, (i, k) in enumerate(zip(ids, keys))
    ]


def test_a_run_to_one_inbox_takes_back_exactly_the_replies_another_worker_gave_first(
    redis_client: redis.Redis,
) -> None:
    """Replies in a row to one inbox are pushed by one RPUSH; those whose entry was already
    acknowledged (answered elsewhere) come out again, the rest stay in order, after what was
    there."""
    ids = _pending(redis_client, 6)
    inbox = KEYS.inbox("p1")
    redis_client.rpush(inbox, b"from another worker")
    redis_client.xack(KEYS.requests, GROUP, ids[1], ids[4])  # answered by another worker
    writer = ReplyWriter(redis_client, KEYS, TTL_S, ("m", "1"), Counters())
    writer.write(_answers(ids, [inbox] * 6))
    assert redis_client.lrange(inbox, 0, -1) == [
        b"from another worker",
        b"reply 0",
        b"reply 2",
        b"reply 3",
        b"reply 5",
    ]
    assert 0 < redis_client.pttl(inbox) <= TTL_S * 1000
    assert writer.counters.skipped == 2
    assert redis_client.xpending(KEYS.requests, GROUP)["pending"] == 0


def test_a_run_whose_every_entry_was_answered_elsewhere_leaves_the_inbox_as_it_was(
    redis_client: redis.Redis,
) -> None:
    ids = _pending(redis_client, 3)
    inbox, other = KEYS.inbox("p1"), KEYS.inbox("p2")
    redis_client.xack(KEYS.requests, GROUP, *ids)
    ReplyWriter(redis_client, KEYS, TTL_S, ("m", "1"), Counters()).write(
        _answers(ids, [inbox, inbox, other])
    )
    assert not redis_client.exists(inbox, other)  # nothing pushed stands, and no key is left behind


def test_runs_are_cut_at_the_unpack_limit_and_at_acknowledge_only_entries(
    redis_client: redis.Redis,
) -> None:
    """A round of more replies to one inbox than Lua's unpack takes (about 8,000) still goes out
    whole."""
    count = 8200
    assert count > 8 * RUN_MAX
    ids = _pending(redis_client, count)
    inbox = KEYS.inbox("p1")
    answers = _answers(ids, [inbox] * count)
    answers[5] = Answer(ids[5], None, None)  # acknowledge only (a cancelled request, say)
    ReplyWriter(redis_client, KEYS, TTL_S, ("m", "1"), Counters()).write(answers)
    assert redis_client.lrange(inbox, 0, -1) == [b"reply %d" % n for n in range(count) if n != 5]
    assert redis_client.xpending(KEYS.requests, GROUP)["pending"] == 0


def test_a_run_to_a_key_of_another_type_is_answered_bad_request_at_each_default_key(
    redis_client: redis.Redis,
) -> None:
    ids = _pending(redis_client, 4)
    inbox = KEYS.inbox("p1")
    redis_client.set(inbox, "not a list")
    ReplyWriter(redis_client, KEYS, TTL_S, ("m", "1"), Counters()).write(
        _answers(ids, [KEYS.reply("r0"), inbox, inbox, inbox])
    )
    assert redis_client.lrange(KEYS.reply("r0"), 0, -1) == [b"reply 0"]
    for n in (1, 2, 3):
        (reply,) = redis_client.lrange(KEYS.reply(f"r{n}"), 0, -1)
        assert msgpack.unpackb(reply)["error"]["code"] == "bad_request"
    assert redis_client.get(inbox) == b"not a list"
    assert redis_client.xpending(KEYS.requests, GROUP)["pending"] == 0


def _calls(client: redis.Redis, command: str) -> int:
    """How many times Redis ran ``command`` since the last CONFIG RESETSTAT (scripts' calls
    included)."""
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_reply_keys_get_their_ttl_by_pexpireat_once_each(redis_client: redis.Redis) -> None:
    """The TTL is an absolute PEXPIREAT at Redis's clock (a PEXPIRE would be rewritten into one
    to propagate it, at 1,500 instructions a key): one a reply key, none relative."""
    ids = _pending(redis_client, 4)
    inbox = KEYS.inbox("p1")
    redis_client.config_resetstat()
    writer = ReplyWriter(redis_client, KEYS, TTL_S, ("m", "1"), Counters())
    writer.write(_answers(ids, [KEYS.reply("r0"), inbox, inbox, KEYS.reply("r3")]))
    assert (_calls(redis_client, "pexpireat"), _calls(redis_client, "pexpire")) == (3, 0)
    for key in (KEYS.reply("r0"), inbox, KEYS.reply("r3")):
        assert TTL_S * 1000 - 5000 < redis_client.pttl(key) <= TTL_S * 1000, key


#: The worker's reply-script grant before +pexpireat was added to docs/security.md.
OLD_GRANT = (
    "on",
    ">old-pw",
    "~inferfleet:{replies}:*",
    "-@all",
    "+evalsha",
    "+script|load",
    "+xack",
    "+rpush",
    "+pexpire",
    "+rpop",
    "+time",
)


def test_a_worker_whose_acl_lacks_pexpireat_still_gives_every_reply_its_ttl(
    redis_client: redis.Redis,
) -> None:
    """A grant written before +pexpireat: the script's PEXPIREAT is refused, and it falls back to
    PEXPIRE for that key and the rest of the call; every reply stands, with its TTL."""
    ids = _pending(redis_client, 4)
    inbox = KEYS.inbox("p1")
    redis_client.acl_setuser("oldgrant", reset=True)
    redis_client.execute_command("ACL", "SETUSER", "oldgrant", *OLD_GRANT)
    try:
        where = redis_client.connection_pool.connection_kwargs
        with redis.Redis(
            host=where["host"], port=where["port"], username="oldgrant", password="old-pw"
        ) as old:
            redis_client.config_resetstat()
            writer = ReplyWriter(old, KEYS, TTL_S, ("m", "1"), Counters())
            writer.write(_answers(ids, [KEYS.reply("r0"), KEYS.reply("r1"), inbox, inbox]))
            assert _calls(redis_client, "pexpire") == 3
            assert writer.counters.skipped == 0
    finally:
        redis_client.acl_deluser("oldgrant")
    assert redis_client.lrange(inbox, 0, -1) == [b"reply 2", b"reply 3"]
    for key in (KEYS.reply("r0"), KEYS.reply("r1"), inbox):
        assert TTL_S * 1000 - 5000 < redis_client.pttl(key) <= TTL_S * 1000, key
    assert redis_client.xpending(KEYS.requests, GROUP)["pending"] == 0
