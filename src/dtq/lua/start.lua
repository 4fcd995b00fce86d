-- start.lua: the pre-execution checks of one delivered stream entry, then RUNNING
-- (contract section 6, DESIGN 3, 4, 6). One call per entry; a read batch's calls run in one
-- EVALSHA of its batched form (_batch.lua, docs/redis-schema.md "Scripts").
-- Fencing first, as in finish.lua: the entry must be pending for this consumer (XPENDING on
-- that one id). Otherwise another worker reclaimed it while this one stalled between its read
-- and this script (or it was acknowledged meanwhile): nothing is written or acknowledged, so a
-- resumed zombie can never take over, cancel or dead-letter a task another worker runs.
--                                                                  {"fenced", "owner:<id>" |
--                                                                   "not_pending"}
-- Then, in this order:
--   1. no task hash (deleted by hand)         -> XACK + XDEL, its idempotency record removed
--      when it still says this task is processing (no task is left to answer a replay)
--                                                                              {"missing"}
--   2. terminal status (cancelled included)   -> XACK + XDEL, SREM cancelled   {"cancelled"} |
--                                                                             {"terminal", status}
--   3. the entry is not the hash's entry_id   -> XACK + XDEL, TASK_DUPLICATE_ABSORBED
--      (or the task waits in the schedule)                                    {"duplicate", status}
--   4. queued but listed in dtq:cancelled     -> CANCELLED (safety net)       {"cancelled", from}
--   5. running with this entry id: its worker died (crash redelivery). Attempts are counted
--      here, never from the delivery counter: attempt = hash attempt + 1. A cancel requested
--      before the crash cancels it now; past max_attempts the task is dead-lettered (FAILED when
--      the DLQ is disabled) with error_class WorkerLost, without running   {"cancelled", from} |
--                                                                          {"dead", status}
--      A redelivered task runs even past its expires_at: it had started.
--   6. queued with expires_at_ms <= now (Redis TIME) -> EXPIRED, XACK + XDEL, expiry member
--      removed, idempotency failed, TASK_EXPIRED                               {"expired"}
--   7. otherwise RUNNING: attempt = hash attempt + 1, started_at, worker_id, expiry member
--      removed (a started task never expires), hash and history without TTL however long it
--      runs (DESIGN 11), history, TASK_STARTED; the lease is renewed
--      (XCLAIM IDLE 0 JUSTID), so it runs a full visibility timeout from started_ms; the
--      call's start token is kept in the hash (start_token).
--      {"run", attempt, max_attempts, timeout_ms, expires_at_ms or "", created_ms, started_ms}
-- A resume (ARGV[12] = "1") is this worker sending again a start whose reply it lost, with the
-- token it sent then: when the hash is RUNNING this entry with that token, that start ran and
-- the entry is this worker's: the lease is renewed and "run" returned with the attempt it set
-- (no attempt + 1, nothing else written; started_ms is now). Otherwise that start did not run
-- (or another has run since) and the checks above apply as to any start.
--
-- KEYS[1] = dtq:task:<id>   KEYS[2] = dtq:task:<id>:history   KEYS[3] = the entry's stream
-- KEYS[4] = dtq:cancelled   KEYS[5] = dtq:expiry
-- KEYS[6] = dtq:idempotency:<queue>:<key> (placeholder when none)
-- KEYS[7] = dtq:stream:dead-letter
-- KEYS[8] = dtq:task:<id>:payload (an older dtq's payload key: own_payload in _lib)
-- KEYS[9] = dtq:task:<id>:done (where a waiting producer is told: retain in _lib)
-- KEYS[10] = the queue's workflow outbox (a workflow node's end: retain in _lib)
-- ARGV[1] task_id  [2] entry_id  [3] worker_id  [4] consumer group  [5] task retention s
-- ARGV[6] idempotency TTL s  [7] events channel  [8] event_id  [9] DLQ enabled "1"/"0"
-- ARGV[10] DLQ maxlen  [11] start token (random, one per start batch of a worker)
-- ARGV[12] "1": resume a start sent with that token whose reply was lost; else "0"
-- Limits (docs/limits.md, "How a limit is enforced"): ARGV[13] how many the task meets
-- (absent: none); for the i-th, ARGV[10 + 4i] its name, [11 + 4i] GCRA's interval in ms (0: no
-- rate), [12 + 4i] GCRA's tolerance in ms, [13 + 4i] its concurrency (0: none); KEYS[11] the
-- retry schedule, KEYS[9 + 3i] its rate state (hash {tat, hold}), [10 + 3i] its running set,
-- [11 + 3i] its waiting set. Before step 7, a queued task over one of them is parked instead
-- (its entry consumed, PENDING until it is due again, the attempt not counted, TASK_THROTTLED):
--   upstream: the limit is held (`hold`, epoch ms, later than now: a handler's
--   RateLimited(slow=True), written by finish.lua): due at the hold's end, nothing reserved;
--   rate: due when the rate allows it (GCRA: the theoretical arrival time less the
--   tolerance), the slot reserved (see park);
--   concurrency: in the waiting set, promoted by the finish that frees a place, and due again
--   after PARKED_RECHECK_MS all the same.
--                                {"throttled", limit, "upstream"|"rate"|"concurrency", due ms}
-- A started task holds a place (its id in the running set) until its finish; a redelivered
-- one keeps it, and gives it back if it ends here (cancelled, dead).
-- The "run" reply carries, 8th, how long limits held the task back before this start (ms, or
-- "" when they never did).
local task_id, entry_id, worker, group = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local retention = tonumber(ARGV[5])
local nlim = tonumber(ARGV[13]) or 0
local PARKED_RECHECK_MS = 30000

