-- adopt.lua: take over the pending entries of one dead consumer of one stream (a
-- `--processes` child its supervisor reaped; DESIGN 3). XPENDING for that consumer, then XCLAIM
-- each entry to this worker, in one script: Redis checks no owner on XCLAIM, so a claim after a
-- separate XPENDING would take an entry that a peer's reaper claimed in between, and both would
-- run it. Here an entry is claimed only while XPENDING names the dead consumer as its owner.
--
-- KEYS[1] = dtq:stream:<queue>:p<N>
-- ARGV[1] consumer group  [2] this worker (the new owner)  [3] the dead consumer
-- ARGV[4] count: entries to claim at most (the free slots of this worker)
-- Returns {entries, gone}: entries {{id, {field, value, ...}}, ...} as XCLAIM gives them;
-- gone: how many pending ids XCLAIM returned no entry for (deleted from the stream while
-- pending: Redis 6.2 keeps such an id pending, now for this worker; Redis 7 drops it).
local group, me, dead = ARGV[1], ARGV[2], ARGV[3]
local p = redis.pcall('XPENDING', KEYS[1], group, '-', '+', tonumber(ARGV[4]), dead)
if type(p) == 'table' and p.err then
  if string.find(p.err, 'NOGROUP', 1, true) then return {{}, 0} end
  return p
end
local entries, gone = {}, 0
for _, row in ipairs(p) do
  local got = redis.call('XCLAIM', KEYS[1], group, me, 0, row[1])
  if got[1] then
    entries[#entries + 1] = got[1]
  else
    gone = gone + 1
  end
end
return {entries, gone}
