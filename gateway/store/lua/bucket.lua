-- One limit key: a sliding-window request counter and a token bucket, on Redis TIME.
-- The same arithmetic as gateway/core/limiter.py and gateway/store/memory.py (a contract test
-- runs one suite against both). Atomic: a script runs alone.
--
-- KEYS[1]  this epoch's hash        KEYS[2]  the previous epoch's hash (same hash slot)
-- The key names carry the rule's parameters (a changed rule never inherits old counts). A
-- hash lives two epochs: its TTL is set once, when it is created, from the previous epoch's
-- state if there is one, so an active key carries on and an idle one simply disappears.
--
-- ARGV: limit window rate burst ttl req_delta tok_delta offered want_req want_tok reset strict
--       wq wt admit_below
--   limit      requests per window (0 = no request limit)     rate/burst  tokens (0 = none)
--   req_delta  + requests admitted outside a lease (charged), - an unused share given back
--   tok_delta  + tokens given back (unused share, refunds), - tokens charged
--   offered    requests that arrived (the demand signal)
--   want_req / want_tok  the share asked for (lease), or this request's cost (strict)
--   reset      1 = red was entered: write a token debt off (the balance goes to 0)
--   strict     1 = one request, all or nothing: admit if the window has room, the bucket is
--              not empty and the pressure is below admit_below; the bucket may go into debt
-- Returns (as strings): granted requests, granted tokens, admitted estimate, offered
-- estimate, tokens available, Redis time.
local tm = redis.call('TIME')
local now = tonumber(tm[1]) + tonumber(tm[2]) / 1000000
local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local rate = tonumber(ARGV[3])
local burst = tonumber(ARGV[4])
local ttl = tonumber(ARGV[5])
local req_delta = tonumber(ARGV[6])
local tok_delta = tonumber(ARGV[7])
local offered = tonumber(ARGV[8])
local want_req = tonumber(ARGV[9])
local want_tok = tonumber(ARGV[10])
local reset = ARGV[11] == '1'
local strict = ARGV[12] == '1'
local wq = tonumber(ARGV[13])
local wt = tonumber(ARGV[14])
local admit_below = tonumber(ARGV[15])

local fields = {'w', 'c', 'p', 'oc', 'op', 't', 'u'}
local s = redis.call('HMGET', KEYS[1], unpack(fields))
local fresh = not s[1]
if fresh then
  local old = redis.call('HMGET', KEYS[2], unpack(fields))
  if old[1] then s = old end
end
local w = tonumber(s[1]) or -1
local c = tonumber(s[2]) or 0
local p = tonumber(s[3]) or 0
local oc = tonumber(s[4]) or 0
local op = tonumber(s[5]) or 0
local t = tonumber(s[6]) or burst
local u = tonumber(s[7]) or now

-- Roll the fixed windows.
local pos = now / window
local idx = math.floor(pos)
if idx ~= w then
  if idx == w + 1 then p = c; op = oc else p = 0; op = 0 end
  c = 0; oc = 0; w = idx
end
local f = 1 - (pos - idx)

-- Refill.
if rate > 0 and now > u then
  t = math.min(burst, t + (now - u) * rate)
end
if now > u then u = now end

-- What the replica reports.
c = c + req_delta
if c < 0 then p = math.max(0, p + c); c = 0 end
oc = oc + offered
t = t + tok_delta
if t > burst then t = burst end
if t < -burst then t = -burst end
if reset and t < 0 then t = 0 end

local gr, gt = 0, 0
local adm = p * f + c
if strict then
  local ok = true
  if limit > 0 and adm + 1 > limit then ok = false end
  if rate > 0 and t <= 0 then ok = false end
  if ok then
    local q, tu = 0, 0
    if limit > 0 then q = adm / limit end
    if rate > 0 then tu = math.min(1, 1 - t / burst) end
    if wq * q + wt * tu >= admit_below then ok = false end
  end
  if ok then
    c = c + 1
    gr = 1
    if rate > 0 and want_tok > 0 then
      t = math.max(-burst, t - want_tok)
      gt = want_tok
    end
  end
else
  if limit > 0 and want_req > 0 then
    gr = math.max(0, math.min(want_req, math.floor(limit - adm)))
    c = c + gr
  end
  if rate > 0 and want_tok > 0 and t > 0 then
    gt = math.min(want_tok, t)
    t = t - gt
  end
end

redis.call('HSET', KEYS[1], 'w', w, 'c', c, 'p', p, 'oc', oc, 'op', op, 't', t, 'u', u)
if fresh then redis.call('EXPIRE', KEYS[1], ttl) end
return {tostring(gr), tostring(gt), tostring(p * f + c), tostring(op * f + oc), tostring(t),
        tostring(now)}
