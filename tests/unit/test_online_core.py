"""The online path's pure parts: who waits for which reply, and concurrent writes sent together.

No Redis: :class:`Waiting` is a table, and the write batchers are driven with a
``send`` function that records each round and answers each command.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from inferfleet.producer import errors
from inferfleet.producer.connections import translate_errors
from inferfleet.producer.protocol import encode_reply_ok
from inferfleet.producer.reader import lost_replies
from inferfleet.producer.transport import Round
from inferfleet.producer.waiting import Waiting, popped_replies, queue_reads
from inferfleet.producer.writes import AsyncWriteBatcher, WriteBatcher

X = np.ones((1, 2), np.float32)


def ok(rid: str) -> bytes:
    return encode_reply_ok(rid, X, ("q", "1"), {"batch_rows": 1})


# --------------------------------------------------------------------------- Waiting


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.randoms())
def test_every_reply_goes_to_the_call_that_sent_it_and_to_no_other(owners, rnd) -> None:
    """Calls 0..5 wait for ids; replies come shuffled with stale ones: each call gets exactly its
    own, once, and the table ends empty."""
    waiting = Waiting(2)
    got: dict[int, list[str]] = {}
    sinks = {
        call: (lambda replies, c=call: got.setdefault(c, []).extend(replies))
        for call in set(owners)
    }
    rids = [f"r{i}" for i in range(len(owners))]
    for rid, call in zip(rids, owners):
        waiting.add(sinks[call], [rid], len(rid) % 2)
    raws = [ok(rid) for rid in rids] + [ok("stale-a"), ok("stale-b")]
    rnd.shuffle(raws)
    routed = waiting.route(raws)
    assert len({id(sink) for sink, _ in routed}) == len(routed)  # each call handed its batch once
    for sink, replies in routed:
        sink(replies)
    for call in set(owners):
        mine = [rid for rid, owner in zip(rids, owners) if owner == call]
        assert sorted(r.id for r in got[call]) == sorted(mine)
    assert len(waiting) == 0 and waiting.shards() == [] and waiting.dropped == 2


def test_discarded_ids_are_dropped_when_their_reply_comes_late() -> None:
    waiting = Waiting(1)
    seen: list = []
    waiting.add(seen.extend, ["a", "b"], 0)
    waiting.discard(["a", "nobody"])
    assert waiting.shards() == [0] and len(waiting) == 1
    routed = waiting.route([ok("a"), ok("b")])
    assert [[r.id for r in replies] for _, replies in routed] == [["b"]]
    assert waiting.dropped == 1 and waiting.shards() == []


def test_an_id_awaited_twice_is_refused() -> None:
    waiting = Waiting(1)
    waiting.add(print, ["a"], 0)
    with pytest.raises(ValueError, match="already awaited"):
        waiting.add(print, ["b", "a"], 0)
    assert len(waiting) == 1  # nothing of the refused call is added


def test_clear_returns_each_waiting_sink_once() -> None:
    waiting = Waiting(3)
    one, two = [].append, [].append
    waiting.add(one, ["a"], 0)
    waiting.add(one, ["b"], 2)
    waiting.add(two, ["c"], 1)
    assert sorted(map(id, waiting.clear())) == sorted([id(one), id(two)])
    assert len(waiting) == 0 and waiting.shards() == []


def test_a_read_round_blocks_then_pops_each_waiting_inbox() -> None:
    round_ = Round()
    queue_reads(round_, ["i0", "i1", "i2"], ["i0", "i1", "i2"], 1.0, [0, 2])
    assert list(round_.commands()) == [
        ("BLPOP", "i0", "i1", "i2", "1.000"),
        ("LPOP", "i0", 1000),
        ("LPOP", "i2", 1000),
    ]
    assert popped_replies([[b"i1", b"x"], [b"y", b"z"], None]) == [b"x", b"y", b"z"]
    assert popped_replies([None, None, [b"w"]]) == [b"w"]


def test_a_lost_read_says_what_was_lost_and_what_to_do() -> None:
    lost = lost_replies(redis.exceptions.ConnectionError("Connection reset by peer"))
    assert isinstance(lost, errors.ConnectionError)
    assert "lost" in str(lost) and "send again" in str(lost)
    refused = lost_replies(redis.exceptions.ResponseError("NOPERM no rights on BLPOP"))
    assert type(refused) is errors.InferfleetError and "NOPERM" in str(refused)


def test_a_full_redis_is_queue_full() -> None:
    with pytest.raises(errors.QueueFull, match="out of memory") as raised:
        with translate_errors():
            raise redis.exceptions.OutOfMemoryError(
                "OOM command not allowed when used memory > 'maxmemory'."
            )
    assert raised.value.backlog is None


# --------------------------------------------------------------------------- WriteBatcher


class GatedSend:
    """A send whose first round blocks until released: writes arriving meanwhile queue up."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.rounds: list[list[str]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.refuse = refuse

    def __call__(self, round_: Round) -> list:
        commands = [args[1] for args in round_.commands()]
        self.rounds.append(commands)
        if len(self.rounds) == 1:
            self.entered.set()
            self.gate.wait(10)
        return [
            redis.exceptions.ResponseError(f"refused {c}") if c in self.refuse else f"ok-{c}"
            for c in commands
        ]


