"""The reply script on a real Redis: every answered reply key gets its TTL once; a full Redis answers nothing."""

from __future__ import annotations

import pytest
import redis

from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.worker.counters import Counters
from inferfleet.worker.serving.consumer import ensure_group
from inferfleet.worker.serving.intake import Answer
from inferfleet.worker.serving.replies import ReplyWriter

KEYS = QueueKeys("replies")
TTL_S = 60


def _pending(client: redis.Redis, count: int) -> list[bytes]:
    ensure_group(client, KEYS.requests)
    ids = [client.xadd(KEYS.requests, {"id": f"r{i}"}) for i in range(count)]
    client.xreadgroup(GROUP, "c1", {KEYS.requests: ">"}, count=count)
    return ids


def test_replies_to_a_shared_inbox_and_to_their_own_keys_all_get_the_ttl(redis_client: redis.Redis) -> None:
    ids = _pending(redis_client, 5)
    inbox = KEYS.inbox("p1")
    keys = [inbox, inbox, KEYS.reply("r2"), inbox, KEYS.reply("r4")]
    writer = ReplyWriter(redis_client, KEYS, TTL_S, ("m", "1"), Counters())
    writer.write([Answer(i, k, b"reply %d" % n, True, rid=f"r{n}") for n, (i, k) in enumerate(zip(ids, keys))])
    assert redis_client.lrange(inbox, 0, -1) == [b"reply 0", b"reply 1", b"reply 3"]
    for key in set(keys):
        assert 0 < redis_client.pttl(key) <= TTL_S * 1000, key
    assert redis_client.xpending(KEYS.requests, GROUP)["pending"] == 0


def test_a_full_redis_refuses_the_whole_call_and_the_round_is_retried(redis_client: redis.Redis) -> None:
    """Redis refuses a script's first write when over maxmemory and never a later one (it would
    leave half a call), so a full Redis answers nothing of the round: all of it stays pending."""
    ids = _pending(redis_client, 2)
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", 1)  # over the limit already
    try:
        writer = ReplyWriter(redis_client, KEYS, TTL_S, ("m", "1"), Counters())
        answers = [Answer(i, KEYS.reply(f"r{n}"), b"reply", True, rid=f"r{n}") for n, i in enumerate(ids)]
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            writer.write(answers)
    finally:
        redis_client.config_set("maxmemory", 0)
    assert not redis_client.exists(KEYS.reply("r0"), KEYS.reply("r1"))
    assert redis_client.xpending(KEYS.requests, GROUP)["pending"] == 2
    writer.write(answers)  # the retried round answers both, with their TTL
    assert all(0 < redis_client.pttl(KEYS.reply(f"r{n}")) <= TTL_S * 1000 for n in range(2))
