"""Durability as a choice (issue 33), on a real primary and its real replica: with
:class:`~inferfleet.producer.Durability` a write counts as accepted only once the replica
confirms it (``WAIT``), and a worker with ``--wait-replicas`` waits the same way after each
round of replies. The replica is frozen (SIGSTOP) to make it fall behind for sure."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import redis

from inferfleet.producer import AsyncProducer, Durability, NotReplicated, Producer
from inferfleet.producer.protocol import QueueKeys
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.runtime.loading import load_runtime
from inferfleet.worker.serving.consumer import Consumer
from tests.helpers import drain, wait_until

#: short, so that a frozen replica fails a write quickly
QUICK = Durability(replicas=1, timeout_ms=300)


class Pair:
    """A primary and its replica (``--replicaof``), the link up."""

    def __init__(self) -> None:
        self.primary = EmbeddedRedis().start()
        args = ("--replicaof", "127.0.0.1", str(self.primary.port))
        self.replica = EmbeddedRedis(extra_args=args).start()
        self.primary_client = redis.Redis(port=self.primary.port)
        self.replica_client = redis.Redis(port=self.replica.port)
        wait_until(
            lambda: self.replica_client.info("replication")["master_link_status"] == "up",
            30,
            "the replica's link to the primary",
        )

    @contextmanager
    def frozen_replica(self) -> Iterator[None]:
        """The replica stopped (it confirms nothing) for the block."""
        os.kill(self.replica.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        try:
            yield
        finally:
            os.kill(self.replica.pid, signal.SIGCONT)  # type: ignore[arg-type]

    def on_replica(self, stream: str, rid: str) -> bool:
        """Whether the replica holds the request ``rid`` in ``stream`` now."""
        return any(
            fields[b"id"] == rid.encode() for _, fields in self.replica_client.xrange(stream)
        )

    def close(self) -> None:
        self.replica.stop()
        self.primary.stop()


@pytest.fixture
def pair() -> Iterator[Pair]:
    found = Pair()
    try:
        yield found
    finally:
        found.close()


def test_a_durable_request_is_on_the_replica_when_submit_returns(pair: Pair) -> None:
    keys = QueueKeys("dur")
    x = np.ones((1, 4), np.float32)
    with Producer(pair.primary.url, "dur", durability=QUICK) as durable:
        with Producer(pair.primary.url, "dur") as plain, pair.frozen_replica():
            quick = plain.submit(x)  # the positive control: accepted without the replica
            with pytest.raises(NotReplicated, match="0 of the 1 replicas"):
                durable.submit(x)
            with pytest.raises(NotReplicated):
                durable.submit_many([x, x])
        assert pair.on_replica(keys.requests, quick)  # once the replica runs again
        rid = durable.submit(x)  # the replica runs again: confirmed, and there already
        assert pair.on_replica(keys.requests, rid)
        rids = durable.submit_many([x] * 5)
        assert all(pair.on_replica(keys.requests, one) for one in rids)


def test_a_durable_map_raises_when_no_replica_confirms(pair: Pair) -> None:
    x = np.ones((1, 4), np.float32)
    with Producer(pair.primary.url, "dmap", durability=QUICK) as durable, pair.frozen_replica():
        with pytest.raises(NotReplicated):
            list(durable.imap([x] * 3, timeout_s=5))


def test_the_async_producer_waits_for_the_replica_too(pair: Pair) -> None:
    keys = QueueKeys("adur")
    x = np.ones((1, 4), np.float32)

    async def main() -> tuple[str, list[str]]:
        async with AsyncProducer(pair.primary.url, "adur", durability=QUICK) as durable:
            with pair.frozen_replica():
                with pytest.raises(NotReplicated):
                    await durable.submit(x)
                with pytest.raises(NotReplicated):
                    await durable.submit_many([x, x])
            return await durable.submit(x), await durable.submit_many([x] * 3)

    one, many = asyncio.run(main())
    assert all(pair.on_replica(keys.requests, rid) for rid in [one, *many])


def test_bad_durability_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="WAIT 0 blocks for ever"):
        Durability(1, 0)
    with pytest.raises(ValueError, match="at least 1"):
        Durability(0)
    with pytest.raises(TypeError, match="Durability or None"):
        Producer("redis://127.0.0.1:1", "x", durability=1)  # type: ignore[arg-type]


def _consumer(url: str, models_dir, model: str, **overrides) -> Consumer:
    settings = WorkerSettings(
        name="wdur",
        model=str(models_dir / model) if model.endswith(".pt") else model,
        redis_url=url,
        consumer="c1",
        warmup_iters=1,
        idle_block_ms=50,
        wait_replicas=1,
        wait_timeout_ms=300,
        **overrides,
    )
    consumer = Consumer(settings, load_runtime(settings), redis.Redis.from_url(url))
    consumer.prepare()
    return consumer


@pytest.mark.parametrize("model", ["affine.pt", "tests.handlers:Scale"])
def test_a_worker_waits_for_its_replies_to_reach_the_replica(
    pair: Pair, models_dir, model: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Both reply paths (the packed fast path of a TorchScript model, the script call of a
    handler): replies confirmed by the replica are there when the round ends; with the
    replica frozen the worker still answers, and counts and logs the shortfall."""
    width = 16 if model.endswith(".pt") else 4
    x = np.ones((1, width), np.float32)
    consumer = _consumer(pair.primary.url, models_dir, model)
    keys = consumer.keys
    with Producer(pair.primary.url, "wdur") as producer:
        rids = producer.submit_many([x] * 4)
        drain(consumer)
        assert all(pair.replica_client.llen(keys.reply(rid)) == 1 for rid in rids)
        assert "not confirmed" not in caplog.text
        with pair.frozen_replica():
            late = producer.submit_many([x] * 2)
            with caplog.at_level(logging.WARNING):
                drain(consumer)
            assert all(pair.primary_client.llen(keys.reply(rid)) == 1 for rid in late)
        assert "replies not confirmed by 1 replicas within 300 ms" in caplog.text
        wait_until(
            lambda: all(pair.replica_client.llen(keys.reply(rid)) == 1 for rid in late),
            30,
            "the replies reaching the replica once it runs again",
        )


