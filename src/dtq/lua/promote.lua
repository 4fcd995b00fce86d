-- promote.lua: move one claimed task from the retry schedule into its stream (contract
-- section 4, DESIGN 3, 6, 10). Only a task that is still claimed and still PENDING (delayed)
-- or RETRYING is promoted; for anything else the claim is dropped and nothing else changes,
-- so a stale or repeated promote never makes a second stream entry.
-- A task whose deadline (expires_at_ms) is due on the Redis clock expires here instead of
-- running: PENDING -> EXPIRED, or RETRYING -> QUEUED -> EXPIRED (the transition table is not
-- widened; the history shows both steps), idempotency state failed, TASK_EXPIRED.
-- Otherwise: XADD with the entry fields of contract section 2 (attempt = hash attempt + 1;
-- the group `workers` is created with a new stream), status QUEUED with the new entry id,
-- TASK_QUEUED {promoted = true} for a delayed task, TASK_RETRIED for a retry. The expiry
-- member is written again (the sweep drops it while a task runs, DESIGN 6).
--
-- KEYS[1] = dtq:task:<id>   KEYS[2] = dtq:task:<id>:history   KEYS[3] = dtq:retry:schedule
-- KEYS[4] = dtq:retry:claimed   KEYS[5] = dtq:expiry   KEYS[6] = dtq:stream:<queue>:p<N>
-- KEYS[7] = dtq:idempotency:<queue>:<key> (placeholder when none)
-- KEYS[8] = dtq:task:<id>:payload (an older dtq's payload key: own_payload in _lib)
-- KEYS[9] = dtq:task:<id>:done (where a waiting producer is told: retain in _lib)
-- KEYS[10 .. 19] = the queue's ten streams, p9 .. p0; KEYS[20 .. 22] = its fairness keys
-- KEYS[23] = the queue's workflow outbox (a workflow node's end: retain in _lib)
--   (keys.fair_keys). In a fair queue (docs/limits.md, "Fairness across keys") a task due
--   goes into its stream as submit.lua would put it there: only while fewer than FAIR_WINDOW
--   entries are unread and none is held; otherwise it is held in its key's next round (QUEUED
--   without an entry id: the reply's entry id is ""). A task back from a throttle's park had
--   its turn already: it goes straight into its stream.
-- ARGV[1] task_id  [2] task retention s  [3] idempotency TTL s  [4] events channel
-- ARGV[5] event_id
-- Returns {"queued", from, entry_id, attempt} | {"expired", from} | {"skip", why}
local task_id = ARGV[1]
if not redis.call('ZSCORE', KEYS[4], task_id) then return {'skip', 'not_claimed'} end
local h = redis.call('HMGET', KEYS[1], 'status', 'queue', 'task_type', 'attempt',
  'max_attempts', 'priority', 'timeout_ms', 'idempotency_key', 'expires_at_ms', 'expires_at',
  'throttled_at_ms')
local status = h[1]
if not status then
  redis.call('ZREM', KEYS[4], task_id)
  return {'skip', 'gone'}
end
if status ~= 'pending' and status ~= 'retrying' then
  redis.call('ZREM', KEYS[4], task_id)
  return {'skip', status}
end

local now = now_ms()
local ts = iso(now)
local retention = tonumber(ARGV[2])
local attempt = tonumber(h[4]) or 0
local exp = h[9]

if exp and exp ~= '' and tonumber(exp) <= now then
  local from = status
  if status == 'retrying' then
    hist(KEYS[2], retention, ts, 'retrying', 'queued', attempt, nil, 'ttl')
    from = 'queued'
  end
  redis.call('HSET', KEYS[1], 'status', 'expired', 'expired_at', ts, 'updated_at', ts)
  retain(KEYS[1], KEYS[8], retention, KEYS[9], KEYS[23])
  redis.call('ZREM', KEYS[3], task_id)
  redis.call('ZREM', KEYS[4], task_id)
  redis.call('ZREM', KEYS[5], task_id)
  idem_state(KEYS[7], h[8], task_id, 'failed', ts, ARGV[3])
  hist(KEYS[2], retention, ts, from, 'expired', attempt, nil, 'ttl', {expired_at = ts})
  local meta = {expired_at = ts, reason = 'ttl'}
  if h[10] and h[10] ~= '' then meta.expires_at = h[10] end
  emit(ARGV[4], ARGV[5], ts, 'TASK_EXPIRED', task_id, h[2], h[3], attempt, nil, meta)
  return {'expired', status}
end

local next_attempt = attempt + 1
local path = not h[11] and redis.call('HGET', KEYS[20], 'key')
local entry_id = ''
if path and (redis.call('ZCARD', KEYS[21]) > 0 or fair_unread(KEYS, 10) >= FAIR_WINDOW) then
  local value = fair_value(task_payload(KEYS[1], KEYS[8]), path)
  redis.call('HDEL', KEYS[1], 'entry_id')
  redis.call('HSET', KEYS[1], 'status', 'queued', 'fair_key', value, 'updated_at', ts)
  fair_hold(KEYS[20], KEYS[21], KEYS[22], task_id, 9 - (tonumber(h[6]) or 5), value)
else
  local stream = KEYS[6]
  if redis.call('EXISTS', stream) == 0 then
    for k = 10, 19 do  -- the group on every stream of the queue, as submit.lua makes them
      if redis.call('EXISTS', KEYS[k]) == 0 then
        redis.call('XGROUP', 'CREATE', KEYS[k], 'workers', '0', 'MKSTREAM')
      end
    end
  end
  entry_id = redis.call('XADD', stream, '*', 'task_id', task_id, 'queue', h[2],
    'task_type', h[3], 'payload', task_payload(KEYS[1], KEYS[8]), 'attempt', next_attempt,
    'max_attempts', h[5], 'priority', h[6], 'timeout_ms', h[7], 'idempotency_key', h[8] or '')
  redis.call('HSET', KEYS[1], 'status', 'queued', 'entry_id', entry_id, 'updated_at', ts)
end
persist(KEYS[1], KEYS[8])
redis.call('ZREM', KEYS[3], task_id)
redis.call('ZREM', KEYS[4], task_id)
if exp and exp ~= '' then redis.call('ZADD', KEYS[5], exp, task_id) end
local retry = status == 'retrying'
hist(KEYS[2], nil, ts, status, 'queued', attempt, nil, retry and 'retry' or 'due')
emit(ARGV[4], ARGV[5], ts, retry and 'TASK_RETRIED' or 'TASK_QUEUED', task_id, h[2], h[3],
  attempt, nil, {promoted = true, next_attempt = next_attempt, entry_id = entry_id})
return {'queued', status, entry_id, next_attempt}
