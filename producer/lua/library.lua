#!lua name=inferfleet
-- The Redis Function library. Every function takes only the keys it is given (one cluster slot).
--
-- inferfleet_enqueue KEYS: lane limits bucket tenants high normal low
--   ARGV: tenant ("" for none), N, N (field, value) pairs for every entry, then (id, body) per
--   entry.
--   Checks the backlog (lag of group ``workers`` summed over the lanes, or XLEN where unknown)
--   against
--   ``max_backlog`` and the tenant's token bucket for every entry at once, then XADDs them all
--   (adding
--   ``tenant`` and the ``admitted`` stamp), or none: an error ``OVERLOADED backlog max`` or
--   ``RATELIMITED retry_ms tenant``. Returns the entry ids.
-- inferfleet_check KEYS: limits tenants high normal low bucket... ARGV: one tenant per entry (""
-- none).
--   The worker's check of entries written without the stamp: 0 ok, 1 rate_limited, 2 overloaded
--   each.
-- inferfleet_cancel KEYS: cancels high normal low reply_key... ARGV: bound_ms, then one id per
-- reply key.
--   For each id: ``answered`` (a reply waits: it stands), ``unknown`` (in no lane: nothing written)
--   or
--   ``cancelled`` (marked until its deadline + 60 s, at most bound_ms).

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
  if count < 1 or count ~= math.floor(count) then
    return redis.error_reply('ERR expected id and body pairs')
  end
  local who = counted_as(limits, tenant)
  local over, backlog, max = over_backlog(limits, keys[5], keys[6], keys[7], count)
  if over then
    redis.call('HINCRBY', tenants, 'refused:' .. who, count)
    return redis.error_reply(
      'OVERLOADED ' .. backlog .. ' ' .. max .. ' queue backlog over max_backlog')
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
    ids[#ids + 1] = redis.call(
      'XADD', lane, '*', 'id', args[i], 'body', args[i + 1], unpack(common))
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
          if f[j] == 'id' then
            rid = f[j + 1]
          elseif f[j] == 'deadline' then
            deadline = tonumber(f[j + 1]) or 0
          end
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
