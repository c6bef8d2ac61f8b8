-- A worker's comparison totals added to the fleet's (worker/serving/rollout.py).
-- KEYS = [pair hash, pairs set]; ARGV = [(field, value, "max"|"sum")...]. Adds sums, keeps maxima
-- ("inf" wins), indexes the pair, returns the pair's fields and values (the fleet's totals).
for i = 1, #ARGV, 3 do
  local field, value, mode = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if mode == 'max' then
    local cur = redis.call('HGET', KEYS[1], field)
    if value == 'inf' or not cur or (cur ~= 'inf' and tonumber(value) > tonumber(cur)) then
      redis.call('HSET', KEYS[1], field, value)
    end
  elseif tonumber(value) ~= 0 then
    redis.call('HINCRBYFLOAT', KEYS[1], field, value)
  end
end
redis.call('SADD', KEYS[2], KEYS[1])
return redis.call('HGETALL', KEYS[1])
