-- Deletes a dead slot consumer (worker/fleet/succession.py).
-- KEYS[1] stream; ARGV group, consumer. Deletes the consumer only if it holds no pending entry.
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return -1 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
