-- drop_consumers.lua: delete consumers of one stream's consumer group that hold no pending
-- entry, so that consumer counts stay bounded (docs/redis-schema.md). XGROUP DELCONSUMER destroys the
-- consumer's pending entries, which would lose their tasks (RUNNING, with no pending entry left
-- for a reaper to claim), so the check and the delete are this one atomic step: a consumer that
-- holds an entry is never deleted. A read that delivers it an entry runs either before (then it
-- holds that entry and stays) or after (the read creates the consumer again).
--
-- KEYS[1] = dtq:stream:<queue>:p<N>
-- ARGV[1] = consumer group ("workers")
-- ARGV[2] = minimum idle time in ms (0: any); a consumer that read or claimed more recently
--           stays (Redis's XINFO CONSUMERS "idle")
-- ARGV[3..] = names of the consumers to delete where it is safe
-- Returns the names deleted; a stream, group or consumer that does not exist: nothing deleted.
local rows = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if rows.err then return {} end
local found = {}
for _, row in ipairs(rows) do
  local c = {}
  for i = 1, #row, 2 do c[row[i]] = row[i + 1] end
  found[c.name] = c
end
local min_idle = tonumber(ARGV[2])
local dropped = {}
for i = 3, #ARGV do
  local c = found[ARGV[i]]
  if c and tonumber(c.pending) == 0 and tonumber(c.idle) >= min_idle then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[i])
    dropped[#dropped + 1] = ARGV[i]
  end
end
return dropped
