"""Sharding: the shard function, shard key names and the producer's routing (no network)."""

from __future__ import annotations

import zlib

import pytest
import redis

from inferfleet.producer import Producer
from inferfleet.producer.base import sum_shards
from inferfleet.producer.bulk import InFlight
from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import MAX_SHARDS, shard_for, shard_keys, shard_name


def test_shard_for_is_crc32_ieee_of_the_utf8_bytes_mod_shards() -> None:
    # the CRC-32/IEEE check value: crc32("123456789") = 0xCBF43926 = 3421780262
    assert zlib.crc32(b"123456789") == 0xCBF43926
    assert [shard_for("123456789", s) for s in (1, 2, 3, 7, 16, 1024)] == [0, 0, 2, 5, 6, 294]
    # values any other implementation must reproduce (crc32: a 3904355907, req-1 1829706545)
    assert [shard_for("a", s) for s in (2, 3, 16)] == [1, 0, 3]
    assert [shard_for("req-1", s) for s in (2, 3, 16)] == [1, 2, 1]


def test_shard_for_spreads_ids_over_every_shard() -> None:
    counts = [0] * 8
    for i in range(8000):
        counts[shard_for(f"0a1b2c3d4e5f-{i:x}", 8)] += 1
    assert min(counts) > 800  # about 1000 each


@pytest.mark.parametrize("shards", [0, -1, MAX_SHARDS + 1, 2.0, True, "2"])
def test_shard_count_outside_1_to_1024_is_refused(shards: object) -> None:
    with pytest.raises(ProtocolError, match="shards must be an integer from 1 to 1024"):
        shard_for("r", shards)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="shards must be an integer from 1 to 1024"):
        shard_keys("q", shards)  # type: ignore[arg-type]


def test_shard_keys_are_the_keys_of_queues_named_name_dot_shard() -> None:
    keys = shard_keys("ctr", 3, prefix="pfx")
    assert [k.name for k in keys] == ["ctr.0", "ctr.1", "ctr.2"]
    assert keys[2].requests == "pfx:{ctr.2}:requests"
    assert keys[2].reply("r1") == "pfx:{ctr.2}:reply:r1"
    assert keys[2].dead == "pfx:{ctr.2}:dead"
    assert keys[2].inbox("p-1") == "pfx:{ctr.2}:inbox:p-1"


def test_one_shard_is_the_unsharded_queue() -> None:
    (keys,) = shard_keys("ctr", 1)
    assert keys.requests == "inferfleet:{ctr}:requests"
    assert shard_name("ctr", 0, 1) == "ctr"
    assert shard_keys("ctr") == (keys,)  # unsharded unless asked


def test_a_name_too_long_for_its_shard_suffix_is_refused_clearly() -> None:
    assert shard_name("n" * 62, 9, 10) == "n" * 62 + ".9"  # 64 characters: fits
    with pytest.raises(ProtocolError, match=r"too long for 11 shards: .* use at most 61"):
        shard_keys("n" * 62, 11)
    with pytest.raises(ProtocolError, match=r"shard names such as n{62}\.10 must fit 64 "):
        shard_keys("n" * 62, 11)  # names the longest shard name, the last one
    with pytest.raises(ProtocolError, match="shard must be an integer from 0 to 2"):
        shard_name("q", 3, 3)


def _producer(shards: int) -> Producer:
    # never connects: the client is lazy and these tests send nothing
    return Producer(name="ctr", shards=shards, client=redis.Redis(host="127.0.0.1", port=1))


def test_producer_routes_a_request_and_its_reply_by_id() -> None:
    producer = _producer(4)
    assert (
        producer.keys_for("123456789").requests == "inferfleet:{ctr.2}:requests"
    )  # 3421780262 % 4
    assert producer.keys_for("123456789").reply("123456789") == "inferfleet:{ctr.2}:reply:123456789"
    _, keys, fields = producer._entry([[1.0]], None, None, "123456789", to_inbox=True)
    assert keys.name == "ctr.2"
    assert fields["reply_to"] == producer.inboxes[2] and producer.inboxes[2].startswith(
        "inferfleet:{ctr.2}:inbox:"
    )
    with pytest.raises(ProtocolError, match="the shard of request"):
        producer._entry([[1.0]], None, None, "123456789", reply_to=producer.inboxes[0])


def test_unsharded_producer_keeps_the_queue_own_keys() -> None:
    producer = _producer(1)
    assert producer.keys.requests == "inferfleet:{ctr}:requests"
    assert producer.inboxes == (producer.inbox,)
    assert producer.keys_for("anything").name == "ctr"


def test_lag_and_backlog_sum_over_shards() -> None:
    group = [{"name": b"workers", "lag": 3}]
    unknown = [{"name": b"workers", "lag": None}]
    assert sum_shards([5, 0, 7], [group, [], group]) == (6, 6)
    assert sum_shards([5, 7], [group, unknown]) == (None, 10)  # unknown: its length
    assert sum_shards([4], [[]]) == (4, 4)  # no group yet: all of it waits


def test_in_flight_counts_per_shard_and_ignores_stale_replies() -> None:
    in_flight = InFlight(3)
    in_flight.add("a", 2, 0)
    in_flight.add("b", 0, 1)
    in_flight.add("c", 2, 2)
    assert in_flight.shards() == [0, 2]
    assert in_flight.pop("c") == 2 and in_flight.pop("zzz") is None
    assert in_flight.pop("b") == 1 and in_flight.shards() == [2] and len(in_flight) == 1


def test_a_cluster_client_blocks_on_one_shard_inbox_in_turn() -> None:
    from inferfleet.producer.reader import ReadPlan

    producer = _producer(3)

    def blocked(plan: ReadPlan) -> tuple[str, ...]:
        blpop, *lpops = plan.round([0, 2]).commands()
        assert [c[1] for c in lpops] == [producer.inboxes[0], producer.inboxes[2]]
        return tuple(blpop[1:-1])

    assert blocked(ReadPlan(producer.inboxes, False)) == producer.inboxes  # every inbox at once
    cluster = ReadPlan(producer.inboxes, True)  # one BLPOP cannot span slots
    turns = {blocked(cluster) for _ in range(4)}
    assert turns == {(producer.inboxes[0],), (producer.inboxes[2],)}


def test_the_shard_table_of_docs_protocol_md_is_what_shard_for_computes() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## Sharding") : doc.index("## Limits of this worker")]
    rows = [line for line in section.splitlines() if line.startswith("| `") and "|" in line[3:]]
    checked = 0
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 7 or not cells[1][0].isdigit():
            continue  # the key table, the header
        rid = cells[0].strip("`")
        assert int(cells[1].split()[0]) == zlib.crc32(rid.encode())
        assert [int(c) for c in cells[2:]] == [shard_for(rid, s) for s in (2, 3, 4, 7, 16)]
        checked += 1
    assert checked == 3
