-- touch.lua: the heartbeat's lease renewal (DESIGN 3, contract section 6). For each in-flight
-- entry, reset its idle time with XCLAIM ... IDLE 0 JUSTID, but only where XPENDING still names
-- this consumer as the owner: Redis checks no owner on XCLAIM, so a plain XCLAIM from a resumed
-- zombie would steal back an entry another worker runs. JUSTID, because a plain XCLAIM bumps
-- the delivery counter at every beat.
--
-- An entry removed from its stream outside dtq (XDEL, XTRIM, the stream deleted) is not lost
-- while its task hash is still RUNNING with this entry and this worker: nobody else can hold
-- it, and from then on that hash is the lease (finish.lua accepts the entry on it;
-- docs/delivery-guarantees.md, "Entries removed outside dtq"). Redis 7 drops such an entry from
-- the pending list at its next XCLAIM and 6.2 keeps it, so touch acknowledges it itself, the
-- same on every version, and reports it once. An entry this consumer does not own is lost,
-- unless it is gone from its stream and the hash still names this worker (it was acknowledged
-- here before, or by Redis 7's XCLAIM in start.lua, or by a reaper that met it deleted).
--
-- KEYS[2i - 1] = the stream of the i-th entry (a stream may repeat)
-- KEYS[2i]     = dtq:task:<id> of the i-th entry's task
-- ARGV[1] consumer group  [2] consumer (worker id)  ARGV[2 + i] = the i-th entry id
-- Returns {lost, deleted}: the 1-based indexes of the entries this consumer no longer holds, and
-- of those it owned that were gone from their stream (acknowledged by this call).
local group, me = ARGV[1], ARGV[2]
local lost, deleted = {}, {}
for i = 1, #KEYS / 2 do
  local stream, id = KEYS[2 * i - 1], ARGV[2 + i]
  -- pcall: a stream or group that is gone (NOGROUP) holds no entry of anybody's.
  local p = redis.pcall('XPENDING', stream, group, id, id, 1)
  local owned = p.err == nil and #p > 0 and p[1][2] == me
  local r = redis.pcall('XRANGE', stream, id, id, 'COUNT', 1)
  local gone = r.err == nil and #r == 0
  if not gone then
    if owned then
      redis.call('XCLAIM', stream, group, me, 0, id, 'IDLE', 0, 'JUSTID')
    else
      lost[#lost + 1] = i
    end
  else
    local h = redis.call('HMGET', KEYS[2 * i], 'status', 'entry_id', 'worker_id')
    if h[1] ~= 'running' or h[2] ~= id or h[3] ~= me then
      lost[#lost + 1] = i
    elseif owned then
      redis.call('XACK', stream, group, id)
      deleted[#deleted + 1] = i
    end
  end
end
return {lost, deleted}
