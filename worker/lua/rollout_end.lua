-- Ends an active candidate (worker/serving/rollout.py).
-- KEYS = [shadow hash]; ARGV = [new state, reason, now_ms, seq or ""]: ends an active candidate
-- (only the one of sequence number seq when given). Returns 1 if it did, 0 if not active
-- (or moved on).
local state, seq = redis.call('HGET', KEYS[1], 'state'), redis.call('HGET', KEYS[1], 'seq')
if state ~= 'shadow' and state ~= 'canary' then return 0 end
if ARGV[4] ~= '' and seq ~= ARGV[4] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'reason', ARGV[2], 'updated_ms', ARGV[3])
return 1
