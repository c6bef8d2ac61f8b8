-- A round's replies and acknowledgements (worker/serving/replies.py).
-- KEYS = [stream, reply_key...]; ARGV = [group, ttl_ms, (entry_id, payload)...].
-- An empty payload means "acknowledge only". A reply is pushed first and
-- taken back if the XACK finds its entry already answered (so exactly one
-- reply stands). Consecutive replies to one key (a producer's inbox) are one
-- run: one RPUSH of the whole run (at most RUN_MAX), then an XACK each; if
-- some were answered already, RPOP takes the run back (it is the list's tail:
-- the call is atomic) and one RPUSH puts back the replies that stand. A lone
-- reply is pushed on its own and taken back with RPOP. A push that
-- fails because the key holds another type leaves its run pending and
-- unacknowledged (answered elsewhere); any other error, such as Redis out of
-- memory, aborts the call, which is retried: one RPUSH is all or nothing, and
-- every run before it is pushed and acknowledged. A key gets its TTL after
-- each run of it that answered anything: PEXPIREAT at Redis's clock, read once
-- a call (Redis rewrites a PEXPIRE into a PEXPIREAT to propagate it, copying
-- the command and formatting the time, 1,500 instructions a key); where the
-- ACL lacks ``+pexpireat`` (a grant older than this script), PEXPIREAT answers an
-- error instead of 1 and the call uses PEXPIRE from then on, and says so in its
-- answer: the writer then passes ttl_ms as "p<ms>" (PEXPIRE from the start), so
-- the refusal is logged in ACL LOG once, not once a call.
-- Returns {pushed, {failed 0-based indexes}, 1 if PEXPIREAT was refused else 0}.

-- The most replies one RPUSH pushes (Lua's unpack is bounded by its C stack, 8,000);
-- worker/serving/replies.py reads it from this line.
local RUN_MAX = 1024
local stream, group, ttl = KEYS[1], ARGV[1], ARGV[2]
local call, pcall = redis.call, redis.pcall
local n = #KEYS - 1
local expire, when, refused = 'PEXPIREAT', nil, 0
if string.sub(ttl, 1, 1) == 'p' then  -- the writer learnt that the ACL refuses PEXPIREAT
  ttl = string.sub(ttl, 2)
  expire, when = 'PEXPIRE', ttl
else
  local now = call('TIME')
  when = string.format('%.0f', now[1] * 1000 + math.floor(now[2] / 1000) + tonumber(ttl))
end
local pushed, failed, i = 0, {}, 1
while i <= n do
  local key, payload = KEYS[i + 1], ARGV[2 * i + 2]
  if payload == '' then
    call('XACK', stream, group, ARGV[2 * i + 1])
    i = i + 1
  elseif KEYS[i + 2] ~= key then  -- a lone reply: a key of its own, the common case of submit
    local res = pcall('RPUSH', key, payload)
    if type(res) == 'table' then
      if string.sub(res.err, 1, 9) ~= 'WRONGTYPE' then return redis.error_reply(res.err) end
      failed[#failed + 1] = i - 1
    elseif call('XACK', stream, group, ARGV[2 * i + 1]) == 1 then
      pushed = pushed + 1
      -- refused (a grant without +pexpireat): PEXPIRE from now on
      if pcall(expire, key, when) ~= 1 then
        expire, when, refused = 'PEXPIRE', ttl, 1
        call(expire, key, when)
      end
    else
      call('RPOP', key)
    end
    i = i + 1
  else  -- a run of replies to one key (an inbox): entries i..j
    local run, j = {payload}, i
    while j < n and j - i < RUN_MAX - 1 and KEYS[j + 2] == key and ARGV[2 * j + 4] ~= '' do
      j = j + 1
      run[#run + 1] = ARGV[2 * j + 2]
    end
    local res = pcall('RPUSH', key, unpack(run))
    if type(res) == 'table' then
      if string.sub(res.err, 1, 9) ~= 'WRONGTYPE' then return redis.error_reply(res.err) end
      for k = i, j do failed[#failed + 1] = k - 1 end
    else
      local before, taken = pushed, nil
      for k = i, j do
        if call('XACK', stream, group, ARGV[2 * k + 1]) == 1 then
          pushed = pushed + 1
        else
          taken = taken or {}
          taken[k] = true
        end
      end
      if taken then  -- another worker answered some first: take the run back, push again the rest
        call('RPOP', key, j - i + 1)
        local keep = {}
        for k = i, j do
          if not taken[k] then keep[#keep + 1] = ARGV[2 * k + 2] end
        end
        if #keep > 0 then call('RPUSH', key, unpack(keep)) end
      end
      -- the same fallback as a lone reply's, written out: a Lua function per TTL cost 1,000
      -- instructions
      if pushed > before and pcall(expire, key, when) ~= 1 then
        expire, when, refused = 'PEXPIRE', ttl, 1
        call(expire, key, when)
      end
    end
    i = j + 1
  end
end
return {pushed, failed, refused}
