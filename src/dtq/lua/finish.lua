-- finish.lua: record the end of one execution, then XACK + XDEL its entry (DESIGN 3, 4;
-- contract sections 3, 4, 5). One atomic step: a crash leaves either nothing or everything.
-- The finishes of one round trip run in one EVALSHA of its batched form (_batch.lua).
--
-- Fencing first: the entry must still be pending for this consumer (XPENDING on that one id),
-- and the hash must still be RUNNING this entry at this attempt. Otherwise this worker's lease
-- was taken over (it was paused, cut off or too slow): nothing is written and nothing is
-- acknowledged, so a zombie never ACKs an entry another worker runs. Returns {"fenced", why}.
-- An entry removed from its stream outside dtq (XDEL, XTRIM, the stream deleted) is no longer
-- pending on Redis 7 (its next XCLAIM drops it; touch.lua acknowledges it on every version):
-- then the hash is the lease, and it must name this worker too. An entry not pending that is
-- still in the stream is fenced as before.
--
-- Outcomes (ARGV[6]):
--   success     SUCCEEDED; the result JSON goes to dtq:result:<id> (EX result retention; none
--               for a workflow node's, given at its workflow's end: docs/workflows.md) unless
--               it is null (nothing stored: a missing key reads as result None) or the worker
--               flagged it too large (hash result_truncated=1); idempotency completed.
--   error       retryable and attempt < max_attempts: RETRYING, due now + delay_ms in
--               dtq:retry:schedule, expiry member written again, TASK_RETRY_SCHEDULED;
--               otherwise DEAD_LETTERED (entry in dtq:stream:dead-letter, MAXLEN ~) or FAILED
--               when the DLQ is disabled, idempotency failed.
--   reschedule  like a retry without an error (counts toward max_attempts; exhausted: dead
--               letter with error_class RescheduleLimit); extend_ms moves expires_at and its
--               expiry score (a task without a deadline keeps none).
--   cancelled   CANCELLED (the handler was stopped on a cancel request), idempotency failed.
--   rate_limited  the handler raised RateLimited (docs/limits.md, "Back-pressure from a
--               handler"): parked like a throttle, the attempt not spent. PENDING (history
--               running -> pending, reason rate_limited), hash attempt set back to attempt - 1
--               (the next start runs this attempt number again), throttled_at_ms set if absent,
--               due now + delay_ms in dtq:retry:schedule, expiry member written again,
--               TASK_THROTTLED {reason "upstream", until, retry_after_ms, slow}. None of the
--               execution fields below is written: the last attempt's stay as they were.
--               With ARGV[23] = "1" (slow), every limit of the task is held until then: field
--               `hold` (epoch ms, the later of the one there and this) of its rate state, whose
--               TTL is made to cover it; start.lua parks a task of a held limit ("upstream").
-- A retry, reschedule or rate_limited of a task whose cancel was requested meanwhile is
-- CANCELLED instead.
-- Always but rate_limited: finished_at, duration_ms, worker_id, error_class, error_message,
-- retryable. The hash and history get the retention (a terminal state) or no TTL (RETRYING,
-- PENDING; DESIGN 11); history entry; event; XACK + XDEL (of an entry still pending).
--
-- KEYS[1] = dtq:task:<id>   KEYS[2] = dtq:task:<id>:history   KEYS[3] = the entry's stream
-- KEYS[4] = dtq:retry:schedule   KEYS[5] = dtq:expiry
-- KEYS[6] = dtq:idempotency:<queue>:<key> (placeholder when none)
-- KEYS[7] = dtq:stream:dead-letter   KEYS[8] = dtq:result:<id>   KEYS[9] = dtq:cancelled
-- KEYS[10] = dtq:task:<id>:payload (an older dtq's payload key: own_payload in _lib)
-- KEYS[11] = dtq:task:<id>:done (where a waiting producer is told: retain in _lib)
-- KEYS[12] = the queue's workflow outbox (a workflow node's end: retain in _lib)
-- then, for each limit the task met at its start (ARGV[22] says how many; docs/limits.md):
-- KEYS[10 + 3i] = its rate state (hash {tat, hold}), KEYS[11 + 3i] = its running set,
-- KEYS[12 + 3i] = its waiting set. The task gives its place back whatever its outcome (it
-- leaves RUNNING), and the first waiter is made due; the reply then has a third element, "1",
-- and the worker promotes the queue's due tasks at once.
-- ARGV[1] task_id  [2] entry_id  [3] worker_id  [4] consumer group  [5] attempt
-- ARGV[6] outcome  [7] result JSON ("" if none)  [8] result too large "1"/"0"
-- ARGV[9] error_class  [10] error_message (sanitized)  [11] retryable "1"/"0"
-- ARGV[12] delay_ms (retry, reschedule or rate_limited)  [13] extend_ms or ""  [14] duration_ms
-- ARGV[15] task retention s  [16] result retention s  [17] idempotency TTL s
-- ARGV[18] events channel  [19] event_id  [20] DLQ enabled "1"/"0"  [21] DLQ maxlen
-- ARGV[22] how many limits (absent: none)  [23] "1": a rate_limited outcome with slow (it holds
-- them; sent with no limit too, as "0" and "1", for the history and the event to say so)
-- Returns {"fenced", why} | {status, retry_delay_ms or "" (a retry's, a rate_limited's), freed?}
local task_id, entry_id, worker, group = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local attempt = tonumber(ARGV[5])
local outcome = ARGV[6]

