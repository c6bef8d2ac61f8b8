-- A pipeline stage's round (worker/serving/stages.py).
-- KEYS = [stream, next stream, key...]; ARGV = [group, ttl_ms, then per entry: id, n, ...].
-- n > 0: forward: XADD the n field-value pairs that follow to the next stream,
-- XACK, and XDEL the new entry if the XACK found the entry already handled;
-- n = -1: reply: push the one payload that follows to its key (the matching
-- KEYS slot), XACK, RPOP it back if the XACK found the entry answered (the
-- reply script's rule, WRONGTYPE keys reported); n = 0: acknowledge only.
-- Each reply key gets its TTL once. Returns {done, {failed 0-based indexes}}.
local stream, nxt, group, ttl = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local done, failed, answered = 0, {}, {}
local function expire_answered()
  for key in pairs(answered) do
    redis.call('PEXPIRE', key, ttl)
  end
end
local a, k = 3, 3
while a <= #ARGV do
  local id, n = ARGV[a], tonumber(ARGV[a + 1])
  if n > 0 then
    local new = redis.call('XADD', nxt, '*', unpack(ARGV, a + 2, a + 1 + 2 * n))
    if redis.call('XACK', stream, group, id) == 1 then
      done = done + 1
    else
      redis.call('XDEL', nxt, new)
    end
    a = a + 2 + 2 * n
  elseif n < 0 then
    local res = redis.pcall('RPUSH', KEYS[k], ARGV[a + 2])
    if type(res) == 'table' and res.err then
      if string.sub(res.err, 1, 9) ~= 'WRONGTYPE' then
        expire_answered()
        return redis.error_reply(res.err)
      end
      table.insert(failed, k - 3)
    elseif redis.call('XACK', stream, group, id) == 1 then
      answered[KEYS[k]] = true
      done = done + 1
    else
      redis.call('RPOP', KEYS[k])
    end
    a = a + 3
  else
    redis.call('XACK', stream, group, id)
    a = a + 2
  end
  k = k + 1
end
expire_answered()
return {done, failed}
