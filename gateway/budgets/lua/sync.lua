-- One replica's sync of one budget key in one period (a hash): report usage, give back,
-- lease, heartbeat. Atomic; time from Redis TIME (no replica clock decides an expiry).
-- KEYS[1] the budget hash
-- ARGV: rid, seq, limit, used, back, want, held, ttl_ms, expire_at (Unix s)
-- Replayed seq (the reply was lost): nothing is applied again, the same grant is returned.
-- Returns {granted, used, reserved (all replicas), limit_left, lost, expired_tokens,
--          then per expired replica: its id, tokens counted as spent, of which reservations}
local k = KEYS[1]
local rid = ARGV[1]
local seq = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local u = tonumber(ARGV[4])
local back = tonumber(ARGV[5])
local want = tonumber(ARGV[6])
local held = tonumber(ARGV[7])
local ttl = tonumber(ARGV[8])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local f = {}
local all = redis.call('HGETALL', k)
for i = 1, #all, 2 do f[all[i]] = all[i + 1] end
local function num(name) return tonumber(f[name] or '0') end

local new = #all == 0
local used, out, grant = num('used'), num('out'), num('grant')
local lost = 0
local prev = f['s:' .. rid]
if prev ~= nil and tonumber(prev) == seq then
  -- a replay: answer as the first time
  local granted = tonumber(f['r:' .. rid] or '0')
  local reserved = 0
  for name, v in pairs(f) do
    if string.sub(name, 1, 2) == 'h:' then reserved = reserved + tonumber(v) end
  end
  return {granted, used, reserved, limit + grant - used - out, 0, 0}
end
if prev == nil and seq > 1 then lost = 1 end

-- Replicas not heard from within their ttl: everything they held counts as spent (their
-- reservations in flight, and the free share, from which they may have served requests whose
-- usage they could not report any more): a dead replica never makes the tally too low.
local expired = {}
local expired_tokens = 0
for name, v in pairs(f) do
  if string.sub(name, 1, 2) == 'e:' then
    local r = string.sub(name, 3)
    if r ~= rid and tonumber(v) < now then
      local h = tonumber(f['h:' .. r] or '0')
      local l = tonumber(f['l:' .. r] or '0')
      used = used + l
      out = out - l
      expired_tokens = expired_tokens + l
      redis.call('HDEL', k, 'e:' .. r, 'h:' .. r, 'l:' .. r, 's:' .. r, 'r:' .. r)
      f['h:' .. r] = nil
      if l > 0 then
        table.insert(expired, r)
        table.insert(expired, l)
        table.insert(expired, h)
      end
    end
  end
end
if expired_tokens > 0 then redis.call('HINCRBY', k, 'x', expired_tokens) end

local l = tonumber(f['l:' .. rid] or '0')
-- usage: charged in full; what it consumed of the lease leaves it (never below 0)
used = used + u
local take = math.min(l, u)
l = l - take
out = out - take
-- give back
back = math.min(back, l)
l = l - back
out = out - back
-- lease what is left, up to want
local left = limit + grant - used - out
local granted = 0
if want > 0 and left > 0 then granted = math.min(want, left) end
l = l + granted
out = out + granted
if held > l then held = l end

redis.call('HSET', k, 'used', used, 'out', out, 'lim', limit,
  'l:' .. rid, l, 'h:' .. rid, held, 'e:' .. rid, now + ttl, 's:' .. rid, seq, 'r:' .. rid, granted)
if new then redis.call('EXPIREAT', k, tonumber(ARGV[9])) end

local reserved = 0
f['h:' .. rid] = tostring(held)
for name, v in pairs(f) do
  if string.sub(name, 1, 2) == 'h:' then reserved = reserved + tonumber(v) end
end
local res = {granted, used, reserved, limit + grant - used - out, lost, expired_tokens}
for _, v in ipairs(expired) do table.insert(res, v) end
return res
