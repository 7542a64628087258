-- A replica says it is alive; returns how many replicas are (and the Redis time).
-- KEYS[1] the replicas' sorted set (member = replica id, score = last heard, Redis TIME)
-- KEYS[2] (optional, same hash tag) when the store's fleet state was born: set at the first
--     announce after the store started empty, returned third (the fleet store reads it)
-- ARGV[1] replica id, ARGV[2] seconds after which a silent replica no longer counts
-- This is a presence key, not a counter: it is re-armed on purpose at every announce.
local tm = redis.call('TIME')
local now = tonumber(tm[1]) + tonumber(tm[2]) / 1000000
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], math.floor(ttl * 3000))
if KEYS[2] then
  redis.call('SET', KEYS[2], tostring(now), 'NX')
  return {redis.call('ZCARD', KEYS[1]), tostring(now), redis.call('GET', KEYS[2])}
end
return {redis.call('ZCARD', KEYS[1]), tostring(now)}
