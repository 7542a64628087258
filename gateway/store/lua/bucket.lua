-- Limit keys: a sliding-window request counter and a token bucket each, on Redis TIME.
-- The same arithmetic as gateway/core/limiter.py and gateway/store/memory.py (a contract test
-- runs one suite against both). One call applies a batch of ops atomically (a script runs
-- alone): the store sends at most a few hundred per call, all in one hash slot on a Cluster.
--
-- KEYS: two per op: this epoch's hash, the previous epoch's hash (same hash tag, same slot).
-- The key names carry the rule's parameters (a changed rule never inherits old counts). A
-- hash lives two epochs: its TTL is set once, when it is created, from the previous epoch's
-- state if there is one, so an active key carries on and an idle one simply disappears.
--
-- ARGV[1]          P, the number of parameter sets that follow
-- ARGV[2 .. 1+8P]  per set: limit window rate burst ttl wq wt admit_below
--                    limit: requests per window (0 = none); rate, burst: tokens (0 = none)
-- ARGV[2+8P ..]    one per op: "set,req_delta,tok_delta,offered,want_req,want_tok,reset,strict"
--   req_delta  + requests admitted outside a lease (charged), - an unused share given back
--   tok_delta  + tokens given back (unused share, refunds), - tokens charged
--   offered    requests that arrived (the demand signal)
--   want_req / want_tok  the share asked for (lease), or this request's cost (strict)
--   reset      1 = red was entered: write a token debt off (the balance goes to 0)
--   strict     1 = one request, all or nothing: admit if the window has room, the bucket is
--              not empty and the pressure is below admit_below; the bucket may go into debt
-- Returns {ops, now}: ops is "granted_req,granted_tok,admitted,offered,tokens" per op, joined
-- with ";"; now is the Redis time in seconds.
local tm = redis.call('TIME')
local now = tonumber(tm[1]) + tonumber(tm[2]) / 1000000
local nsets = tonumber(ARGV[1])
local sets = {}
for i = 0, nsets - 1 do
  local b = 2 + 8 * i
  sets[i] = {tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]),
             tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]),
             tonumber(ARGV[b + 6]), tonumber(ARGV[b + 7])}
end
local fields = {'w', 'c', 'p', 'oc', 'op', 't', 'u'}
local out = {}
local first = 2 + 8 * nsets
for i = first, #ARGV do
  local n = i - first
  local cur, prev = KEYS[2 * n + 1], KEYS[2 * n + 2]
  local si, rd, td, off, wr, wtk, rs, st = string.match(ARGV[i],
    '^([^,]+),([^,]+),([^,]+),([^,]+),([^,]+),([^,]+),([^,]+),([^,]+)$')
  local prm = sets[tonumber(si)]
  local limit, window, rate, burst = prm[1], prm[2], prm[3], prm[4]
  local ttl, wq, wt, admit_below = prm[5], prm[6], prm[7], prm[8]
  local req_delta, tok_delta, offered = tonumber(rd), tonumber(td), tonumber(off)
  local want_req, want_tok = tonumber(wr), tonumber(wtk)

  local s = redis.call('HMGET', cur, unpack(fields))
  local fresh = not s[1]
  if fresh then
    local old = redis.call('HMGET', prev, unpack(fields))
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
  if rate > 0 and now > u then t = math.min(burst, t + (now - u) * rate) end
  if now > u then u = now end

  -- What the replica reports.
  c = c + req_delta
  if c < 0 then p = math.max(0, p + c); c = 0 end
  oc = oc + offered
  t = t + tok_delta
  if t > burst then t = burst end
  if t < -burst then t = -burst end
  if rs == '1' and t < 0 then t = 0 end

  local gr, gt = 0, 0
  local adm = p * f + c
  if st == '1' then
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

  redis.call('HSET', cur, 'w', w, 'c', c, 'p', p, 'oc', oc, 'op', op, 't', t, 'u', u)
  if fresh then redis.call('EXPIRE', cur, ttl) end
  out[n + 1] = gr .. ',' .. gt .. ',' .. (p * f + c) .. ',' .. (op * f + oc) .. ',' .. t
end
return {table.concat(out, ';'), tostring(now)}