local fenced, deleted = entry_fence(KEYS[3], group, entry_id, worker)
if fenced then return {'fenced', fenced} end
local h = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'attempt', 'max_attempts',
  'queue', 'task_type', 'idempotency_key', 'expires_at_ms', 'cancel_requested', 'worker_id',
  'throttled_at_ms', 'waited')
if not h[1] then return {'fenced', 'missing'} end
if h[1] ~= 'running' then return {'fenced', 'status:' .. h[1]} end
if h[2] ~= entry_id then return {'fenced', 'entry'} end
if tonumber(h[3]) ~= attempt then return {'fenced', 'attempt'} end
if deleted and h[10] ~= worker then return {'fenced', 'not_pending'} end

local now = now_ms()
local ts = iso(now)
local retention = tonumber(ARGV[15])
local max_attempts = tonumber(h[4]) or 1
local queue, task_type, idem = h[5], h[6], h[7] or ''
local error_class, message, retryable = ARGV[9], ARGV[10], ARGV[11]
local delay_ms = tonumber(ARGV[12]) or 0

local to
if outcome == 'success' then
  to = 'succeeded'
elseif outcome == 'cancelled' then
  to = 'cancelled'
elseif outcome == 'reschedule' then
  if attempt < max_attempts then
    to = 'retrying'
  else
    to = 'dead'
    error_class = 'RescheduleLimit'
    message = 'rescheduled at attempt ' .. attempt .. ' of ' .. max_attempts
      .. '; attempts exhausted'
    retryable = '0'
  end
elseif outcome == 'error' then
  if retryable == '1' and attempt < max_attempts then to = 'retrying' else to = 'dead' end
elseif outcome == 'rate_limited' then
  to = 'pending'
else
  return redis.error_reply('finish: unknown outcome ' .. tostring(outcome))
end
if (to == 'retrying' or to == 'pending') and h[9] == '1' then to = 'cancelled' end
if to == 'dead' then to = ARGV[20] == '1' and 'dead_lettered' or 'failed' end

local fields = {'status', to, 'finished_at', ts, 'updated_at', ts, 'worker_id', worker,
  'duration_ms', ARGV[14], 'error_class', error_class, 'error_message', message,
  'retryable', retryable}
local extra = {}
if error_class ~= '' then extra.error_class = error_class end
local meta = {}
local etype

