-- A worker records the version it serves (worker/serving/lifecycle.py).
-- KEYS = [model hash]; ARGV = [model, version]. If (model, version) is the published pair and
-- not already the last served one, it becomes the last served (the one before moves to
-- served_before). HGETALL and HSET only: commands the worker ACL user has.
-- Returns 1 if it changed anything.
local h = {}
local raw = redis.call('HGETALL', KEYS[1])
for i = 1, #raw, 2 do h[raw[i]] = raw[i + 1] end
if h['model'] ~= ARGV[1] or h['version'] ~= ARGV[2] or h['served_version'] == ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'served_before_model', h['served_model'] or '',
           'served_before_version', h['served_version'] or '',
           'served_model', ARGV[1], 'served_version', ARGV[2])
return 1
