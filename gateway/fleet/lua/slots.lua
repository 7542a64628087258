-- Lease backend slots of one pool for one replica (gateway/core/slots.py states the rules).
-- KEYS[1] the pool's hash: field per replica -> "held,in_use,want,expires"
-- ARGV[1] replica id, [2] total slots of the fleet, [3] in use here, [4] wanted here,
--     [5] lease lifetime (s), [6] until when (Redis time, s) grants are capped at the fallback
--     share: the store's fleet state is new (replicas may still decide on that share), [7] live
--     replicas
-- Returns {grant, held, fleet held, fleet in use, fair target, contended (0/1)}.
local tm = redis.call('TIME')
local now = tonumber(tm[1]) + tonumber(tm[2]) / 1000000
local me = ARGV[1]
local total = tonumber(ARGV[2])
local in_use = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local ttl = tonumber(ARGV[5])
local capped_until = tonumber(ARGV[6])
local replicas = tonumber(ARGV[7])
local all = redis.call('HGETALL', KEYS[1])
local others_held, fleet_in_use, sum_want = 0, 0, want
local wants = {want}
for i = 1, #all, 2 do
  local f = all[i]
  if f ~= me then
    local h, u, w, e = string.match(all[i + 1], '^([^,]+),([^,]+),([^,]+),([^,]+)$')
    if h == nil or tonumber(e) < now then
      redis.call('HDEL', KEYS[1], f)
    else
      others_held = others_held + tonumber(h)
      fleet_in_use = fleet_in_use + tonumber(u)
      sum_want = sum_want + tonumber(w)
      wants[#wants + 1] = tonumber(w)
    end
  end
end
-- max-min fair share (water-filling) of total over the wants, rounded up
table.sort(wants)
local level = nil
local left = total
for i = 1, #wants do
  local share = left / (#wants - i + 1)
  if wants[i] <= share then
    left = left - wants[i]
  else
    level = share
    break
  end
end
local target = want
if level ~= nil and want > level then
  target = math.min(want, math.ceil(level - 1e-9))
end
local g = math.min(want, target, total - others_held)
if now < capped_until then  -- the store lost its state: replicas in fallback may still run
  g = math.min(g, math.max(1, math.floor(total / math.max(1, replicas))))
end
if g < 0 then g = 0 end
local held = math.max(in_use, g)
if held <= 0 and want <= 0 then
  redis.call('HDEL', KEYS[1], me)
else
  redis.call('HSET', KEYS[1], me,
    string.format('%d,%d,%d,%.3f', held, in_use, want, now + ttl))
end
redis.call('PEXPIRE', KEYS[1], 86400000)
local contended = 0
if sum_want > total then contended = 1 end
return {g, held, others_held + held, fleet_in_use + in_use, target, contended}
