"""Sharing a fleet (contract 1.1): priority lanes, tenants, fleet-wide limits and cancellation.

No I/O but :func:`read_lanes` (what status and the supervisor read): the key
names, the checks of what a caller passes, and the Redis Function library
(:data:`LIBRARY`) that every producer, every worker and any raw client
calls, so that the admission check and the XADD are one atomic step in
Redis. The library is loaded (``FUNCTION LOAD REPLACE``) by every worker
when it starts, by ``inferfleet limit`` and by a producer that finds limits
in force.

Keys, all under the queue's ``PREFIX:{NAME}:`` base (one cluster slot):

==========================  ======  ===============================================
key                         type    what
==========================  ======  ===============================================
``requests:high``           stream  the high lane (the contract's ``requests`` is normal)
``requests:low``            stream  the low lane
``limits``                  hash    ``max_backlog``, ``rate:T``, ``burst:T``, ``stamp``
``bucket:T``                hash    tenant T's token bucket (``t`` tokens, ``ts`` ms), with a TTL
``tenants``                 hash    ``accepted:T`` / ``refused:T`` counts while limits are in force
``cancels``                 zset    cancelled request id -> expiry (unix ms); the key expires with its last
==========================  ======  ===============================================
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import QueueKeys, entry_time_ms, is_tenant, workers_group

__all__ = [
    "CANCEL_TTL_S",
    "LIBRARY",
    "LaneState",
    "MAX_TENANTS",
    "PRIORITIES",
    "cancel_keys",
    "cancels_key",
    "check_keys",
    "enqueue_keys",
    "is_tenant",
    "lane_keys",
    "lane_of",
    "limits_key",
    "read_lanes",
    "tenants_key",
    "validate_priority",
    "validate_rate",
    "validate_tenant",
]

#: The priorities, highest first; ``normal`` is the contract's own stream.
PRIORITIES = ("high", "normal", "low")
#: How many tenants may have a quota on one queue: the bound of the ``tenant`` metrics label.
MAX_TENANTS = 64
#: The longest a cancel mark lives when its request has no deadline.
CANCEL_TTL_S = 3600
#: The highest rate (requests a second) and burst a quota may have.
MAX_RATE = 1_000_000.0


def lane_keys(keys: QueueKeys) -> tuple[str, str, str]:
    """The high, normal and low lane streams of a queue (or shard)."""
    return keys.requests + ":high", keys.requests, keys.requests + ":low"


def validate_priority(priority: str) -> int:
    """The lane index (0 high, 1 normal, 2 low) of ``priority``; ProtocolError for anything else."""
    try:
        return PRIORITIES.index(priority)
    except ValueError:
        raise ProtocolError(
            f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}"
        ) from None


def lane_of(keys: QueueKeys, priority: str) -> str:
    """The stream a request of ``priority`` goes to."""
    return lane_keys(keys)[validate_priority(priority)]


def validate_tenant(tenant: str) -> str:
    """``tenant`` if valid, else ProtocolError naming the rule."""
    if not isinstance(tenant, str) or not tenant.isascii() or not is_tenant(tenant.encode()):
        raise ProtocolError(
            f"tenant must be 1 to 64 characters of A-Z a-z 0-9 . _ : @ -, got {tenant!r}"
        )
    return tenant


def validate_rate(rate: float, burst: float | None) -> tuple[float, float]:
    """(rate, burst) of a quota: a positive finite rate up to MAX_RATE a second; burst defaults to rate."""
    burst = rate if burst is None else burst
    for label, value in (("rate", rate), ("burst", burst)):
        if (
            not isinstance(value, int | float)
            or not math.isfinite(value)
            or not 0 < value <= MAX_RATE
        ):
            raise ProtocolError(
                f"{label} must be a number above 0 and at most {MAX_RATE:g}, got {value!r}"
            )
    if burst < 1:
        raise ProtocolError(f"burst must be at least 1 (one request), got {burst!r}")
    return float(rate), float(burst)


def limits_key(keys: QueueKeys) -> str:
    """The hash of the limits in force on a queue."""
    return keys.own("limits")


def tenants_key(keys: QueueKeys) -> str:
    """The hash of accepted / refused counts per tenant."""
    return keys.own("tenants")


def cancels_key(keys: QueueKeys) -> str:
    """The sorted set of cancelled request ids (score: when the mark expires, unix ms)."""
    return keys.own("cancels")


def _bucket_key(keys: QueueKeys, tenant: str) -> str:
    return keys.own("bucket:" + tenant) if tenant else limits_key(keys)


def enqueue_keys(keys: QueueKeys, lane: str, tenant: str) -> list[str]:
    """KEYS of ``FCALL inferfleet_enqueue``: lane, limits, bucket, tenants, high, normal, low."""
    return [lane, limits_key(keys), _bucket_key(keys, tenant), tenants_key(keys), *lane_keys(keys)]


def check_keys(keys: QueueKeys, tenants: list[str]) -> list[str]:
    """KEYS of ``FCALL inferfleet_check``: limits, tenants, the three lanes, one bucket per entry."""
    return [
        limits_key(keys),
        tenants_key(keys),
        *lane_keys(keys),
        *(_bucket_key(keys, t) for t in tenants),
    ]


def cancel_keys(keys: QueueKeys, rids: list[str]) -> list[str]:
    """KEYS of ``FCALL inferfleet_cancel``: the cancels set, the three lanes, each request's reply key."""
    return [cancels_key(keys), *lane_keys(keys), *(keys.reply(rid) for rid in rids)]