local function consume()
  redis.call('XACK', KEYS[3], group, entry_id)
  redis.call('XDEL', KEYS[3], entry_id)
end

local p = redis.call('XPENDING', KEYS[3], group, entry_id, entry_id, 1)
if #p == 0 then return {'fenced', 'not_pending'} end
if p[1][2] ~= worker then return {'fenced', 'owner:' .. p[1][2]} end

-- HMGET gives false for a missing field.
local h = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'attempt', 'max_attempts',
  'timeout_ms', 'expires_at_ms', 'queue', 'task_type', 'idempotency_key', 'cancel_requested',
  'created_ms', 'expires_at', 'throttled_at_ms', 'rate_reserved')
local status = h[1]
if not status then
  consume()
  redis.call('SREM', KEYS[4], task_id)
  local rec = redis.call('GET', KEYS[6])
  if rec then
    local ok, r = pcall(cjson.decode, rec)
    if ok and type(r) == 'table' and r.task_id == task_id and r.state == 'processing' then
      redis.call('DEL', KEYS[6])
    end
  end
  return {'missing'}
end
if status == 'succeeded' or status == 'failed' or status == 'dead_lettered'
    or status == 'cancelled' or status == 'expired' then
  consume()
  redis.call('SREM', KEYS[4], task_id)
  if status == 'cancelled' then return {'cancelled'} end
  return {'terminal', status}
end

local now = now_ms()
if ARGV[12] == '1' and status == 'running' and h[2] == entry_id
    and redis.call('HGET', KEYS[1], 'start_token') == ARGV[11] then
  redis.call('XCLAIM', KEYS[3], group, worker, 0, entry_id, 'IDLE', 0, 'JUSTID')
  return {'run', tonumber(h[3]), tonumber(h[4]) or 1, tonumber(h[5]) or 0, h[6] or '',
    h[11] or '', now, ''}
end
local ts = iso(now)
local queue, task_type, idem = h[7], h[8], h[9] or ''
local prev = tonumber(h[3]) or 0
local max_attempts = tonumber(h[4]) or 1

if h[2] ~= entry_id or (status ~= 'queued' and status ~= 'running') then
  consume()
  emit(ARGV[7], ARGV[8], ts, 'TASK_DUPLICATE_ABSORBED', task_id, queue, task_type, prev, worker,
    {entry_id = entry_id, live_entry_id = h[2] or '', status = status})
  return {'duplicate', status}
end

-- A redelivered task that ends here gives its limits' places back.
local function release_places()
  for i = 1, nlim do
    if redis.call('ZREM', KEYS[10 + 3 * i], task_id) == 1 then
      limit_promote(KEYS[11 + 3 * i], KEYS[11], now)
    end
  end
end

