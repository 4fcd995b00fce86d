-- _batch.lua: the tail of a batched script (dtq/scripts.py, BATCHED). The script of the
-- same name's body stands before it as the local function run_one(KEYS, ARGV), and this runs
-- it once per call of the batch, in order, in one EVALSHA: the checks and writes of each call
-- are the script's own, unchanged (fencing included); only the per-EVALSHA cost is shared.
-- What every call of the batch has at the same place, keys or args, is sent once:
-- ARGV[1] = n, the number of calls; ARGV[2] = sk, how many key positions they share, ARGV[3] =
-- sa, how many arg positions; then the sk key positions and the sa arg positions (1-based);
-- then the sa shared args' values; then, for each call, its number of keys and of args besides
-- the shared ones; then every call's own args, one call after another. KEYS: the sk shared
-- keys' values, then every call's own keys, one call after another. Each call's KEYS and ARGV
-- are rebuilt whole before it runs. All keys share one slot (a cluster batch is one slot's).
-- Returns one reply per call, in order: the script's reply, or {err = message} for a call that
-- raised (the others still run, as if each had been a call of its own).
-- The batch is one atomic step, and one instant: its calls share one Redis TIME and its ISO
-- form (now_ms and iso of _lib.lua, as the calls see them), read and formatted once.
local batch_ms = now_ms()
now_ms = function() return batch_ms end
local plain_iso, iso_ms, iso_text = iso, nil, nil
iso = function(ms)
  if ms ~= iso_ms then iso_ms, iso_text = ms, plain_iso(ms) end
  return iso_text
end

local n, sk, sa = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local kshared, ashared = {}, {}
for i = 1, sk do kshared[tonumber(ARGV[3 + i])] = KEYS[i] end
for i = 1, sa do ashared[tonumber(ARGV[3 + sk + i])] = ARGV[3 + sk + sa + i] end
local counts = 3 + sk + 2 * sa  -- ARGV[counts + 2i - 1], ARGV[counts + 2i]: the i-th's own
local out = {}
local kbase, abase = sk, counts + 2 * n
for i = 1, n do
  local nk, na = tonumber(ARGV[counts + 2 * i - 1]), tonumber(ARGV[counts + 2 * i])
  local k, a = {}, {}
  local q = 0
  for j = 1, nk + sk do
    local v = kshared[j]
    if v == nil then q = q + 1; v = KEYS[kbase + q] end
    k[j] = v
  end
  q = 0
  for j = 1, na + sa do
    local v = ashared[j]
    if v == nil then q = q + 1; v = ARGV[abase + q] end
    a[j] = v
  end
  kbase, abase = kbase + nk, abase + na
  local ok, r = pcall(run_one, k, a)
  if not ok then
    if type(r) == 'table' and r.err then
      r = {err = r.err}
    else
      r = {err = 'ERR ' .. tostring(r)}
    end
  elseif r == nil then
    r = false  -- a hole would end the array here
  end
  out[i] = r
end
return out
