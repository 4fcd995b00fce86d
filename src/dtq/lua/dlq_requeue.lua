-- dlq_requeue.lua: give a dead-lettered task a new life (contract section 11; DESIGN 10).
-- A deliberate, documented exception to "terminal states have no outgoing transition": an
-- operator's requeue moves DEAD_LETTERED -> QUEUED. The DLQ entry is XDELed, the task gets a
-- new stream entry (attempt 1; the group is created if the stream is new, as in submit.lua),
-- attempt 0 and the execution fields of its last life cleared; metadata (built by the caller,
-- with the earlier attempts appended to previous_attempts) replaces the old one only if the
-- old one is still what the caller read (compare-and-set: Lua's cjson would turn [] into {}).
-- The idempotency record goes back to processing (unless the key now belongs to another task);
-- a deadline still ahead goes back into dtq:expiry, one already passed refuses the requeue.
-- Not terminal any more: the hash and history lose their retention TTL (DESIGN 11).
--
-- KEYS[1] = dtq:task:<id>   KEYS[2] = dtq:task:<id>:history   KEYS[3] = dtq:stream:dead-letter
-- KEYS[4] = dtq:idempotency:<queue>:<key> (placeholder when none)   KEYS[5] = dtq:stream:audit
-- KEYS[6] = dtq:expiry   KEYS[7..16] = dtq:stream:<queue>:p9 .. p0
-- KEYS[17] = dtq:task:<id>:payload (an older dtq's payload key: own_payload in _lib)
-- ARGV[1] task_id  [2] metadata JSON read by the caller  [3] new metadata JSON
-- ARGV[4] DLQ entry id found by scanning, "" (used when the hash has no dlq_entry_id)
-- ARGV[5] task retention s (not read: a requeued task is not terminal, so it has no TTL)
-- ARGV[6] idempotency TTL s  [7] events channel  [8] event_id
-- ARGV[9] audit actor ("" = no audit entry)  [10] audit request_id or ""
-- Returns {"queued", entry_id, now_ms, removed DLQ entries (0|1)}
--       | {"err", "NOT_FOUND"} | {"err", "STATUS", status} | {"err", "STALE"}
--       | {"err", "DEADLINE", expires_at}
local task_id = ARGV[1]
local h = redis.call('HMGET', KEYS[1], 'status', 'metadata', 'queue', 'task_type',
  'max_attempts', 'priority', 'timeout_ms', 'idempotency_key', 'attempt', 'dlq_entry_id',
  'expires_at_ms', 'expires_at')
local status = h[1]
if not status then return {'err', 'NOT_FOUND'} end
if status ~= 'dead_lettered' then return {'err', 'STATUS', status} end
if (h[2] or '') ~= ARGV[2] then return {'err', 'STALE'} end
local now = now_ms()
local exp_ms = tonumber(h[11] or '')
if exp_ms and exp_ms <= now then return {'err', 'DEADLINE', h[12] or ''} end
local ts = iso(now)
local queue, idem = h[3], h[8] or ''

local dlq_id = h[10]
if not dlq_id or dlq_id == '' then dlq_id = ARGV[4] end
local removed = 0
if dlq_id ~= '' then removed = redis.call('XDEL', KEYS[3], dlq_id) end

local stream = KEYS[7 + (9 - tonumber(h[6]))]
if redis.call('EXISTS', stream) == 0 then
  redis.call('XGROUP', 'CREATE', stream, 'workers', '0', 'MKSTREAM')
end
local entry_id = redis.call('XADD', stream, '*', 'task_id', task_id, 'queue', queue,
  'task_type', h[4], 'payload', task_payload(KEYS[1], KEYS[17]), 'attempt', 1,
  'max_attempts', h[5], 'priority', h[6], 'timeout_ms', h[7], 'idempotency_key', idem)

redis.call('HDEL', KEYS[1], 'started_at', 'finished_at', 'duration_ms', 'worker_id',
  'error_class', 'error_message', 'retryable', 'retry_delay_ms', 'cancel_requested',
  'dlq_entry_id', 'result_truncated')
redis.call('HSET', KEYS[1], 'status', 'queued', 'attempt', 0, 'metadata', ARGV[3],
  'entry_id', entry_id, 'available_at', ts, 'updated_at', ts)
persist(KEYS[1], KEYS[17])
if exp_ms then redis.call('ZADD', KEYS[6], exp_ms, task_id) end
idem_state(KEYS[4], idem, task_id, 'processing', ts, ARGV[6])
hist(KEYS[2], nil, ts, 'dead_lettered', 'queued', 0, nil, 'dlq_requeue',
  {previous_attempt = tonumber(h[9]) or 0, dlq_entry_id = dlq_id})
emit(ARGV[7], ARGV[8], ts, 'TASK_QUEUED', task_id, queue, h[4], 0, nil, {requeued = true})
audit(KEYS[5], ARGV[9], ARGV[10], 'dlq_requeue', task_id, queue, ts)
return {'queued', entry_id, now, removed}