def test_writes_that_arrive_during_a_round_go_out_together_each_with_its_own_reply() -> None:
    send = GatedSend(refuse=frozenset({"w3"}))
    batcher = WriteBatcher(send)
    outcomes: dict[str, object] = {}

    def write(name: str) -> None:
        try:
            outcomes[name] = batcher.write(["CMD", name])
        except redis.exceptions.ResponseError as exc:
            outcomes[name] = exc

    first = threading.Thread(target=write, args=("w0",))
    first.start()
    assert send.entered.wait(10)
    others = [threading.Thread(target=write, args=(f"w{i}",)) for i in range(1, 9)]
    for thread in others:
        thread.start()
    while len(batcher._pending) < 8:  # every other write queued behind the first round
        threading.Event().wait(0.001)
    send.gate.set()
    for thread in [first, *others]:
        thread.join(10)
    assert send.rounds[0] == ["w0"] and sorted(send.rounds[1]) == [f"w{i}" for i in range(1, 9)]
    assert len(send.rounds) == 2 and batcher.commands == 9
    assert isinstance(outcomes.pop("w3"), redis.exceptions.ResponseError)  # its own refusal only
    assert outcomes == {name: f"ok-{name}" for name in outcomes}


def test_a_failed_round_fails_each_of_its_writes_and_the_next_round_goes_out() -> None:
    calls = []

    def send(round_: Round) -> list:
        calls.append(1)
        if len(calls) == 1:
            raise redis.exceptions.ConnectionError("gone")
        return ["ok"] * round_.replies

    batcher = WriteBatcher(send)
    with pytest.raises(redis.exceptions.ConnectionError):
        batcher.write(["CMD", "a"])
    assert batcher.write(["CMD", "b"]) == "ok" and not batcher._busy


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 24), st.integers(1, 20))
def test_threads_each_get_their_own_reply_however_writes_are_grouped(threads, each) -> None:
    def send(round_: Round) -> list:
        return [f"re-{args[1]}" for args in round_.commands()]

    batcher = WriteBatcher(send)
    wrong: list[str] = []

    def run(t: int) -> None:
        for i in range(each):
            name = f"{t}.{i}"
            if batcher.write(["CMD", name]) != f"re-{name}":
                wrong.append(name)

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(30)
    assert wrong == [] and batcher.commands == threads * each and not batcher._busy


def test_async_writes_of_one_tick_are_one_round_and_a_cancelled_caller_does_not_break_it() -> None:
    rounds: list[list[str]] = []

    async def send(round_: Round) -> list:
        rounds.append([args[1] for args in round_.commands()])
        await asyncio.sleep(0)
        return [
            redis.exceptions.ResponseError("no") if name == "bad" else f"ok-{name}"
            for name in rounds[-1]
        ]

    async def main() -> tuple:
        batcher = AsyncWriteBatcher(send)
        tasks = [asyncio.ensure_future(batcher.write(["CMD", f"w{i}"])) for i in range(10)]
        bad = asyncio.ensure_future(batcher.write(["CMD", "bad"]))
        tasks[4].cancel()
        done = await asyncio.gather(*tasks, bad, return_exceptions=True)
        return done, await batcher.write(["CMD", "later"])

    done, later = asyncio.run(main())
    assert rounds == [[f"w{i}" for i in range(10) if i != 4] + ["bad"], ["later"]]
    assert isinstance(done[4], asyncio.CancelledError)
    assert isinstance(done[10], redis.exceptions.ResponseError)
    assert [d for i, d in enumerate(done[:10]) if i != 4] == [
        f"ok-w{i}" for i in range(10) if i != 4
    ]
    assert later == "ok-later"