-- A task over one of its limits waits, parked (see the header). Over a rate, it reserves
-- the next slot (``tat``: the arrival time its start will have) and is due then, so each
-- parked task gets a slot of its own instead of all waking at once; its next start is
-- admitted on that reservation without spending the rate again.
local function park(i, why, due_ms, tat)
  local name = ARGV[10 + 4 * i]
  if tat then
    redis.call('HSET', KEYS[9 + 3 * i], 'tat', tat)
    redis.call('PEXPIRE', KEYS[9 + 3 * i], math.ceil(tat - now) + 1000)
    redis.call('HSET', KEYS[1], 'rate_reserved', name)
  end
  if why == 'concurrency' then
    local priority = tonumber(redis.call('HGET', KEYS[1], 'priority')) or 5
    redis.call('ZADD', KEYS[11 + 3 * i], (9 - priority) * 1e13 + now, task_id)
  end
  consume()
  local due = iso(due_ms)
  redis.call('HSET', KEYS[1], 'status', 'pending', 'available_at', due, 'updated_at', ts)
  if not h[13] then redis.call('HSET', KEYS[1], 'throttled_at_ms', now) end
  redis.call('ZADD', KEYS[11], due_ms, task_id)
  hist(KEYS[2], nil, ts, 'queued', 'pending', prev, worker, 'throttled',
    {limit = name, throttle = why, ['until'] = due})
  emit(ARGV[7], ARGV[8], ts, 'TASK_THROTTLED', task_id, queue, task_type, prev, worker,
    {limit = name, reason = why, ['until'] = due})
  return {'throttled', name, why, due_ms}
end

-- A running task ends here without running again: cancelled, or dead (attempts exhausted).
local function cancel_now(from, reason)
  release_places()
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ts, 'updated_at', ts)
  retain(KEYS[1], KEYS[8], retention, KEYS[9], KEYS[10])
  redis.call('ZREM', KEYS[5], task_id)
  redis.call('SREM', KEYS[4], task_id)
  consume()
  idem_state(KEYS[6], idem, task_id, 'failed', ts, ARGV[6])
  hist(KEYS[2], retention, ts, from, 'cancelled', prev, worker, reason)
  emit(ARGV[7], ARGV[8], ts, 'TASK_CANCELLED', task_id, queue, task_type, prev, worker,
    {from = from, reason = reason})
  return {'cancelled', from}
end

if status == 'queued' and redis.call('SISMEMBER', KEYS[4], task_id) == 1 then
  return cancel_now('queued', 'cancel')
end

local attempt = prev + 1
if status == 'running' then
  if h[10] == '1' then return cancel_now('running', 'cancel_requested') end
  if attempt > max_attempts then
    local message = 'worker lost during attempt ' .. prev .. ' of ' .. max_attempts
      .. '; attempts exhausted'
    local to = 'failed'
    local extra = {error_class = 'WorkerLost'}
    if ARGV[9] == '1' then
      to = 'dead_lettered'
      local d = redis.call('HMGET', KEYS[1], 'priority', 'worker_id')
      local dlq_id = redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[10], '*',
        'task_id', task_id, 'queue', queue, 'task_type', task_type,
        'payload', task_payload(KEYS[1], KEYS[8]),
        'attempt', prev, 'max_attempts', max_attempts, 'priority', d[1], 'timeout_ms', h[5],
        'idempotency_key', idem, 'failed_at_ms', now, 'attempts_made', prev,
        'last_error', message, 'last_error_class', 'WorkerLost', 'retryable', '1',
        'worker_id', d[2] or '', 'original_queue', queue)
      redis.call('HSET', KEYS[1], 'dlq_entry_id', dlq_id)
      extra.dlq_entry_id = dlq_id
    end
    release_places()
    redis.call('HSET', KEYS[1], 'status', to, 'finished_at', ts, 'updated_at', ts,
      'error_class', 'WorkerLost', 'error_message', message, 'retryable', '1')
    retain(KEYS[1], KEYS[8], retention, KEYS[9], KEYS[10])
    redis.call('ZREM', KEYS[5], task_id)
    consume()
    idem_state(KEYS[6], idem, task_id, 'failed', ts, ARGV[6])
    hist(KEYS[2], retention, ts, 'running', to, prev, worker, 'worker_lost', extra)
    emit(ARGV[7], ARGV[8], ts, to == 'failed' and 'TASK_FAILED' or 'TASK_DEAD_LETTERED', task_id,
      queue, task_type, prev, worker, extra)
    return {'dead', to}
  end