def test_wait_replicas_is_checked_like_every_setting() -> None:
    from inferfleet.worker.errors import ConfigError

    with pytest.raises(ConfigError, match="wait_timeout_ms must be a number from 1"):
        WorkerSettings(name="q", model="m.pt", wait_replicas=1, wait_timeout_ms=0)
    settings = WorkerSettings(name="q", model="m.pt", wait_replicas=2, wait_timeout_ms=50)
    assert settings.durability == Durability(2, 50)
    assert WorkerSettings(name="q", model="m.pt").durability is None


def test_a_user_needs_wait_granted_and_is_told_so_when_it_is_not(pair: Pair) -> None:
    """WAIT is one more command for the producer's (and the worker's) ACL user: granted, a
    durable submit works; refused, the write fails with Redis's NOPERM, not NotReplicated."""
    from inferfleet.producer import InferfleetError

    base = ["on", ">pw", "-@all", "+xadd", "~inferfleet:{acl}:requests*"]
    base.append("(+exists ~inferfleet:{acl}:limits)")  # the documented producer reads it
    pair.primary_client.execute_command("ACL", "SETUSER", "granted", *base, "+wait")
    pair.primary_client.execute_command("ACL", "SETUSER", "refused", *base)
    url = f"redis://{{user}}:pw@127.0.0.1:{pair.primary.port}/0"
    x = np.ones((1, 4), np.float32)
    with Producer(url.format(user="granted"), "acl", durability=QUICK) as granted:
        assert pair.on_replica(QueueKeys("acl").requests, granted.submit(x))
    with Producer(url.format(user="refused"), "acl", durability=QUICK) as refused:
        with pytest.raises(InferfleetError, match=r"(?i)noperm|permission") as caught:
            refused.submit(x)
        assert not isinstance(caught.value, NotReplicated)
