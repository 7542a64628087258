-- Tokens served per tenant of one pool, for the whole fleet (fair admission's counters).
-- KEYS[1] the pool's hash: field "CLASS|TENANT" -> tokens served by every replica together
-- ARGV[1] seconds the hash lives after its last update; then pairs: field, tokens served here
--     since this replica's last report (0: only read it)
-- Returns the fleet totals of the fields asked, in order (as strings).
local out = {}
for i = 2, #ARGV, 2 do
  local d = tonumber(ARGV[i + 1])
  if d ~= 0 then
    out[#out + 1] = redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], d)
  else
    out[#out + 1] = redis.call('HGET', KEYS[1], ARGV[i]) or '0'
  end
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return out
