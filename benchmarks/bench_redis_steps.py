#!/usr/bin/env python3
"""redis-server's instructions per request, step by step (callgrind; issue "The per-request cost").

Where a request's time in Redis goes, each step measured alone on a private
redis-server under valgrind (benchmarks/callgrind_redis.py), so the figures
hold on a busy machine:

* ``xadd``: the SDK's ``submit_many`` (one-row affine inputs, the default deadline);
* ``xreadgroup``: reading those entries as a worker does, COUNT 256;
* ``script``: the fleet's reply script answering them in calls of 256, each
  reply to a key of its own (``submit``); ``script-inbox``: to one inbox (``map``);
* ``lpop``: popping each reply key once, as ``results`` does;
* ``lpop-script``: the same pops from a Lua loop, 1,000 keys a call (one round
  trip, but each ``redis.call`` costs Redis more than the command it saves);
* ``exists``: a trivial command on each key (what any command costs);
* the reply script's parts, as scripts of their own over the same calls:
  ``args`` (the call and its arguments, nothing run), ``xack`` (one XACK an
  entry), ``rpush`` (one RPUSH to a new key an entry) and ``rpush-pexpire``.

    python -m benchmarks.bench_redis_steps --requests 5120
    python -m benchmarks.bench_redis_steps --requests 5120 --config stream-node-max-bytes=1024
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import numpy as np
import redis

from benchmarks.callgrind_redis import CallgrindRedis, missing_tools
from inferfleet import Producer
from inferfleet.producer.protocol import GROUP, QueueKeys
from inferfleet.worker.serving.replies import REPLY_SCRIPT

NAME = "steps"
KEYS = QueueKeys(NAME)
BATCH = 256
PAYLOAD = b"\x85" + b"r" * 120  # about a one-row reply's size
#: The reply script's parts, each a script over the same KEYS and ARGV as the reply script.
PARTS = {
    "args": "return {0, {}}",
    "xack": "local call = redis.call\nfor i = 2, #KEYS do call('XACK', KEYS[1], ARGV[1], ARGV[2 * "
    "i - 1]) end\nreturn {0, {}}",
    "rpush": "local call = redis.call\nfor i = 2, #KEYS do call('RPUSH', KEYS[i], ARGV[2 * i]) "
    "end\nreturn {0, {}}",
    "rpush-pexpire": "local call = redis.call\nfor i = 2, #KEYS do call('RPUSH', KEYS[i], ARGV[2 * "
    "i]) call('PEXPIRE', KEYS[i], ARGV[2]) end\nreturn {0, {}}",
}


#: Redis settings (CONFIG SET) for every server of a run: --config NAME=VALUE.
CONFIG: dict[str, str] = {}


def submitted(server: CallgrindRedis, requests: int) -> tuple[list[str], int]:
    """Request ids of ``requests`` one-row affine requests sent by submit_many; the instructions it
    took."""
    client = redis.Redis.from_url(server.url)
    for name, value in CONFIG.items():
        client.config_set(name, value)
    client.xgroup_create(KEYS.requests, GROUP, id="0", mkstream=True)
    with Producer(server.url, NAME) as producer, server.counting() as count:
        rids = producer.submit_many([np.zeros((1, 16), np.float32)] * requests)
    return rids, count.instructions


def read_all(client: redis.Redis, requests: int) -> list[bytes]:
    """Entry ids of every request, read by consumer c in COUNT-256 reads (so each is pending on
    it)."""
    ids: list[bytes] = []
    while len(ids) < requests:
        ids += [
            entry_id
            for entry_id, _ in client.xreadgroup(GROUP, "c", {KEYS.requests: ">"}, count=BATCH)[0][
                1
            ]
        ]
    return ids


def call_script(client: redis.Redis, script: str, ids: list[bytes], keys: list[str]) -> None:
    """``script`` over ``ids`` in calls of 256, each with its reply key and PAYLOAD (the reply
    script's shape)."""
    sha = client.script_load(script)
    for start in range(0, len(ids), BATCH):
        part, part_keys = ids[start : start + BATCH], keys[start : start + BATCH]
        args: list = [GROUP, 300_000]
        for entry_id in part:
            args += [entry_id, PAYLOAD]
        client.evalsha(sha, len(part) + 1, KEYS.requests, *part_keys, *args)


def per_key(client: redis.Redis, command: str, keys: list[str]) -> None:
    """``command`` on each key, pipelined a thousand at a time."""
    for start in range(0, len(keys), 1000):
        pipe = client.pipeline(transaction=False)
        for key in keys[start : start + 1000]:
            pipe.execute_command(command, key)
        pipe.execute()


#: LPOP of each of KEYS from one script call.
LPOP_LOOP = (
    "local popped = {}\n"
    "for i = 1, #KEYS do popped[i] = redis.call('LPOP', KEYS[i]) end\n"
    "return popped"
)


def lpop_script(client: redis.Redis, keys: list[str]) -> None:
    """Each of ``keys`` popped by a Lua loop, a thousand keys a call; every key must hold its
    reply."""
    sha = client.script_load(LPOP_LOOP)
    for start in range(0, len(keys), 1000):
        part = keys[start : start + 1000]
        if None in client.evalsha(sha, len(part), *part):
            raise RuntimeError("a reply key was empty when the script popped it")


def measure(requests: int) -> dict[str, float]:
    """Each step's instructions per request, in the order a request meets them."""
    figures: dict[str, float] = {}
    with CallgrindRedis() as server:
        client = redis.Redis.from_url(server.url)
        rids, spent = submitted(server, requests)
        figures["xadd"] = spent
        with server.counting() as count:
            ids = read_all(client, requests)
        figures["xreadgroup"] = count.instructions
        own = [KEYS.reply(rid) for rid in rids]
        half = (
            requests // 2
        )  # the pipelined pops take the first half of the replies, the script the rest
        steps: list[tuple[str, int, Callable[[], None]]] = [  # (name, requests it serves, the step)
            ("script", requests, lambda: call_script(client, REPLY_SCRIPT, ids, own)),
            ("lpop", half, lambda: per_key(client, "LPOP", own[:half])),
            ("lpop-script", requests - half, lambda: lpop_script(client, own[half:])),
            ("exists", requests, lambda: per_key(client, "EXISTS", own)),
        ]
        for name, served, step in steps:
            with server.counting() as count:
                step()
            figures[name] = (
                count.instructions * requests / served
            )  # a whole run's worth, as the others
        if client.xpending(KEYS.requests, GROUP)["pending"] or client.exists(*own[:1000]):
            raise RuntimeError("the reply script left entries pending or the pops left replies")
    figures["script-inbox"] = _on_fresh_entries(requests, REPLY_SCRIPT, inbox=True)
    for name, script in PARTS.items():
        figures[name] = _on_fresh_entries(requests, script, inbox=False)
    return {name: spent / requests for name, spent in figures.items()}


def _on_fresh_entries(requests: int, script: str, inbox: bool) -> int:
    """Instructions of ``script`` over ``requests`` freshly read entries (own reply keys, or one
    inbox)."""
    with CallgrindRedis() as server:
        client = redis.Redis.from_url(server.url)
        rids, _ = submitted(server, requests)
        ids = read_all(client, requests)
        keys = [KEYS.inbox("one")] * requests if inbox else [KEYS.reply(rid) for rid in rids]
        with server.counting() as count:
            call_script(client, script, ids, keys)
    return count.instructions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5120)
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a Redis setting for every server of the run (CONFIG SET), repeatable",
    )
    args = parser.parse_args()
    if args.requests < BATCH:
        parser.error(f"--requests must be at least {BATCH}")
    if missing_tools():
        parser.error(missing_tools())
    for setting in args.config:
        name, equals, value = setting.partition("=")
        if not equals or not name:
            parser.error(f"--config takes NAME=VALUE, got {setting!r}")
        CONFIG[name] = value
    try:
        figures = measure(args.requests)
    except redis.exceptions.ResponseError as exc:  # a --config Redis refused, most likely
        sys.exit(f"Redis refused: {exc}")
    print(f"redis-server instructions per request, {args.requests:,} requests")
    for name, value in figures.items():
        print(f"{name:14s} {value:8.0f}")


if __name__ == "__main__":
    main()
