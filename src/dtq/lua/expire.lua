-- expire.lua: mark one not-started task EXPIRED (DESIGN 6): mark_expired and the sweep.
-- A retrying task passes RETRYING -> QUEUED -> EXPIRED here (the transition table is not
-- widened; the history shows both steps). Index cleanup: schedule, claim and expiry members
-- and the stream entry go (a delivered, not-started entry stays for its consumer to ACK).
--
-- KEYS[1] = dtq:task:<id>   KEYS[2] = dtq:task:<id>:history   KEYS[3] = dtq:retry:schedule
-- KEYS[4] = dtq:retry:claimed   KEYS[5] = dtq:expiry   KEYS[6] = dtq:stream:<queue>:p<N>
-- KEYS[7] = dtq:idempotency:<queue>:<key> (placeholder when none)   KEYS[8] = dtq:stream:audit
-- KEYS[9] = dtq:task:<id>:payload (its TTL kept with the hash's)
-- ARGV[1] task_id  [2] mode: "manual" (now, whatever expires_at says) | "sweep" (only if due)
-- ARGV[3] task retention s  [4] idempotency TTL s  [5] events channel  [6] event_id
-- ARGV[7] audit actor ("" = no audit entry, as for the sweep)  [8] audit request_id or ""
-- An audit entry (action "expire") is appended only when the task was marked expired.
-- Returns {"expired", from} | {"skip", why} | {"err", "NOT_FOUND"} | {"err", "STATUS", status}
local h = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'queue', 'task_type', 'attempt',
  'idempotency_key', 'expires_at_ms', 'expires_at')
local status = h[1]
local sweep = ARGV[2] == 'sweep'
if not status then
  if sweep then redis.call('ZREM', KEYS[5], ARGV[1]); return {'skip', 'gone'} end
  return {'err', 'NOT_FOUND'}
end
local now = now_ms()
if status ~= 'pending' and status ~= 'queued' and status ~= 'retrying' then
  if sweep then redis.call('ZREM', KEYS[5], ARGV[1]); return {'skip', status} end
  return {'err', 'STATUS', status}
end
-- HMGET gives false for a missing field: tonumber(h[7] or '') is nil for "no deadline".
local exp_ms = tonumber(h[7] or '')
if sweep and exp_ms == nil then
  redis.call('ZREM', KEYS[5], ARGV[1])
  return {'skip', 'no_deadline'}
end
if sweep and exp_ms > now then
  -- The deadline moved (a reschedule extended it): score the member with it again, so it is
  -- not looked at every second and does not hold a place in every batch.
  redis.call('ZADD', KEYS[5], exp_ms, ARGV[1])
  return {'skip', 'not_due'}
end
local ts = iso(now)
local retention = tonumber(ARGV[3])
local reason = sweep and 'ttl' or 'mark_expired'
local from = status
if status == 'retrying' then
  hist(KEYS[2], retention, ts, 'retrying', 'queued', h[5], nil, reason)
  from = 'queued'
end
redis.call('HSET', KEYS[1], 'status', 'expired', 'expired_at', ts, 'updated_at', ts)
keep(KEYS[1], KEYS[9], retention)
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
if status == 'queued' then drop_entry(KEYS[6], 'workers', h[2]) end
idem_state(KEYS[7], h[6], ARGV[1], 'failed', ts, ARGV[4])
hist(KEYS[2], retention, ts, from, 'expired', h[5], nil, reason, {expired_at = ts})
local meta = {expired_at = ts, reason = reason}
if h[8] and h[8] ~= '' then meta.expires_at = h[8] end
emit(ARGV[5], ARGV[6], ts, 'TASK_EXPIRED', ARGV[1], h[3], h[4], h[5], nil, meta)
audit(KEYS[8], ARGV[7], ARGV[8], 'expire', ARGV[1], h[3], ts)
return {'expired', status}
