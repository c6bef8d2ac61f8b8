#!/usr/bin/env python3
"""redis-server's CPU per entry for variants of the reply script (issue "The per-request cost").

The fleet answers a round with one call of the reply script
(worker/serving/replies.py): RPUSH the reply, XACK the entry, take the reply
back if the XACK found it answered, give each reply key its TTL once. This
measures what Redis spends per entry on that call and on variants of it, on
entries really pending in a stream (a private redis-server; its CPU time from
/proc):

* ``script``: the fleet's script, each entry to its own reply key (``submit``);
* ``script-inbox``: the same, every reply to one inbox (``map``: one PEXPIRE a call);
* ``function``: the same script as a Redis Function (FCALL);
* ``inline``, ``inline-inbox``: PEXPIRE right after each answered push,
  skipped while the key repeats the previous one (no table of keys);
* ``grouped``, ``grouped-inbox``: one RPUSH per distinct key (payloads
  gathered in a Lua table), then an XACK per entry, LREM to take one back;
* ``runs``, ``runs-inbox``: one RPUSH per run of entries to the same key,
  unpacked straight from ARGV (ids first, then payloads), then an XACK per entry;
* ``pcheck``, ``pcheck-inbox``: one XPENDING over the batch's id range for
  this consumer instead of an XACK each; when it lists exactly the batch,
  every reply is pushed and all are acknowledged by one XACK;
* ``xclaim``, ``xclaim-inbox``: one XCLAIM JUSTID of the batch's ids to this
  consumer (it names those still pending) instead of an XACK each; when it
  names them all, every reply is pushed and one XACK takes them all;
* ``pexpire``: the script before PEXPIREAT, each TTL a relative PEXPIRE;
* ``no-expire``: without a TTL (what the TTL costs);
* ``plain``: RPUSH + EXPIRE per reply and one XACK for the batch in a
  pipeline, no exactly-once check (the plain worker's commands).

    python -m benchmarks.bench_reply_script --entries 100000 --batch 256 --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import redis

from benchmarks.callgrind_redis import CallgrindRedis, missing_tools
from inferfleet.producer.protocol import GROUP
from inferfleet.worker.embedded import EmbeddedRedis
from inferfleet.worker.serving.replies import REPLY_SCRIPT

ROOT = Path(__file__).resolve().parent.parent

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
STREAM = "inferfleet:{b}:requests"
PAYLOAD = b"\x85" + b"r" * 120  # about a one-row reply's size


def _changed(script: str, old: str, new: str) -> str:
    """``script`` with every ``old`` replaced by ``new``; refused if there is none (a variant must differ)."""
    if old not in script:
        raise ValueError(f"{old!r} is not in the script")
    return script.replace(old, new)


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
#: one RPUSH per distinct reply key (payloads gathered in a table), then XACK each entry, LREM to take back
GROUPED = """
local stream, group, ttl = KEYS[1], ARGV[1], ARGV[2]
local keys, lists = {}, {}
for i = 2, #KEYS do
  local payload = ARGV[2 * i]
  if payload ~= '' then
    local key = KEYS[i]
    local list = lists[key]
    if list == nil then
      list = {}
      lists[key] = list
      keys[#keys + 1] = key
    end
    list[#list + 1] = payload
  end
end
local refused, err = {}, nil
for _, key in ipairs(keys) do
  local list = lists[key]
  for s = 1, #list, 1024 do
    local res = redis.pcall('RPUSH', key, unpack(list, s, math.min(s + 1023, #list)))
    if type(res) == 'table' and res.err then
      refused[key] = true
      if string.sub(res.err, 1, 9) ~= 'WRONGTYPE' then err = err or res.err end
      break
    end
  end
end
local pushed, failed = 0, {}
for i = 2, #KEYS do
  local id, payload, key = ARGV[2 * i - 1], ARGV[2 * i], KEYS[i]
  if payload == '' then
    redis.call('XACK', stream, group, id)
  elseif refused[key] then
    if not err then failed[#failed + 1] = i - 2 end
  elseif redis.call('XACK', stream, group, id) == 1 then
    pushed = pushed + 1
  else
    redis.call('LREM', key, -1, payload)
  end
end
for _, key in ipairs(keys) do
  if not refused[key] then redis.call('PEXPIRE', key, ttl) end
end
if err then return redis.error_reply(err) end
return {pushed, failed}
"""
#: one RPUSH per run of entries to the same key, straight from ARGV (ids first, then payloads), then XACK each
RUNS = """
local stream, group, ttl = KEYS[1], ARGV[1], ARGV[2]
local n = #KEYS - 1
local at = 2 + n  -- ARGV[at + i] is entry i's payload, ARGV[2 + i] its id
local refused, err, i = {}, nil, 1
while i <= n do
  local key, j = KEYS[i + 1], i
  if ARGV[at + i] ~= '' then
    while j < n and KEYS[j + 2] == key and ARGV[at + j + 1] ~= '' do j = j + 1 end
    for s = i, j, 1024 do
      local res = redis.pcall('RPUSH', key, unpack(ARGV, at + s, at + math.min(s + 1023, j)))
      if type(res) == 'table' and res.err then
        for k = i, j do refused[k] = true end
        if string.sub(res.err, 1, 9) ~= 'WRONGTYPE' then err = err or res.err end
        break
      end
    end
  end
  i = j + 1
end
local pushed, failed, last = 0, {}, nil
for i = 1, n do
  local id, payload, key = ARGV[2 + i], ARGV[at + i], KEYS[i + 1]
  if payload == '' then
    redis.call('XACK', stream, group, id)
  elseif refused[i] then
    if not err then failed[#failed + 1] = i - 1 end
  else
    if redis.call('XACK', stream, group, id) == 1 then
      pushed = pushed + 1
    else
      redis.call('LREM', key, -1, payload)
    end
    if key ~= last then
      redis.call('PEXPIRE', key, ttl)
      last = key
    end
  end
end
if err then return redis.error_reply(err) end
return {pushed, failed}
"""
#: one XPENDING over the batch's id range (this consumer's entries) instead of an XACK each: when it lists
#: exactly the batch, push every reply and XACK them all in one call (the fallback is not measured here)
PCHECK = """
local stream, group, ttl, me = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local n = #KEYS - 1
local function id(i) return ARGV[2 + 2 * i] end
local function payload(i) return ARGV[3 + 2 * i] end
local mine = redis.call('XPENDING', stream, group, id(1), id(n), n, me)
local fast = #mine == n
if fast then
  for i = 1, n do
    if mine[i][1] ~= id(i) or payload(i) == '' then fast = false break end
  end
end
if not fast then return redis.error_reply('slow path not in this variant') end
local last = nil
for i = 1, n do
  local key = KEYS[i + 1]
  redis.call('RPUSH', key, payload(i))
  if key ~= last then redis.call('PEXPIRE', key, ttl) last = key end
end
local ids = {}
for i = 1, n do ids[i] = id(i) end
redis.call('XACK', stream, group, unpack(ids))
return {n, {}}
"""
#: the fleet's script before the runs (submission 9311503): RPUSH, XACK, take back with RPOP per entry,
#: each answered key's TTL from a table at the end
PREVIOUS = """
local stream, group, ttl = KEYS[1], ARGV[1], ARGV[2]
local pushed, failed, answered = 0, {}, {}
local function expire_answered()
  for key in pairs(answered) do
    redis.call('PEXPIRE', key, ttl)
  end
end
for i = 2, #KEYS do
  local id, payload = ARGV[2 * i - 1], ARGV[2 * i]
  if payload == '' then
    redis.call('XACK', stream, group, id)
  else
    local res = redis.pcall('RPUSH', KEYS[i], payload)
    if type(res) == 'table' and res.err then
      if string.sub(res.err, 1, 9) ~= 'WRONGTYPE' then
        expire_answered()  -- what this call answered keeps its TTL
        return redis.error_reply(res.err)  -- out of memory and the like: retry the round later
      end
      table.insert(failed, i - 2)
    elseif redis.call('XACK', stream, group, id) == 1 then
      answered[KEYS[i]] = true
      pushed = pushed + 1
    else
      redis.call('RPOP', KEYS[i])
    end
  end
end
expire_answered()
return {pushed, failed}
"""
#: the fleet's script with each TTL a relative PEXPIRE, as c642cb4 set them (the TIME read stays), which
#: Redis rewrites into a PEXPIREAT to propagate it (the command vector copied, the time made a string)
PEXPIRE = _changed(
    REPLY_SCRIPT,
    "local expire, when = 'PEXPIREAT', string.format('%.0f', now[1] * 1000 + "
    "math.floor(now[2] / 1000) + tonumber(ttl))\n",
    "local expire, when = 'PEXPIRE', ttl\n",
)
NO_EXPIRE = _changed(REPLY_SCRIPT, "pcall(expire, key, when) ~= 1", "false")
#: one XCLAIM JUSTID of the batch's ids to this consumer instead of an XACK each: it names exactly the
#: entries still pending, so when it names them all, every reply is pushed and one XACK takes them all
#: (the fallback is not measured here). Not adopted: XCLAIM looks each entry up in the stream (it drops
#: a pending entry deleted from the stream, which an XACK would still answer), and that costs more
#: than the XACKs it saves
XCLAIM = """
local stream, group, ttl, me = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local n = #KEYS - 1
local ids, claim = {}, {stream, group, me, 0}
for i = 1, n do
  ids[i] = ARGV[2 + 2 * i]
  claim[4 + i] = ids[i]
end
claim[n + 5] = 'JUSTID'
if #redis.call('XCLAIM', unpack(claim)) ~= n then return redis.error_reply('slow path not in this variant') end
redis.call('XACK', stream, group, unpack(ids))
for i = 1, n do
  redis.call('RPUSH', KEYS[i + 1], ARGV[3 + 2 * i])
  redis.call('PEXPIRE', KEYS[i + 1], ttl)
end
return {n, {}}
"""
FUNCTION = (
    "#!lua name=inferfleet_bench\n"
    "local function reply(KEYS, ARGV)\n" + REPLY_SCRIPT + "\nend\n"
    "redis.register_function('reply', reply)\n"
)


#: The scripts by variant name; each is also measured as NAME-inbox (every reply to one inbox, as ``map``).
SCRIPTS = {
    "script": REPLY_SCRIPT,
    "previous": PREVIOUS,
    "inline": INLINE,
    "grouped": GROUPED,
    "runs": RUNS,
    "pcheck": PCHECK,
    "xclaim": XCLAIM,
    "pexpire": PEXPIRE,
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
        args: list = [GROUP, 300_000] + (["c"] if variant.startswith(("pcheck", "xclaim")) else [])
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
    """redis-server's CPU us (or, with --callgrind, instructions) per entry answering with ``variant``."""
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
