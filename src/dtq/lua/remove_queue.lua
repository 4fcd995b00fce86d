-- remove_queue.lua: remove one idle queue's keys (DESIGN 11; docs/redis-schema.md, "Queue
-- lifetime"). The scheduler leader calls it twice per queue with its scan of the schedule in
-- between: "check" says whether the queue's own keys show it idle and, if so, returns a mark of
-- its activity; "remove" checks all of it again, requires the same mark, and then deletes the
-- ten streams (their consumer group and consumers with them), the last-submit time and the
-- queue's dtq:queues member. A paused flag is not touched: it stays until the queue is resumed.
--
-- Idle, in the queue's own keys: every one of its streams is empty (XLEN 0) and has no pending
-- entry, and its last activity is at least the idle TTL old on the Redis clock. The last
-- activity is the later of the last accepted submit (KEYS[2], written by submit.lua) and the
-- last entry ever added to one of its streams (a stream's last-generated id starts with the
-- Redis time of that XADD: a submit, a promotion or a DLQ requeue).
-- Delayed and retrying tasks are not in the queue's keys: the caller looks for them in
-- dtq:retry:schedule and dtq:retry:claimed after the check. The mark (the last-submit time and
-- every stream's last-generated id) makes that exact: a task of this queue can join the
-- schedule only by a submit (it writes KEYS[2]) or by the finish of an entry of these streams,
-- which was either there at the check (the check said busy) or added after it (its stream's
-- last id moved). Either changes the mark, and "remove" refuses. `default` is never removed.
--
-- KEYS[1] = dtq:queue:<queue>:last_submit   KEYS[2..11] = dtq:stream:<queue>:p9 .. p0
-- KEYS[12] = dtq:queues, flat layout only (the cluster layout's caller removes the name in its
--   own calls, around this one: docs/redis-schema.md, "The cluster layout")
-- KEYS[12..16], cluster layout only: the queue's dtq:retry:schedule, dtq:retry:claimed,
--   dtq:expiry, dtq:cancelled and dtq:stream:dead-letter, all of which must be empty (busy
--   "scheduled" or "dead_letters" otherwise: the flat layout's caller scans its shared sets, and
--   its dead letters outlive their queue's name in the one shared stream)
-- KEYS[17], cluster layout only: the queue's schedule index, which must be empty too (busy
--   "schedules": the firer finds a queue's schedules through dtq:queues; docs/schedules.md)
-- KEYS[18], cluster layout only: the queue's limits hash, which must be empty too (busy
--   "limits": a limit is found by its name through dtq:queues; docs/limits.md)
-- KEYS[#KEYS - 1] (13 flat, 19 cluster) = the queue's held zset, which must be empty (busy
--   "waiting": tasks a fair queue holds back from its streams; docs/limits.md). The fairness
--   hash stays: it follows the queue's limits, which outlive its name in the flat layout.
-- KEYS[#KEYS] (14 flat, 20 cluster) = the queue's workflow outbox, which must hold no entry
--   (busy "workflows": ends of workflow nodes not applied yet; docs/workflows.md); removed
--   with the streams.
-- ARGV[1] queue  [2] idle TTL ms  [3] consumer group  [4] "check" | "remove"
-- ARGV[5] the mark the check returned ("remove" only)
-- Returns {"idle", mark} (check) | {"removed"} (remove) | {"busy", why}, why one of: default,
--   in_flight (a pending entry), waiting (an entry not delivered), recent (activity within the
--   idle TTL), changed (remove: the mark moved since the check), workflows, scheduled,
--   dead_letters, schedules, limits (cluster layout)
local queue, ttl, group, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
if queue == 'default' then return {'busy', 'default'} end

-- The stream's last-generated id, or nil when there is no such stream.
local function last_id(stream)
  local info = redis.pcall('XINFO', 'STREAM', stream)
  if type(info) ~= 'table' or info.err then return nil end
  for i = 1, #info - 1, 2 do
    if info[i] == 'last-generated-id' then return info[i + 1] end
  end
  return nil
end

if redis.call('ZCARD', KEYS[#KEYS - 1]) > 0 then return {'busy', 'waiting'} end
if redis.call('EXISTS', KEYS[#KEYS]) == 1 and redis.call('XLEN', KEYS[#KEYS]) > 0 then
  return {'busy', 'workflows'}
end
if #KEYS == 20 then
  if redis.call('ZCARD', KEYS[17]) > 0 then return {'busy', 'schedules'} end
  if redis.call('HLEN', KEYS[18]) > 0 then return {'busy', 'limits'} end
  for k = 12, 14 do
    if redis.call('ZCARD', KEYS[k]) > 0 then return {'busy', 'scheduled'} end
  end
  if redis.call('SCARD', KEYS[15]) > 0 then return {'busy', 'scheduled'} end
  if redis.call('XLEN', KEYS[16]) > 0 then return {'busy', 'dead_letters'} end
end
local submitted = redis.call('GET', KEYS[1])
local latest = tonumber(submitted or '') or 0
local mark, present = {submitted or '-'}, {}
for k = 2, 11 do
  local id = last_id(KEYS[k])
  if id then
    present[#present + 1] = KEYS[k]
    -- NOGROUP (a stream without the group) means nothing is pending there.
    local p = redis.pcall('XPENDING', KEYS[k], group)
    if type(p) == 'table' and not p.err and tonumber(p[1]) > 0 then
      return {'busy', 'in_flight'}
    end
    if redis.call('XLEN', KEYS[k]) > 0 then return {'busy', 'waiting'} end
    local ms = tonumber(string.match(id, '^(%d+)-'))
    if ms and ms > latest then latest = ms end
  end
  mark[#mark + 1] = id or '-'
end
if now_ms() - latest < ttl then return {'busy', 'recent'} end
mark = table.concat(mark, ',')
if mode == 'check' then return {'idle', mark} end
if mark ~= ARGV[5] then return {'busy', 'changed'} end
if #present > 0 then redis.call('DEL', unpack(present)) end
redis.call('DEL', KEYS[1], KEYS[#KEYS])
if #KEYS == 14 then redis.call('SREM', KEYS[12], queue) end
return {'removed'}
