-- cancel.lua: cancel one task (contract sections 1, 11; DESIGN 10).
-- Not started (pending, queued, retrying): CANCELLED now; its schedule, claim and expiry members
-- and its stream entry go (an entry already delivered but not started stays until its
-- consumer's start script sees CANCELLED; the task id is then in dtq:cancelled meanwhile).
-- Running: cancel_requested=1, the worker stops it. Terminal: refused.
--
-- KEYS[1] = dtq:task:<id>   KEYS[2] = dtq:task:<id>:history   KEYS[3] = dtq:retry:schedule
-- KEYS[4] = dtq:retry:claimed   KEYS[5] = dtq:expiry   KEYS[6] = dtq:stream:<queue>:p<N>
-- KEYS[7] = dtq:cancelled   KEYS[8] = dtq:idempotency:<queue>:<key> (placeholder when none)
-- KEYS[9] = dtq:stream:audit
-- KEYS[10] = dtq:task:<id>:payload (an older dtq's payload key: own_payload in _lib)
-- KEYS[11] = dtq:task:<id>:done (where a waiting producer is told: retain in _lib)
-- KEYS[12] = the queue's held zset (a task held by fairness leaves it: docs/limits.md)
-- KEYS[13] = the queue's workflow outbox (a workflow node's end: retain in _lib)
-- ARGV[1] task_id  [2] task retention s  [3] idempotency TTL s  [4] events channel
-- ARGV[5] event_id  [6] reason (e.g. "cancel", "purge")
-- ARGV[7] audit actor ("" = no audit entry)  [8] audit request_id or ""
-- An audit entry (action "cancel") is appended when the task was cancelled or its cancellation
-- requested; a refusal changes nothing and writes none.
-- Returns {"cancelled", from} | {"requested"} | {"err", "NOT_FOUND"} | {"err", "TERMINAL", status}
local h = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'queue', 'task_type', 'attempt',
  'idempotency_key', 'metadata')
local status = h[1]
if not status then return {'err', 'NOT_FOUND'} end
if status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  audit(KEYS[9], ARGV[7], ARGV[8], 'cancel', ARGV[1], h[3], iso(now_ms()))
  return {'requested'}
end
if status ~= 'pending' and status ~= 'queued' and status ~= 'retrying' then
  return {'err', 'TERMINAL', status}
end
local ts = iso(now_ms())
local retention = tonumber(ARGV[2])
local fields = {'status', 'cancelled', 'updated_at', ts, 'finished_at', ts}
if ARGV[6] == 'purge' then
  -- Append the flag to the JSON text: a cjson round trip would turn [] into {} and round big
  -- integers in the user's metadata. Appended last, it wins over a user key of the same name.
  local meta = h[7] or ''
  if meta == '' or meta == '{}' then meta = '{"purged":true}'
  else meta = string.sub(meta, 1, -2) .. ',"purged":true}' end
  fields[#fields + 1] = 'metadata'
  fields[#fields + 1] = meta
end
redis.call('HSET', KEYS[1], unpack(fields))
retain(KEYS[1], KEYS[10], retention, KEYS[11], KEYS[13])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
if status == 'queued' then
  if not drop_entry(KEYS[6], 'workers', h[2]) then redis.call('SADD', KEYS[7], ARGV[1]) end
  redis.call('ZREM', KEYS[12], ARGV[1])
end
idem_state(KEYS[8], h[6], ARGV[1], 'failed', ts, ARGV[3])
hist(KEYS[2], retention, ts, status, 'cancelled', h[5], nil, ARGV[6])
emit(ARGV[4], ARGV[5], ts, 'TASK_CANCELLED', ARGV[1], h[3], h[4], h[5], nil, {from = status})
audit(KEYS[9], ARGV[7], ARGV[8], 'cancel', ARGV[1], h[3], ts)
return {'cancelled', status}
