-- An operator's look at (or change of) one budget key in one period.
-- KEYS[1] the budget hash; ARGV: action (show | grant | reset), tokens, limit, expire_at
-- Returns {limit, used, reserved, remaining, grant, expired}
local k = KEYS[1]
local action = ARGV[1]
local n = tonumber(ARGV[2])
local new = redis.call('EXISTS', k) == 0
if action == 'grant' then
  redis.call('HINCRBY', k, 'grant', n)
elseif action == 'reset' then
  redis.call('HSET', k, 'used', 0, 'grant', 0, 'x', 0)
end
if new and action ~= 'show' then redis.call('EXPIREAT', k, tonumber(ARGV[4])) end
local f = {}
local all = redis.call('HGETALL', k)
for i = 1, #all, 2 do f[all[i]] = all[i + 1] end
local limit = tonumber(f['lim'] or ARGV[3])
local used = tonumber(f['used'] or '0')
local grant = tonumber(f['grant'] or '0')
local reserved = 0
for name, v in pairs(f) do
  if string.sub(name, 1, 2) == 'h:' then reserved = reserved + tonumber(v) end
end
return {limit + grant, used, reserved, limit + grant - used - reserved, grant,
  tonumber(f['x'] or '0')}
