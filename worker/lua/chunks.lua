-- One iteration's writes of a generating worker (worker/serving/generation.py), and its
-- look at the cancel marks, in one call.
-- KEYS = [cancels, then per item: its key, its entry's lane stream];
-- ARGV = [group, ttl_ms, item count, then per item: kind, entry id, n, attempt, body,
--         then the request ids to look up in the cancel marks].
-- kind 'c': a chunk, 'f': the final chunk and the XACK, 'r': a reply pushed to a reply list
-- and the XACK (a request that did not ask for a stream), 'a': the XACK only.
-- A chunk ('c', 'f') is written only if it is its stream's next: the stream empty and n 0, or
-- its last entry numbered n - 1, of an attempt no newer, not final. So two workers that both
-- hold a request (one thought dead) never write two chunks of one number: the later one is
-- refused and stops. A key that holds another type (a client's) is never written: its entry
-- is acknowledged unanswered and the item refused. A final chunk or a reply is written only
-- if its XACK acknowledged the entry (exactly one answer). Every key written gets the reply
-- TTL.
-- Returns {refused item indexes (1-based), a 1 or 0 per request id: marked cancelled now}.
local group, ttl, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local call = redis.call

local function is_next(key, n, attempt)
  local last = call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if #last == 0 then
    return n == 0
  end
  local f, seen = last[1][2], {}
  for j = 1, #f, 2 do
    seen[f[j]] = f[j + 1]
  end
  return seen['final'] == '0' and tonumber(seen['n']) == n - 1
    and tonumber(seen['attempt']) <= attempt
end

local refused = {}
for i = 1, count do
  local a = 3 + (i - 1) * 5
  local kind, id, n, attempt, body = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  local key, lane = KEYS[2 * i], KEYS[2 * i + 1]
  local ok = true
  local kept = call('TYPE', key)['ok']
  if kept ~= 'none' and kept ~= ((kind == 'r') and 'list' or 'stream') and kind ~= 'a' then
    -- a client wrote another type there: nothing can be answered; acknowledged, not retried
    call('XACK', lane, group, id)
    ok = false
  elseif kind == 'c' or kind == 'f' then
    ok = is_next(key, tonumber(n), tonumber(attempt))
  end
  if ok and kind ~= 'c' then
    ok = call('XACK', lane, group, id) == 1
  end
  if ok and kind ~= 'a' then
    if kind == 'r' then
      call('RPUSH', key, body)
    else
      call('XADD', key, '*', 'n', n, 'attempt', attempt, 'final', kind == 'f' and '1' or '0',
        'body', body)
    end
    call('PEXPIRE', key, ttl)
  end
  if not ok then
    refused[#refused + 1] = i
  end
end

local marked = {}
local first = 4 + count * 5
if first <= #ARGV and call('EXISTS', KEYS[1]) == 1 then
  local now = call('TIME')
  local now_ms = now[1] * 1000 + math.floor(now[2] / 1000)
  local scores = call('ZMSCORE', KEYS[1], unpack(ARGV, first, #ARGV))
  for j = 1, #scores do
    local live = scores[j] and tonumber(scores[j]) > now_ms
    marked[j] = live and 1 or 0
    if live then
      call('ZREM', KEYS[1], ARGV[first + j - 1])
    end
  end
end
return {refused, marked}
