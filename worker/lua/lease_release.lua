-- Gives a supervisor's lease up (worker/fleet/succession.py).
-- KEYS[1] lease hash; ARGV token. Deletes the lease only if it is ours.
local held = redis.call('HGETALL', KEYS[1])
for i = 1, #held, 2 do
  if held[i] == 'token' and held[i + 1] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
end
return 0
