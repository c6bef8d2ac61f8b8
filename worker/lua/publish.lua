-- inferfleet swap's publish and rollback (worker/serving/lifecycle.py), run by EVAL.
-- KEYS = [model hash]; ARGV = [mode, model, version, now_ms, fallback_model, fallback_version].
-- publish: the current pair becomes the previous one (or the fallback, the pair
-- live workers serve, on the first publish, which also counts as served);
-- rollback: the last served pair other than the current one becomes current.
-- Either way the sequence number grows. Returns the new seq, or an error reply NOPREVIOUS.
local key, mode = KEYS[1], ARGV[1]
local h = {}
local raw = redis.call('HGETALL', key)
for i = 1, #raw, 2 do h[raw[i]] = raw[i + 1] end
local cur_model, cur_version = h['model'], h['version']
if mode == 'rollback' then
  local to_model, to_version = h['served_model'], h['served_version']
  if not to_version or to_version == '' or to_version == cur_version then
    to_model, to_version = h['served_before_model'], h['served_before_version']
  end
  if not to_version or to_version == '' or to_version == cur_version then
    return redis.error_reply('NOPREVIOUS no earlier version the fleet served to roll back to')
  end
  redis.call('HSET', key, 'model', to_model, 'version', to_version,
             'previous_model', cur_model, 'previous_version', cur_version, 'updated_ms', ARGV[4])
else
  if not cur_model then
    cur_model, cur_version = ARGV[5], ARGV[6]
    if not h['served_version'] and ARGV[6] ~= '' then
      redis.call('HSET', key, 'served_model', ARGV[5], 'served_version', ARGV[6])
    end
  end
  redis.call('HSET', key, 'model', ARGV[2], 'version', ARGV[3],
             'previous_model', cur_model, 'previous_version', cur_version, 'updated_ms', ARGV[4])
end
return redis.call('HINCRBY', key, 'seq', 1)
