#!/usr/bin/env python3
"""redis-server's CPU per entry for the reply script and its yardsticks (issue "The per-request
cost").

The fleet answers a round with one call of the reply script
(worker/serving/replies.py): RPUSH the reply, XACK the entry, take the reply
back if the XACK found it answered, give each reply key its TTL once. This
measures what Redis spends per entry on that call and on the yardsticks
below, on entries really pending in a stream (a private redis-server; its CPU
time from /proc). The experiments that lost to the script (inline, grouped,
runs, pcheck, xclaim, pexpire, the previous script) were retired; their
figures stay in docs/benchmarks.md, their code in this file's history.

* ``script``: the fleet's script, each entry to its own reply key (``submit``);
* ``script-inbox``: the same, every reply to one inbox (``map``: one PEXPIRE a call);
* ``function``: the same script as a Redis Function (FCALL);
* ``no-expire``: without a TTL (what the TTL costs);
* ``plain``: RPUSH + EXPIRE per reply and one XACK for the batch in a
  pipeline, no exactly-once check (the plain worker's commands).

    python -m benchmarks.bench_reply_script --entries 100000 --batch 256 --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics

import redis

from benchmarks.callgrind_redis import CallgrindRedis, missing_tools
from inferfleet.producer.protocol import GROUP
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.serving.replies import REPLY_SCRIPT

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
STREAM = "inferfleet:{b}:requests"
PAYLOAD = b"\x85" + b"r" * 120  # about a one-row reply's size


def _changed(script: str, old: str, new: str) -> str:
    """``script`` with every ``old`` replaced by ``new``; refused if there is none (a variant must
    differ)."""
    if old not in script:
        raise ValueError(f"{old!r} is not in the script")
    return script.replace(old, new)


NO_EXPIRE = _changed(REPLY_SCRIPT, "pcall(expire, key, when) ~= 1", "false")
FUNCTION = (
    "#!lua name=inferfleet_bench\n"
    "local function reply(KEYS, ARGV)\n" + REPLY_SCRIPT + "\nend\n"
    "redis.register_function('reply', reply)\n"
)


#: The scripts by variant name; each is also measured as NAME-inbox (every reply to one inbox, as
#: ``map``).
SCRIPTS = {
    "script": REPLY_SCRIPT,
    "no-expire": NO_EXPIRE,
}
#: Every variant --variants may name.
VARIANTS = (*SCRIPTS, *(f"{name}-inbox" for name in SCRIPTS), "function", "plain")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def pending_entries(client: redis.Redis, entries: int) -> list[bytes]:
    """``entries`` entries added and read by consumer c (so each is pending on it)."""
    client.delete(STREAM)
    client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    for start in range(0, entries, 5000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(start + 5000, entries)):
            pipe.xadd(STREAM, {"id": f"r{i}", "body": b"x"})
        pipe.execute()
    ids: list[bytes] = []
    while len(ids) < entries:
        read = client.xreadgroup(GROUP, "c", {STREAM: ">"}, count=10000)
        ids += [entry_id for entry_id, _ in read[0][1]]
    return ids


def answer(client: redis.Redis, variant: str, ids: list[bytes], batch: int) -> None:
    sha = client.script_load(SCRIPTS.get(variant.removesuffix("-inbox"), REPLY_SCRIPT))
    for start in range(0, len(ids), batch):
        part = ids[start : start + batch]
        keys = (
            ["inferfleet:{b}:inbox:one"] * len(part)
            if variant.endswith("-inbox")
            else [f"inferfleet:{{b}}:reply:{entry_id.decode()}" for entry_id in part]
        )
        if variant == "plain":
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.rpush(key, PAYLOAD)
                pipe.expire(key, 300)
            pipe.xack(STREAM, GROUP, *part)
            pipe.execute()
            continue
        args: list = [GROUP, 300_000]
        for entry_id in part:
            args += [entry_id, PAYLOAD]
        if variant == "function":
            client.fcall("reply", len(keys) + 1, STREAM, *keys, *args)
        else:
            client.evalsha(sha, len(keys) + 1, STREAM, *keys, *args)


def run(variant: str, args: argparse.Namespace) -> float:
    """redis-server's CPU us (or, with --callgrind, instructions) per entry answering with
    ``variant``."""
    with CallgrindRedis() if args.callgrind else EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        if variant == "function":
            client.function_load(FUNCTION, replace=True)
        ids = pending_entries(client, args.entries)
        if isinstance(server, CallgrindRedis):
            with server.counting() as count:
                answer(client, variant, ids, args.batch)
            spent = count.instructions / args.entries
        else:
            before = cpu_s(server.pid)
            answer(client, variant, ids, args.batch)
            spent = (cpu_s(server.pid) - before) / args.entries * 1e6
        assert client.xpending(STREAM, GROUP)["pending"] == 0, "every entry acknowledged"
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="count redis-server's instructions under valgrind instead of its CPU time "
        "(the same count on a busy machine; use a few thousand entries and --runs 1)",
    )
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.callgrind and missing_tools():
        parser.error(missing_tools())
    results: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.runs):  # interleaved, so a noisy minute touches every variant
        for variant in variants:
            results[variant].append(run(variant, args))
    unit, digits = ("instructions", 0) if args.callgrind else ("CPU us", 2)
    print(
        f"redis-server {unit} per entry, {args.entries:,} entries in calls of {args.batch}, "
        f"median of {args.runs}"
    )
    for variant, runs in results.items():
        print(
            f"{variant:18s} {statistics.median(runs):8.{digits}f}   "
            f"({', '.join(f'{r:.{digits}f}' for r in runs)})"
        )


if __name__ == "__main__":
    main()
