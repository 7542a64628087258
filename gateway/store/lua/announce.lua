-- A replica says it is alive; returns how many replicas are (and the Redis time).
-- KEYS[1] the replicas' sorted set (member = replica id, score = last heard, Redis TIME)
-- ARGV[1] replica id, ARGV[2] seconds after which a silent replica no longer counts
-- This is a presence key, not a counter: it is re-armed on purpose at every announce.
local tm = redis.call('TIME')
local now = tonumber(tm[1]) + tonumber(tm[2]) / 1000000
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
redis.call('PEXPIRE', KEYS[1], math.floor(ttl * 3000))
return {redis.call('ZCARD', KEYS[1]), tostring(now)}
