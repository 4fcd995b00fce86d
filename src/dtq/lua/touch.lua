-- touch.lua: the heartbeat's lease renewal (DESIGN 3, contract section 6). For each in-flight
-- entry, reset its idle time with XCLAIM ... IDLE 0 JUSTID, but only where XPENDING still names
-- this consumer as the owner: Redis checks no owner on XCLAIM, so a plain XCLAIM from a resumed
-- zombie would steal back an entry another worker runs. JUSTID, because a plain XCLAIM bumps
-- the delivery counter at every beat.
--
-- An entry removed from its stream outside dtq (XDEL, XTRIM, the stream deleted) is not lost:
-- nobody else can hold it. Redis 7 drops such an entry from the pending list at the next XCLAIM
-- (6.2 keeps it), so touch acknowledges it itself, the same on every version, and reports it:
-- from then on the task hash (RUNNING, this worker, this attempt, this entry id) is the lease,
-- and finish.lua accepts the entry on it (docs/delivery-guarantees.md, "Entries removed outside
-- dtq"). An entry this consumer does not own is lost only while it is still in the stream.
--
-- KEYS[i] = the stream of the i-th entry (a stream may repeat)
-- ARGV[1] consumer group  [2] consumer (worker id)  ARGV[2 + i] = the i-th entry id
-- Returns {lost, deleted}: the 1-based indexes of the entries this consumer no longer owns, and
-- of those it owned that were gone from their stream (acknowledged by this call: each is
-- reported once).
local group, me = ARGV[1], ARGV[2]
local lost, deleted = {}, {}
for i = 1, #KEYS do
  local id = ARGV[2 + i]
  -- pcall: a stream or group that is gone (NOGROUP) holds no entry of anybody's.
  local p = redis.pcall('XPENDING', KEYS[i], group, id, id, 1)
  local owned = p.err == nil and #p > 0 and p[1][2] == me
  local r = redis.pcall('XRANGE', KEYS[i], id, id, 'COUNT', 1)
  local gone = r.err == nil and #r == 0
  if gone then
    if owned then
      redis.call('XACK', KEYS[i], group, id)
      deleted[#deleted + 1] = i
    end
  elseif owned then
    redis.call('XCLAIM', KEYS[i], group, me, 0, id, 'IDLE', 0, 'JUSTID')
  else
    lost[#lost + 1] = i
  end
end
return {lost, deleted}
