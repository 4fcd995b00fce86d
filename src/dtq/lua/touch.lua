-- touch.lua: the heartbeat's lease renewal (DESIGN 3, contract section 6). For each in-flight
-- entry, reset its idle time with XCLAIM ... IDLE 0 JUSTID, but only where XPENDING still names
-- this consumer as the owner: Redis checks no owner on XCLAIM, so a plain XCLAIM from a resumed
-- zombie would steal back an entry another worker runs. JUSTID, because a plain XCLAIM bumps
-- the delivery counter at every beat.
--
-- KEYS[i] = the stream of the i-th entry (a stream may repeat)
-- ARGV[1] consumer group  [2] consumer (worker id)  ARGV[2 + i] = the i-th entry id
-- Returns the 1-based indexes of the entries this consumer no longer owns.
local group, me = ARGV[1], ARGV[2]
local lost = {}
for i = 1, #KEYS do
  local id = ARGV[2 + i]
  -- pcall: a stream or group that is gone (NOGROUP) means the entry is not ours any more.
  local p = redis.pcall('XPENDING', KEYS[i], group, id, id, 1)
  local owned = p.err == nil and #p > 0 and p[1][2] == me
  if owned then
    redis.call('XCLAIM', KEYS[i], group, me, 0, id, 'IDLE', 0, 'JUSTID')
  else
    lost[#lost + 1] = i
  end
end
return lost