if to == 'succeeded' then
  etype = 'TASK_SUCCEEDED'
  if ARGV[8] == '1' then
    fields[#fields + 1] = 'result_truncated'
    fields[#fields + 1] = '1'
    meta.result_truncated = true
  elseif ARGV[7] ~= '' and ARGV[7] ~= 'null' then
    -- a None result is not stored: a missing key already reads as result None. The hash's
    -- `result_stored` says a key was written, so that a reader can tell a result that
    -- expired (DTQ_RESULT_RETENTION_S) from a handler that returned None.
    -- A workflow node's result has no TTL until its workflow ends (its children read it; the
    -- workflow's end gives it the result retention: docs/workflows.md).
    if string.sub(idem, 1, 7) == 'dtq-wf:' then
      redis.call('SET', KEYS[8], ARGV[7])
    else
      redis.call('SET', KEYS[8], ARGV[7], 'EX', ARGV[16])
    end
    fields[#fields + 1] = 'result_stored'
    fields[#fields + 1] = '1'
  end
  idem_state(KEYS[6], idem, task_id, 'completed', ts, ARGV[17])
elseif to == 'retrying' then
  etype = 'TASK_RETRY_SCHEDULED'
  local due = now + delay_ms
  fields[#fields + 1] = 'retry_delay_ms'
  fields[#fields + 1] = delay_ms
  fields[#fields + 1] = 'available_at'
  fields[#fields + 1] = iso(due)
  redis.call('ZADD', KEYS[4], due, task_id)
  local exp_ms = tonumber(h[8] or '')
  if exp_ms ~= nil and outcome == 'reschedule' and ARGV[13] ~= '' then
    exp_ms = exp_ms + tonumber(ARGV[13])
    fields[#fields + 1] = 'expires_at'
    fields[#fields + 1] = iso(exp_ms)
    fields[#fields + 1] = 'expires_at_ms'
    fields[#fields + 1] = exp_ms
    extra.expires_at = iso(exp_ms)
    extra.extended_ms = tonumber(ARGV[13])
    meta.expires_at = iso(exp_ms)
  end
  if exp_ms ~= nil then redis.call('ZADD', KEYS[5], exp_ms, task_id) end
  extra.retry_delay_ms = delay_ms
  extra.available_at = iso(due)
  meta.retry_delay_ms = delay_ms
  meta.available_at = iso(due)
  meta.reschedule = outcome == 'reschedule'
elseif to == 'pending' then
  -- Parked like a throttle: not an attempt, so not its execution fields either.
  etype = 'TASK_THROTTLED'
  local due = now + delay_ms
  fields = {'status', 'pending', 'attempt', attempt - 1, 'available_at', iso(due),
    'updated_at', ts}
  if not h[11] then
    fields[#fields + 1] = 'throttled_at_ms'
    fields[#fields + 1] = now
  end
  redis.call('ZADD', KEYS[4], due, task_id)
  local exp_ms = tonumber(h[8] or '')
  if exp_ms ~= nil then redis.call('ZADD', KEYS[5], exp_ms, task_id) end
  local slow = ARGV[23] == '1'
  extra.retry_after_ms = delay_ms
  extra['until'] = iso(due)
  extra.slow = slow
  meta.reason = 'upstream'
  meta['until'] = iso(due)
  meta.retry_after_ms = delay_ms
  meta.slow = slow
  if slow then
    for i = 1, tonumber(ARGV[22]) or 0 do
      local rate = KEYS[10 + 3 * i]
      local held = tonumber(redis.call('HGET', rate, 'hold'))
      if not held or held < due then redis.call('HSET', rate, 'hold', due) end
      local ttl = redis.call('PTTL', rate)
      if ttl < delay_ms + 1000 then redis.call('PEXPIRE', rate, delay_ms + 1000) end
    end
  end
elseif to == 'cancelled' then
  etype = 'TASK_CANCELLED'
  meta.from = 'running'
  idem_state(KEYS[6], idem, task_id, 'failed', ts, ARGV[17])
else
  etype = to == 'failed' and 'TASK_FAILED' or 'TASK_DEAD_LETTERED'
  if to == 'dead_lettered' then
    local d = redis.call('HMGET', KEYS[1], 'priority', 'timeout_ms')
    local dlq_id = redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[21], '*',
      'task_id', task_id, 'queue', queue, 'task_type', task_type,
      'payload', task_payload(KEYS[1], KEYS[10]),
      'attempt', attempt, 'max_attempts', max_attempts, 'priority', d[1], 'timeout_ms', d[2],
      'idempotency_key', idem, 'failed_at_ms', now, 'attempts_made', attempt,
      'last_error', message, 'last_error_class', error_class, 'retryable', retryable,
      'worker_id', worker, 'original_queue', queue)
    fields[#fields + 1] = 'dlq_entry_id'
    fields[#fields + 1] = dlq_id
    extra.dlq_entry_id = dlq_id
    meta.dlq_entry_id = dlq_id
  end
  idem_state(KEYS[6], idem, task_id, 'failed', ts, ARGV[17])
  meta.error_class = error_class
end

-- A task waiting for its retry, or parked, is not terminal: no TTL however long it waits
-- (DESIGN 11).
if to == 'retrying' or to == 'pending' then retention = nil end
redis.call('HSET', KEYS[1], unpack(fields))
if retention then
  retain(KEYS[1], KEYS[10], retention, KEYS[11], KEYS[12], {h[12], h[7], to, task_id})
else
  persist(KEYS[1], KEYS[10])
end
if not deleted then
  redis.call('XACK', KEYS[3], group, entry_id)
  redis.call('XDEL', KEYS[3], entry_id)
end
redis.call('SREM', KEYS[9], task_id)
-- Its start removed the expiry member; one a deadline gives is removed again (a safety net).
if retention and h[8] then redis.call('ZREM', KEYS[5], task_id) end
local freed = nil  -- "1": a place's waiter was made due (the reply's third element)
for i = 1, tonumber(ARGV[22]) or 0 do
  if redis.call('ZREM', KEYS[11 + 3 * i], task_id) == 1
      and limit_promote(KEYS[12 + 3 * i], KEYS[4], now) then
    freed = '1'
  end
end
local reason = outcome
if outcome == 'error' and to ~= 'retrying' and to ~= 'cancelled' then
  reason = retryable == '1' and 'attempts_exhausted' or 'permanent_error'
elseif outcome == 'reschedule' and to ~= 'retrying' and to ~= 'cancelled' then
  reason = 'reschedule_limit'
elseif outcome ~= 'cancelled' and to == 'cancelled' then
  reason = 'cancel_requested'
end
hist(KEYS[2], retention, ts, 'running', to, attempt, worker, reason, extra)
emit(ARGV[18], ARGV[19], ts, etype, task_id, queue, task_type, attempt, worker,
  next(meta) and meta or nil)
return {to, (to == 'retrying' or to == 'pending') and delay_ms or '', freed}
