-- _batch.lua: the tail of a batched script (dtq/scripts.py, BATCHED). The script of the
-- same name's body stands before it as the local function run_one(KEYS, ARGV), and this runs
-- it once per call of the batch, in order, in one EVALSHA: the checks and writes of each call
-- are the script's own, unchanged (fencing included); only the per-EVALSHA cost is shared.
-- KEYS: every call's keys, one after another. ARGV[1] = n, the number of calls; for the i-th,
-- ARGV[2i] its number of keys and ARGV[2i + 1] its number of args; then every call's args,
-- one after another. All keys share one slot (a cluster batch is one slot's calls).
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

local n = tonumber(ARGV[1])
local out = {}
local kbase, abase = 0, 2 * n + 1
for i = 1, n do
  local nk, na = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local k, a = {}, {}
  for j = 1, nk do k[j] = KEYS[kbase + j] end
  for j = 1, na do a[j] = ARGV[abase + j] end
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
