-- Takes or renews a supervisor's lease (worker/fleet/succession.py).
-- KEYS[1] lease hash; ARGV token, pid, ttl_ms, host, replaceable token ("" none).
-- Returns {1|0, token, pid}.
local held = redis.call('HGETALL', KEYS[1])
local token, pid = false, false
for i = 1, #held, 2 do
  if held[i] == 'token' then token = held[i + 1] elseif held[i] == 'pid' then pid = held[i + 1] end
end
if not token or token == ARGV[1] or (ARGV[5] ~= '' and token == ARGV[5]) then
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'pid', ARGV[2], 'host', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, ARGV[1], ARGV[2]}
end
return {0, token, pid or ''}