#: The Redis Function library. Every function takes only the keys it is given (one cluster slot).
#:
#: inferfleet_enqueue KEYS: lane limits bucket tenants high normal low
#:   ARGV: tenant ("" for none), N, N (field, value) pairs for every entry, then (id, body) per entry.
#:   Checks the backlog (lag of group ``workers`` summed over the lanes, or XLEN where unknown) against
#:   ``max_backlog`` and the tenant's token bucket for every entry at once, then XADDs them all (adding
#:   ``tenant`` and the ``admitted`` stamp), or none: an error ``OVERLOADED backlog max`` or
#:   ``RATELIMITED retry_ms tenant``. Returns the entry ids.
#: inferfleet_check KEYS: limits tenants high normal low bucket... ARGV: one tenant per entry ("" none).
#:   The worker's check of entries written without the stamp: 0 ok, 1 rate_limited, 2 overloaded each.
#: inferfleet_cancel KEYS: cancels high normal low reply_key... ARGV: bound_ms, then one id per reply key.
#:   For each id: ``answered`` (a reply waits: it stands), ``unknown`` (in no lane: nothing written) or
#:   ``cancelled`` (marked until its deadline + 60 s, at most bound_ms).
LIBRARY = r"""#!lua name=inferfleet

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function waiting(stream)
  local length = redis.call('XLEN', stream)
  if length == 0 then return 0 end
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
    if info['name'] == 'workers' then
      if type(info['lag']) == 'number' then return info['lag'] end
      return length
    end
  end
  return length
end

local function over_backlog(limits, high, normal, low, adding)
  local max = tonumber(redis.call('HGET', limits, 'max_backlog'))
  if not max then return false, 0, 0 end
  local backlog = waiting(high) + waiting(normal) + waiting(low)
  return backlog + adding > max, backlog, max
end

local function counted_as(limits, tenant)
  if tenant == '' then return '-' end
  if redis.call('HEXISTS', limits, 'rate:' .. tenant) == 1 then return tenant end
  return '*'
end

local function take_tokens(limits, bucket, tenant, now, count)
  if tenant == '' then return true, 0 end
  local rate = tonumber(redis.call('HGET', limits, 'rate:' .. tenant))
  if not rate then return true, 0 end
  local burst = tonumber(redis.call('HGET', limits, 'burst:' .. tenant)) or rate
  local state = redis.call('HMGET', bucket, 't', 'ts')
  local tokens = tonumber(state[1]) or burst
  local since = tonumber(state[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - since) * rate / 1000)
  if tokens < count then
    return false, math.ceil((count - tokens) * 1000 / rate)
  end
  redis.call('HSET', bucket, 't', string.format('%.6f', tokens - count), 'ts', now)
  redis.call('PEXPIRE', bucket, math.ceil(burst * 1000 / rate) + 1000)
  return true, 0
end

local function valid_tenant(tenant)
  return tenant == '' or (#tenant <= 64 and not string.find(tenant, '[^%w%._:@%-]'))
end

local function enqueue(keys, args)
  local lane, limits, bucket, tenants = keys[1], keys[2], keys[3], keys[4]
  local tenant, nfields = args[1], tonumber(args[2])
  if not valid_tenant(tenant) then return redis.error_reply('ERR invalid tenant') end
  if not nfields then return redis.error_reply('ERR the field count must be a number') end
  local first = 3 + 2 * nfields
  local count = (#args - first + 1) / 2
  if count < 1 or count ~= math.floor(count) then return redis.error_reply('ERR expected id and body pairs') end
  local who = counted_as(limits, tenant)
  local over, backlog, max = over_backlog(limits, keys[5], keys[6], keys[7], count)
  if over then
    redis.call('HINCRBY', tenants, 'refused:' .. who, count)
    return redis.error_reply('OVERLOADED ' .. backlog .. ' ' .. max .. ' queue backlog over max_backlog')
  end
  local ok, retry = take_tokens(limits, bucket, tenant, now_ms(), count)
  if not ok then
    redis.call('HINCRBY', tenants, 'refused:' .. who, count)
    return redis.error_reply('RATELIMITED ' .. retry .. ' ' .. tenant .. ' over its rate')
  end
  local common = {}
  for i = 3, first - 1 do common[#common + 1] = args[i] end
  if tenant ~= '' then
    common[#common + 1] = 'tenant'
    common[#common + 1] = tenant
  end
  local stamp = redis.call('HGET', limits, 'stamp')
  if stamp then
    common[#common + 1] = 'admitted'
    common[#common + 1] = stamp
  end
  local ids = {}
  for i = first, #args, 2 do
    ids[#ids + 1] = redis.call('XADD', lane, '*', 'id', args[i], 'body', args[i + 1], unpack(common))
  end
  if redis.call('EXISTS', limits) == 1 then
    redis.call('HINCRBY', tenants, 'accepted:' .. who, count)
  end
  return ids
end

local function check(keys, args)
  local limits, tenants = keys[1], keys[2]
  local over = over_backlog(limits, keys[3], keys[4], keys[5], #args)
  local now = now_ms()
  local verdicts = {}
  for i, tenant in ipairs(args) do
    local verdict = 0
    if over then
      verdict = 2
    elseif not take_tokens(limits, keys[5 + i], tenant, now, 1) then
      verdict = 1
    end
    local who = counted_as(limits, tenant)
    redis.call('HINCRBY', tenants, (verdict == 0 and 'accepted:' or 'refused:') .. who, 1)
    verdicts[i] = verdict
  end
  return verdicts
end

local function scan_lanes(keys, wanted)
  local found = {}
  for s = 2, 4 do
    local start = '-'
    while true do
      local page = redis.call('XRANGE', keys[s], start, '+', 'COUNT', 1000)
      for _, entry in ipairs(page) do
        local f, rid, deadline = entry[2], nil, 0
        for j = 1, #f, 2 do
          if f[j] == 'id' then rid = f[j + 1] elseif f[j] == 'deadline' then deadline = tonumber(f[j + 1]) or 0 end
        end
        if rid and wanted[rid] then found[rid] = deadline end
      end
      if #page < 1000 then break end
      start = '(' .. page[#page][1]
    end
  end
  return found
end

local function cancel(keys, args)
  local cancels, bound = keys[1], tonumber(args[1])
  local wanted = {}
  for i = 2, #args do wanted[args[i]] = true end
  local found = scan_lanes(keys, wanted)
  local now = now_ms()
  local out = {}
  for i = 2, #args do
    local rid = args[i]
    if redis.call('EXISTS', keys[3 + i]) == 1 then
      out[#out + 1] = 'answered'
    elseif found[rid] == nil then
      out[#out + 1] = 'unknown'
    else
      local ttl = bound
      if found[rid] > 0 then ttl = math.max(1000, math.min(bound, found[rid] - now + 60000)) end
      redis.call('ZADD', cancels, now + ttl, rid)
      local last = redis.call('ZRANGE', cancels, -1, -1, 'WITHSCORES')
      redis.call('PEXPIREAT', cancels, math.floor(tonumber(last[2])))
      out[#out + 1] = 'cancelled'
    end
  end
  return out
end

redis.register_function('inferfleet_enqueue', enqueue)
redis.register_function('inferfleet_check', check)
redis.register_function('inferfleet_cancel', cancel)
"""


@dataclass(frozen=True)
class LaneState:
    """One lane as Redis shows it now: entries, undelivered (lag), pending, and how long its oldest
    undelivered entry has waited (0 when none)."""

    name: str
    length: int
    lag: int | None
    pending: int
    wait_s: float


def read_lanes(client: Any, keys: QueueKeys, now_ms: float | None = None) -> list[LaneState]:
    """The three lanes of a queue (or shard), highest first (a few commands a lane: status and scaling)."""
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    states = []
    for name, stream in zip(PRIORITIES, lane_keys(keys)):
        length = int(client.xlen(stream))
        group = workers_group(client.xinfo_groups(stream)) if length else None
        if group is None:
            first = client.xrange(stream, count=1) if length else []
            states.append(LaneState(name, length, length, 0, _waited(first, now_ms)))
            continue
        after = (
            client.xrange(stream, min="(" + group.last_delivered_id, count=1)
            if group.lag != 0
            else []
        )
        states.append(LaneState(name, length, group.lag, group.pending, _waited(after, now_ms)))
    return states


def _waited(entries: list, now_ms: float) -> float:
    return max(0.0, (now_ms - entry_time_ms(entries[0][0])) / 1000) if entries else 0.0
