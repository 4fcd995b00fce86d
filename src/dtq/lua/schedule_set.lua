-- schedule_set.lua: pause, resume or delete a schedule (docs/schedules.md), atomically with
-- the firer (every change moves `rev`, so a firing planned before it does nothing).
--
-- pause: `paused` = 1 with its reason, index score +inf (never due). A pause with reason
--   "removed from code" (a worker found a schedule declared in code that its code no longer
--   declares) applies only to a schedule from code that is not paused already.
-- resume: `paused` = 0, index score = the cursor, which stayed where the pause left it: the
--   ticks of the pause are due at once, and the firer applies the catch-up policy to them.
-- delete: the hash, its history and its index member.
--
-- KEYS[1] = the schedule's hash  KEYS[2] = its history  KEYS[3] = the schedule index
-- KEYS[4] = the audit stream
-- ARGV[1] name  [2] op: pause | resume | delete  [3] pause reason  [4] history cap
-- ARGV[5] events channel  [6] event id  [7] audit actor  [8] request id
-- Returns 1 when the schedule changed, 0 when it already was so, -1 when there is none
local call = redis.call
local h, khist, index = KEYS[1], KEYS[2], KEYS[3]
local name, op, reason = ARGV[1], ARGV[2], ARGV[3]
local st = call('HMGET', h, 'queue', 'paused', 'source', 'cursor', 'buffered_ms')
if not st[1] then return -1 end
local queue = st[1]
local ts = iso(now_ms())
local change
if op == 'delete' then
  call('DEL', h, khist)
  call('ZREM', index, name)
  change = 'deleted'
elseif op == 'pause' then
  if st[2] == '1' then return 0 end
  if reason == 'removed from code' and st[3] ~= 'code' then return 0 end
  call('HSET', h, 'paused', '1', 'paused_reason', reason)
  call('ZADD', index, '+inf', name)
  change = 'paused'
else
  if st[2] ~= '1' then return 0 end
  call('HSET', h, 'paused', '0', 'paused_reason', '')
  local cursor = st[4] or ''
  local score = '+inf'
  if cursor ~= '' then score = cursor
  elseif (st[5] or '') ~= '' then score = now_ms() end
  call('ZADD', index, score, name)
  change = 'resumed'
end
if op ~= 'delete' then
  call('HINCRBY', h, 'rev', 1)
  local e = {ts = ts, decision = change}
  if reason ~= '' then e.reason = reason end
  call('LPUSH', khist, cjson.encode(e))
  call('LTRIM', khist, 0, tonumber(ARGV[4]) - 1)
end
emit(ARGV[5], ARGV[6], ts, 'CONFIGURATION_CHANGED', cjson.null, queue, cjson.null, 0, nil,
  {schedule = name, change = change})
audit(KEYS[4], ARGV[7], ARGV[8], 'schedule_' .. op, '', queue, ts, name)
return 1
