-- submit.lua: ingest one task atomically (DESIGN 3, contract sections 2, 5, 7).
-- Idempotency lookup, admission check, hash, history, recent index, expiry index, then the
-- stream entry (QUEUED) or the schedule member (PENDING, delayed), and the TASK_QUEUED event.
-- A task whose deadline has already passed (ttl 0) is accepted and marked EXPIRED at once.
--
-- KEYS[1] = dtq:task:<id>            KEYS[2] = dtq:task:<id>:history
-- KEYS[3] = dtq:idempotency:<queue>:<key> (placeholder when no key)
-- KEYS[4] = dtq:retry:schedule       KEYS[5] = dtq:tasks:recent
-- KEYS[6] = dtq:expiry               KEYS[7] = dtq:queues
-- KEYS[8..17] = dtq:stream:<queue>:p9 .. p0
-- KEYS[18] = dtq:task:<id>:payload (the payload JSON, with the hash's TTL: docs/redis-schema.md)
-- ARGV[1] task_id  [2] task_type  [3] payload JSON  [4] queue  [5] idempotency_key or ""
-- ARGV[6] max_attempts  [7] priority  [8] timeout_ms  [9] metadata JSON
-- ARGV[10] delay_ms  [11] schedule_at_ms or ""  [12] ttl_ms or ""  [13] expires_at_ms or ""
-- ARGV[14] max queue depth  [15] task retention s  [16] idempotency TTL s
-- ARGV[17] events channel  [18] event_id  [19] recent-index cap
-- Cost (docs/performance.md): one HSET, the stream entry before it so the hash is written once,
-- and every value of the hash under 64 bytes (the payload is in its own key), so it stays compact;
-- each ISO timestamp formatted once; the history entry and the event are JSON strings built
-- by concatenation, which is safe because every value in them is a validated task type or
-- queue name (no character that JSON escapes), a hex id or a timestamp.
-- Returns {"new", status, entry_id or "", now_ms, due_ms, expires_at_ms or ""}
--       | {"dup", state, task_id}
--       | {"err", code, detail}
local task_id, task_type, queue, idem = ARGV[1], ARGV[2], ARGV[4], ARGV[5]
local priority = tonumber(ARGV[7])
local retention = tonumber(ARGV[15])
local call = redis.call

if idem ~= '' then
  local rec = call('GET', KEYS[3])
  if rec then
    local r = cjson.decode(rec)
    if r.state == 'processing' then return {'err', 'IDEMPOTENCY_IN_PROGRESS', r.task_id} end
    return {'dup', r.state, r.task_id}
  end
end

-- Admission: the exact depth of the queue's ten streams. The length of the task's own stream
-- also says whether it exists (more than 0 entries), which saves an EXISTS below.
local depth = 0
local stream_i = 8 + (9 - priority)
local stream_len = 0
for i = 8, 17 do
  local n = call('XLEN', KEYS[i])
  if i == stream_i then stream_len = n end
  depth = depth + n
end
if depth >= tonumber(ARGV[14]) then return {'err', 'QUEUE_FULL', tostring(depth)} end

local now = now_ms()
local ts = iso(now)
local due = now
if ARGV[11] ~= '' then due = tonumber(ARGV[11])
elseif tonumber(ARGV[10]) > 0 then due = now + tonumber(ARGV[10]) end
local exp_ms = nil
if ARGV[13] ~= '' then exp_ms = tonumber(ARGV[13])
elseif ARGV[12] ~= '' then exp_ms = now + tonumber(ARGV[12]) end

local delayed = due > now
local status = delayed and 'pending' or 'queued'
local expired = exp_ms ~= nil and exp_ms <= now
if expired then status = 'expired' end
-- Each ISO string is formatted once.
local avail = due == now and ts or iso(due)
local exp_iso = exp_ms and iso(exp_ms) or ''

-- The history entry and the event, as JSON strings (see the header).
local first = delayed and 'pending' or 'queued'
local h1 = '{"ts":"' .. ts .. '","from":null,"to":"' .. first .. '","attempt":0,"reason":"created"'
if exp_ms then h1 = h1 .. ',"expires_at":"' .. exp_iso .. '"' end
h1 = h1 .. '}'
local ev_head = '{"event_id":"' .. ARGV[18] .. '","ts":"' .. ts .. '","type":"'
local ev_tail = '","task_id":"' .. task_id .. '","queue":"' .. queue .. '","task_type":"' ..
  task_type .. '","attempt":0,"worker_id":null'

local entry_id = ''
if expired then
  call('HSET', KEYS[1], 'task_id', task_id, 'idempotency_key', idem, 'task_type', task_type,
    'created_at', ts, 'created_ms', now, 'available_at', avail,
    'updated_at', ts, 'attempt', 0, 'max_attempts', ARGV[6], 'priority', ARGV[7],
    'timeout_ms', ARGV[8], 'status', status, 'queue', queue, 'metadata', ARGV[9],
    'expires_at', exp_iso, 'expires_at_ms', exp_ms, 'expired_at', ts)
else
  if not delayed then
    -- The stream entry first, so that the hash is written once, entry id included.
    local stream = KEYS[stream_i]
    if stream_len == 0 and call('EXISTS', stream) == 0 then
      -- A new stream: ensure the group on all ten streams of the queue (issue 2), so that a
      -- worker's XREADGROUP over p9..p0 never meets a stream without it (NOGROUP).
      for i = 8, 17 do
        if call('EXISTS', KEYS[i]) == 0 then
          call('XGROUP', 'CREATE', KEYS[i], 'workers', '0', 'MKSTREAM')
        end
      end
    end
    entry_id = call('XADD', stream, '*', 'task_id', task_id, 'queue', queue,
      'task_type', task_type, 'payload', ARGV[3], 'attempt', 1, 'max_attempts', ARGV[6],
      'priority', ARGV[7], 'timeout_ms', ARGV[8], 'idempotency_key', idem)
    call('HSET', KEYS[1], 'task_id', task_id, 'idempotency_key', idem, 'task_type', task_type,
      'created_at', ts, 'created_ms', now, 'available_at', avail,
      'updated_at', ts, 'attempt', 0, 'max_attempts', ARGV[6], 'priority', ARGV[7],
      'timeout_ms', ARGV[8], 'status', status, 'queue', queue, 'metadata', ARGV[9],
      'expires_at', exp_iso, 'expires_at_ms', exp_ms or '', 'entry_id', entry_id)
  else
    call('HSET', KEYS[1], 'task_id', task_id, 'idempotency_key', idem, 'task_type', task_type,
      'created_at', ts, 'created_ms', now, 'available_at', avail,
      'updated_at', ts, 'attempt', 0, 'max_attempts', ARGV[6], 'priority', ARGV[7],
      'timeout_ms', ARGV[8], 'status', status, 'queue', queue, 'metadata', ARGV[9],
      'expires_at', exp_iso, 'expires_at_ms', exp_ms or '')
  end
end
call('EXPIRE', KEYS[1], retention)
call('SET', KEYS[18], ARGV[3], 'EX', retention)  -- after the hash's EXPIRE (keep() in _lib)
call('ZADD', KEYS[5], now, task_id)
call('ZREMRANGEBYRANK', KEYS[5], 0, -(tonumber(ARGV[19]) + 1))
call('SADD', KEYS[7], queue)
-- The history list is new (a fresh task id) and holds at most two entries here: no LTRIM.
if expired then
  call('RPUSH', KEYS[2], h1, '{"ts":"' .. ts .. '","from":"' .. first ..
    '","to":"expired","attempt":0,"reason":"ttl","expired_at":"' .. ts .. '"}')
  call('EXPIRE', KEYS[2], retention)
  if idem ~= '' then
    call('SET', KEYS[3], cjson.encode({task_id = task_id, state = 'failed', updated_at = ts}),
      'EX', ARGV[16])
  end
  call('PUBLISH', ARGV[17], ev_head .. 'TASK_EXPIRED' .. ev_tail ..
    ',"metadata":{"expires_at":"' .. exp_iso .. '","expired_at":"' .. ts .. '"}}')
  return {'new', 'expired', '', now, due, exp_ms}
end
call('RPUSH', KEYS[2], h1)
call('EXPIRE', KEYS[2], retention)

if idem ~= '' then
  call('SET', KEYS[3], cjson.encode({task_id = task_id, state = 'processing', updated_at = ts}),
    'EX', ARGV[16])
end
if exp_ms then call('ZADD', KEYS[6], exp_ms, task_id) end

local ev = ev_head .. 'TASK_QUEUED' .. ev_tail
if delayed then
  call('ZADD', KEYS[4], due, task_id)
  ev = ev .. ',"metadata":{"status":"pending","available_at":"' .. avail .. '"}}'
else
  ev = ev .. '}'
end
call('PUBLISH', ARGV[17], ev)
return {'new', status, entry_id, now, due, exp_ms or ''}
