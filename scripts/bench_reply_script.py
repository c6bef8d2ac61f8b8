#!/usr/bin/env python3
"""redis-server's CPU per entry for variants of the reply script (issue "The per-request cost").

The fleet answers a round with one call of the reply script
(worker/serving/replies.py): RPUSH the reply, XACK the entry, take the reply
back if the XACK found it answered, PEXPIRE each reply key once. This
measures what Redis spends per entry on that call and on variants of it, on
entries really pending in a stream (a private redis-server; its CPU time from
/proc):

* ``script``: the fleet's script, each entry to its own reply key (``submit``);
* ``script-inbox``: the same, every reply to one inbox (``map``: one PEXPIRE a call);
* ``function``: the same script as a Redis Function (FCALL);
* ``inline``, ``inline-inbox``: PEXPIRE right after each answered push,
  skipped while the key repeats the previous one (no table of keys);
* ``no-expire``: without PEXPIRE (what the TTL costs);
* ``plain``: RPUSH + EXPIRE per reply and one XACK for the batch in a
  pipeline, no exactly-once check (the plain worker's commands).

    python scripts/bench_reply_script.py --entries 100000 --batch 256 --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inferfleet.producer.protocol import GROUP  # noqa: E402
from inferfleet.worker.embedded import EmbeddedRedis  # noqa: E402
from inferfleet.worker.serving.replies import REPLY_SCRIPT  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
STREAM = "inferfleet:{b}:requests"
PAYLOAD = b"\x85" + b"r" * 120  # about a one-row reply's size
#: PEXPIRE right after each answered push, skipped while the key repeats the last one (an inbox)
INLINE = """
local stream, group, ttl = KEYS[1], ARGV[1], ARGV[2]
local pushed, failed, last = 0, {}, nil
for i = 2, #KEYS do
  local id, payload = ARGV[2 * i - 1], ARGV[2 * i]
  if payload == '' then
    redis.call('XACK', stream, group, id)
  else
    local res = redis.pcall('RPUSH', KEYS[i], payload)
    if type(res) == 'table' and res.err then
      if string.sub(res.err, 1, 9) ~= 'WRONGTYPE' then
        return redis.error_reply(res.err)
      end
      table.insert(failed, i - 2)
    elseif redis.call('XACK', stream, group, id) == 1 then
      if KEYS[i] ~= last then
        redis.call('PEXPIRE', KEYS[i], ttl)
        last = KEYS[i]
      end
      pushed = pushed + 1
    else
      redis.call('RPOP', KEYS[i])
    end
  end
end
return {pushed, failed}
"""
GROUPED = open("/tmp/probe/grouped.lua").read()
RUNS = open("/tmp/probe/runs.lua").read()
NO_EXPIRE = REPLY_SCRIPT.replace("redis.call('PEXPIRE', key, ttl)", "local _ = key")
FUNCTION = ("#!lua name=inferfleet_bench\n"
            "local function reply(KEYS, ARGV)\n" + REPLY_SCRIPT + "\nend\n"
            "redis.register_function('reply', reply)\n")


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
    scripts = {"script": REPLY_SCRIPT, "script-inbox": REPLY_SCRIPT, "no-expire": NO_EXPIRE,
               "inline": INLINE, "inline-inbox": INLINE, "grouped": GROUPED, "grouped-inbox": GROUPED,
               "runs": RUNS, "runs-inbox": RUNS}
    sha = client.script_load(scripts.get(variant, REPLY_SCRIPT))
    for start in range(0, len(ids), batch):
        part = ids[start:start + batch]
        keys = ["inferfleet:{b}:inbox:one"] * len(part) if variant.endswith("-inbox") \
            else [f"inferfleet:{{b}}:reply:{entry_id.decode()}" for entry_id in part]
        if variant == "plain":
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.rpush(key, PAYLOAD)
                pipe.expire(key, 300)
            pipe.xack(STREAM, GROUP, *part)
            pipe.execute()
            continue
        args: list = [GROUP, 300_000]
        if variant.startswith("runs"):
            args += part + [PAYLOAD] * len(part)
        else:
            for entry_id in part:
                args += [entry_id, PAYLOAD]
        if variant == "function":
            client.fcall("reply", len(keys) + 1, STREAM, *keys, *args)
        else:
            client.evalsha(sha, len(keys) + 1, STREAM, *keys, *args)


def run(variant: str, args: argparse.Namespace) -> float:
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        if variant == "function":
            client.function_load(FUNCTION, replace=True)
        ids = pending_entries(client, args.entries)
        before = cpu_s(server.pid)
        answer(client, variant, ids, args.batch)
        spent = cpu_s(server.pid) - before
        assert client.xpending(STREAM, GROUP)["pending"] == 0, "every entry acknowledged"
    return spent / args.entries * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variants", default="script,inline,script-inbox,inline-inbox,function,no-expire,plain")
    args = parser.parse_args()
    variants = args.variants.split(",")
    results: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.runs):  # interleaved, so a noisy minute touches every variant
        for variant in variants:
            results[variant].append(run(variant, args))
    print(f"redis-server CPU us per entry, {args.entries:,} entries in calls of {args.batch}, "
          f"median of {args.runs}")
    for variant, runs in results.items():
        print(f"{variant:14s} {statistics.median(runs):6.2f}   ({', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
