-- read.lua: one read of a worker's poll loop (contract section 6, DESIGN 3): XREADGROUP ">"
-- on the served streams in strict priority order (p9 first across the queues), each for what
-- is left of `count`, until `count` entries are read; the streams of a paused queue are not
-- read. A script cannot block: when it read nothing at all it returns, per stream it read,
-- the id to XREAD BLOCK from: the stream's last entry id (XREVRANGE + - COUNT 1), or 0-0 when
-- the stream is empty. The read found nothing after the group's last-delivered id, so every
-- entry of the stream is delivered and that id stands for the last-delivered one: an XREAD
-- BLOCK from it consumes nothing and wakes on any entry added after this script.
--
-- KEYS[1..m]       = dtq:queue:<queue>:paused of each served queue
-- KEYS[m+1..m+n]   = dtq:stream:<queue>:p<N>, the served streams in the order to read them:
--                    priority-major (p9 of queues 1..m, then p8 of queues 1..m, ...), so the
--                    k-th stream is queue (k - 1) % m + 1's (ReadPlan in dtq/calls.py)
-- ARGV[1] consumer group  [2] consumer (worker id)  [3] count: entries to read at most (>= 1)
-- ARGV[4] m (the number of queues)
-- Returns {entries, nogroup, paused, since}:
--   entries  {k, items, k', items', ...}: the k-th stream's entries as XREADGROUP gives them
--            ({{id, {field, value, ...}}, ...}), streams in reading order
--   nogroup  {k, ...}: streams without the consumer group (or gone): create it, read again
--   paused   {q, ...}: the queues whose paused flag is "1"
--   since    {k, id, ...}: when nothing was read and no group is missing, every stream read
local m = tonumber(ARGV[4])
local group, consumer = ARGV[1], ARGV[2]
local left = tonumber(ARGV[3])

local paused, is_paused = {}, {}
for q = 1, m do
  if redis.call('GET', KEYS[q]) == '1' then
    paused[#paused + 1] = q
    is_paused[q] = true
  end
end

local entries, nogroup, served = {}, {}, {}
for k = 1, #KEYS - m do
  if left <= 0 then break end
  if not is_paused[(k - 1) % m + 1] then
    served[#served + 1] = k
    local r = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', left,
      'STREAMS', KEYS[m + k], '>')
    if type(r) == 'table' and r.err then
      if not string.find(r.err, 'NOGROUP', 1, true) then return r end
      nogroup[#nogroup + 1] = k
    elseif r then
      local items = r[1][2]
      entries[#entries + 1] = k
      entries[#entries + 1] = items
      left = left - #items
    end
  end
end

local since = {}
if #entries == 0 and #nogroup == 0 then
  for _, k in ipairs(served) do
    local last = redis.call('XREVRANGE', KEYS[m + k], '+', '-', 'COUNT', 1)
    since[#since + 1] = k
    since[#since + 1] = last[1] and last[1][1] or '0-0'
  end
end
return {entries, nogroup, paused, since}