else
  local exp_ms = tonumber(h[6] or '')
  if exp_ms ~= nil and exp_ms <= now then
    redis.call('HSET', KEYS[1], 'status', 'expired', 'expired_at', ts, 'updated_at', ts)
    retain(KEYS[1], KEYS[8], retention, KEYS[9], KEYS[10])
    redis.call('ZREM', KEYS[5], task_id)
    consume()
    idem_state(KEYS[6], idem, task_id, 'failed', ts, ARGV[6])
    hist(KEYS[2], retention, ts, 'queued', 'expired', prev, worker, 'ttl', {expired_at = ts})
    emit(ARGV[7], ARGV[8], ts, 'TASK_EXPIRED', task_id, queue, task_type, prev, worker,
      {expired_at = ts, expires_at = h[12] or '', reason = 'ttl'})
    return {'expired'}
  end
end

if nlim > 0 then
  if status == 'queued' then
    -- Every limit is checked before any place is taken: a task parked by its second limit
    -- has not used its first one's rate.
    local tats = {}
    for i = 1, nlim do
      local state = redis.call('HMGET', KEYS[9 + 3 * i], 'tat', 'hold')
      local hold = tonumber(state[2])
      if hold and hold > now then return park(i, 'upstream', hold) end
      local concurrency = tonumber(ARGV[13 + 4 * i])
      if concurrency > 0 and redis.call('ZCARD', KEYS[10 + 3 * i]) >= concurrency
          and not redis.call('ZSCORE', KEYS[10 + 3 * i], task_id) then
        return park(i, 'concurrency', now + PARKED_RECHECK_MS)
      end
      local interval = tonumber(ARGV[11 + 4 * i])
      if interval > 0 and h[14] ~= ARGV[10 + 4 * i] then  -- not admitted on a reservation
        local tat = tonumber(state[1]) or now
        if tat < now then tat = now end
        local tolerance = tonumber(ARGV[12 + 4 * i])
        if tat - now > tolerance then
          return park(i, 'rate', math.ceil(tat - tolerance), tat + interval)
        end
        tats[i] = tat + interval
      end
    end
    for i = 1, nlim do
      if tats[i] then
        redis.call('HSET', KEYS[9 + 3 * i], 'tat', tats[i])
        -- idle state goes: the key lives until the arrival time has passed (plus a second)
        redis.call('PEXPIRE', KEYS[9 + 3 * i], math.ceil(tats[i] - now) + 1000)
      end
    end
  end
  for i = 1, nlim do  -- a redelivered task keeps its place (the member is its id)
    if tonumber(ARGV[13 + 4 * i]) > 0 then redis.call('ZADD', KEYS[10 + 3 * i], now, task_id) end
  end
end
local throttled_ms = ''
if h[13] then
  throttled_ms = now - (tonumber(h[13]) or now)
  redis.call('HDEL', KEYS[1], 'throttled_at_ms', 'rate_reserved')
end

redis.call('HSET', KEYS[1], 'status', 'running', 'attempt', attempt, 'started_at', ts,
  'worker_id', worker, 'updated_at', ts, 'start_token', ARGV[11])
if prev > 0 then
  -- The last attempt's outcome. A first attempt (attempt 0: just submitted or requeued from the
  -- DLQ, which clears them) has none to clear.
  redis.call('HDEL', KEYS[1], 'finished_at', 'duration_ms', 'error_class', 'error_message',
    'retryable')
end
persist(KEYS[1], KEYS[8])
-- Only a task with a deadline has an expiry member (submit, promote, finish and dlq_requeue
-- add one only then; a stray one the sweep drops, the task being RUNNING).
if h[6] then redis.call('ZREM', KEYS[5], task_id) end
redis.call('XCLAIM', KEYS[3], group, worker, 0, entry_id, 'IDLE', 0, 'JUSTID')
local reason = status == 'running' and 'redelivered' or 'started'
hist(KEYS[2], nil, ts, status, 'running', attempt, worker, reason)
emit(ARGV[7], ARGV[8], ts, 'TASK_STARTED', task_id, queue, task_type, attempt, worker,
  status == 'running' and {redelivered = true} or nil)
return {'run', attempt, max_attempts, tonumber(h[5]) or 0, h[6] or '', h[11] or '', now,
  throttled_ms}
