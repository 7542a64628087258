-- A replica stops (drain): it no longer counts in the fallback sizing of the others.
-- KEYS[1] the replicas' sorted set; ARGV[1] replica id
return redis.call('ZREM', KEYS[1], ARGV[1])
