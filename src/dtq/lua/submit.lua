-- submit.lua: ingest a batch of tasks (1 to SUBMIT_CHUNK = 32) in one atomic call (DESIGN 3,
-- contract sections 2, 5, 7). Each task is decided on its own, in order, exactly as if it were
-- alone: idempotency lookup, admission check, hash (payload included), history, recent index,
-- expiry index, then the stream entry (QUEUED) or the schedule member (PENDING, delayed), and the
-- TASK_QUEUED event. A task whose deadline has already passed (ttl 0) is accepted and marked
-- EXPIRED at once. One reply per task; a Redis error in one task (e.g. a key of the wrong type)
-- is that task's reply, and the others go on (as separate script calls would).
--
-- KEYS[1] = dtq:retry:schedule   KEYS[2] = dtq:tasks:recent   KEYS[3] = dtq:expiry
-- KEYS[4 + 13q .. 13 + 13q] = dtq:stream:<queue q>:p9 .. p0, then KEYS[14 + 13q .. 16 + 13q] =
--   its fairness keys (keys.fair_keys: the state hash, the held zset, the rounds zset), for each
--   queue q = 0 .. Q-1 of the batch
-- KEYS[T + 3i .. T + 2 + 3i], T = 4 + 13Q, for each task i = 0 .. n-1: dtq:task:<id>, its
--   :history, dtq:idempotency:<queue>:<key> (placeholder when no key)
-- KEYS[T + 3n + q], for each queue q = 0 .. Q-1 of the batch: dtq:queue:<queue q>:last_submit
--   (the Redis time of the queue's last accepted submit, which remove_queue.lua reads; one SET
--   per queue of the batch, beside its SADD)
-- KEYS[T + 3n + Q] = dtq:queues, flat layout only: in the cluster layout a batch is one queue's
--   (every key in its slot) and the caller adds the queue to the registry in a call of its own
--   (docs/redis-schema.md, "The cluster layout")
-- ARGV[1] max queue depth  [2] task retention s  [3] idempotency TTL s  [4] events channel
-- ARGV[5] recent-index cap  [6] Q, the number of queues
-- ARGV[7 + 15i .. 21 + 15i], for each task i: task_id, task_type, payload JSON, queue,
--   its queue's index q, idempotency_key or "", max_attempts, priority, timeout_ms,
--   metadata JSON, delay_ms, schedule_at_ms or "", ttl_ms or "", expires_at_ms or "", event_id
-- ARGV[7 + 15n] "1" when the caller sends WAIT after this call (DTQ_SUBMIT_MIN_REPLICAS > 0),
--   else "0"
--
-- A replay (the key's record exists: "dup", or IDEMPOTENCY_IN_PROGRESS) writes nothing of its
-- own, and WAIT waits for the replication offset of its connection's last write (Redis 7 and
-- Valkey; Redis 6.2 moves it at every command): it would prove nothing about a task another
-- connection wrote. With ARGV[7 + 15n] = "1" a replay therefore writes the record again,
-- unchanged (same value, TTL kept): a write later in the replication stream than every write
-- of the task, so the WAIT that follows confirms the task itself (docs/delivery-guarantees.md,
-- "Replicated submits"). With "0" a replay writes nothing, as before.
-- Admission is exact: the queue's depth (XLEN of its ten streams, plus its held tasks) is read
-- once per batch and then counted up with each task this call adds; no other command runs
-- meanwhile (one script).
-- Fairness (docs/limits.md, "Fairness across keys"): when the queue's state hash names a key
-- path, a task to run now goes into its stream only while fewer than FAIR_WINDOW entries are
-- unread there and none is held; otherwise it is held (QUEUED, no entry_id yet, `fair_key` its
-- key value) in its round, and a worker's fair_move.lua moves it when its turn comes.
-- All tasks of a batch share one Redis TIME (created_at); their recent-index scores differ
-- by a microsecond each, in batch order.
-- Cost (docs/performance.md): per batch, the EVALSHA, TIME and the ISO timestamp, the XLENs of
-- each queue, one ZADD + ZREMRANGEBYRANK of the recent index and one SADD per queue; per task,
-- one HSET (the stream entry before it, so the hash is written once; a payload or other value
-- over 64 bytes takes the hash out of the compact encoding: docs/performance.md), the history
-- RPUSH, the XADD or ZADD and the PUBLISH. A task that waits gets no TTL (DESIGN 11): its keys
-- are new, so nothing to PERSIST. The history entry and the event are JSON strings built by
-- concatenation, which is safe because every value in them is a validated task type or queue
-- name (no character that JSON escapes), a hex id or a timestamp.
-- Returns one reply per task, in order:
--         {"new", status, entry_id or "", now_ms, due_ms, expires_at_ms or ""}
--       | {"dup", state, task_id}
--       | {"err", code, detail}   (code "REDIS": a Redis error, detail its message)
-- except on a replica (a demoted primary), which refuses every write: then the whole call fails
-- with its READONLY error.
local call = redis.call
local max_depth = tonumber(ARGV[1])
local retention = tonumber(ARGV[2])
local idem_ttl = ARGV[3]
local channel = ARGV[4]
local publish = string.byte(channel, 5) == 123 and 'SPUBLISH' or 'PUBLISH'  -- as emit in _lib
local nq = tonumber(ARGV[6])
local first_task_key = 4 + 13 * nq
local n = (#ARGV - 7) / 15
local replicated = ARGV[#ARGV] == '1'
local registry = KEYS[first_task_key + 3 * n + nq]  -- nil in the cluster layout

-- TIME once: `now` (epoch ms) for every timestamp of the batch; the recent index scores each
-- task with the microsecond it was taken in (now_us + its place in the batch, as fractional
-- ms), so "recent first" keeps the submit order within a millisecond and within one batch.
local clock = call('TIME')
local now_us = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local now = math.floor(now_us / 1000)
local ts = iso(now)

-- Per queue of the batch: its depth (the XLENs of its streams, band 0 = p9 .. 9 = p0, read at
-- its first task), which of its streams are known to exist, and whether it is in dtq:queues.
-- A stream with entries at that XLEN exists (nothing in this script deletes a stream); the
-- others are learned by ensure_groups.
-- A fair queue's path, held count and unread entries are read at its first task too.
local depth, exists, listed = {}, {}, {}
local fair_path, held, unread = {}, {}, {}

local function queue_state(q)
  if depth[q] == nil then
    local known, d, base = {}, 0, 4 + 13 * q
    for band = 0, 9 do
      local x = call('XLEN', KEYS[base + band])
      if x > 0 then known[band] = true end
      d = d + x
    end
    local path = call('HGET', KEYS[base + 10], 'key')
    if path then
      fair_path[q] = path
      held[q] = call('ZCARD', KEYS[base + 11])
      unread[q] = fair_unread(KEYS, base)
      d = d + held[q]
    end
    depth[q], exists[q] = d, known
  end
end

-- A new stream: ensure the group on all ten streams of the queue, so that a worker's
-- XREADGROUP over p9..p0 never meets a stream without it (NOGROUP).
local function ensure_groups(q, band)
  local known = exists[q]
  if known[band] then return end
  local base = 4 + 13 * q
  if call('EXISTS', KEYS[base + band]) == 0 then
    for b = 0, 9 do
      if not known[b] and call('EXISTS', KEYS[base + b]) == 0 then
        call('XGROUP', 'CREATE', KEYS[base + b], 'workers', '0', 'MKSTREAM')
      end
      known[b] = true
    end
  end
  known[band] = true
end

local recent = {}

local function submit_one(a, k)
  local task_id, task_type, payload, queue = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local q, idem = tonumber(ARGV[a + 4]), ARGV[a + 5]
  local max_attempts, prio_s, timeout_ms, meta = ARGV[a + 6], ARGV[a + 7], ARGV[a + 8], ARGV[a + 9]
  local khash, khist, kidem = KEYS[k], KEYS[k + 1], KEYS[k + 2]

  if idem ~= '' then
    local rec = call('GET', kidem)
    if rec then
      if replicated then call('SET', kidem, rec, 'KEEPTTL') end
      local r = cjson.decode(rec)
      if r.state == 'processing' then return {'err', 'IDEMPOTENCY_IN_PROGRESS', r.task_id} end
      return {'dup', r.state, r.task_id}
    end
  end

  queue_state(q)
  if depth[q] >= max_depth then return {'err', 'QUEUE_FULL', tostring(depth[q])} end

  local due = now
  if ARGV[a + 11] ~= '' then due = tonumber(ARGV[a + 11])
  elseif tonumber(ARGV[a + 10]) > 0 then due = now + tonumber(ARGV[a + 10]) end
  local exp_ms = nil
  if ARGV[a + 13] ~= '' then exp_ms = tonumber(ARGV[a + 13])
  elseif ARGV[a + 12] ~= '' then exp_ms = now + tonumber(ARGV[a + 12]) end

  local delayed = due > now
  local status = delayed and 'pending' or 'queued'
  local expired = exp_ms ~= nil and exp_ms <= now
  if expired then status = 'expired' end
  local avail = due == now and ts or iso(due)
  local exp_iso = exp_ms and iso(exp_ms) or ''

  -- The history entry and the event, as JSON strings (see the header).
  local first = delayed and 'pending' or 'queued'
  local h1 = '{"ts":"' .. ts .. '","from":null,"to":"' .. first ..
    '","attempt":0,"reason":"created"'
  if exp_ms then h1 = h1 .. ',"expires_at":"' .. exp_iso .. '"' end
  h1 = h1 .. '}'
  local ev_head = '{"event_id":"' .. ARGV[a + 14] .. '","ts":"' .. ts .. '","type":"'
  local ev_tail = '","task_id":"' .. task_id .. '","queue":"' .. queue .. '","task_type":"' ..
    task_type .. '","attempt":0,"worker_id":null'

  -- The hash's fields after those every task has: expired_at (expired), entry_id (queued).
  local entry_id, tail, hold = '', {}, nil
  if expired then
    tail = {'expired_at', ts}
  elseif not delayed then
    local band = 9 - tonumber(prio_s)
    local path = fair_path[q]
    if path and (held[q] > 0 or unread[q] >= FAIR_WINDOW) then
      hold = fair_value(payload, path)
      held[q] = held[q] + 1
      tail = {'fair_key', hold}
    else
      -- The stream entry first, so that the hash is written once, entry id included.
      ensure_groups(q, band)
      entry_id = call('XADD', KEYS[4 + 13 * q + band], '*', 'task_id', task_id, 'queue', queue,
        'task_type', task_type, 'payload', payload, 'attempt', 1, 'max_attempts', max_attempts,
        'priority', prio_s, 'timeout_ms', timeout_ms, 'idempotency_key', idem)
      if path then unread[q] = unread[q] + 1 end
      tail = {'entry_id', entry_id}
    end
    depth[q] = depth[q] + 1
  end
  call('HSET', khash, 'task_id', task_id, 'idempotency_key', idem, 'task_type', task_type,
    'payload', payload, 'created_at', ts, 'created_ms', now, 'available_at', avail,
    'updated_at', ts, 'attempt', 0, 'max_attempts', max_attempts, 'priority', prio_s,
    'timeout_ms', timeout_ms, 'status', status, 'queue', queue, 'metadata', meta,
    'expires_at', exp_iso, 'expires_at_ms', exp_ms or '', unpack(tail))
  -- Lifetimes (DESIGN 11, retain() in _lib): a task that waits has no TTL, however long it
  -- waits; one expired at submit is terminal and gets the retention.
  if expired then call('EXPIRE', khash, retention) end
  recent[#recent + 1] = (now_us + #recent / 2) / 1000
  recent[#recent + 1] = task_id
  if not listed[q] then
    if registry then call('SADD', registry, queue) end
    call('SET', KEYS[first_task_key + 3 * n + q], now)
    listed[q] = true
  end
  -- The history list is new (a fresh task id) and holds at most two entries here: no LTRIM.
  if expired then
    call('RPUSH', khist, h1, '{"ts":"' .. ts .. '","from":"' .. first ..
      '","to":"expired","attempt":0,"reason":"ttl","expired_at":"' .. ts .. '"}')
    call('EXPIRE', khist, retention)
    if idem ~= '' then
      call('SET', kidem, cjson.encode({task_id = task_id, state = 'failed', updated_at = ts}),
        'EX', idem_ttl)
    end
    call(publish, channel, ev_head .. 'TASK_EXPIRED' .. ev_tail ..
      ',"metadata":{"expires_at":"' .. exp_iso .. '","expired_at":"' .. ts .. '"}}')
    return {'new', 'expired', '', now, due, exp_ms}
  end
  call('RPUSH', khist, h1)
  -- No TTL on the record while its task waits or runs: a duplicate submit never makes a second
  -- task (idem_state in _lib gives it DTQ_IDEM_TTL_S when the task ends).
  if idem ~= '' then
    call('SET', kidem, cjson.encode({task_id = task_id, state = 'processing', updated_at = ts}))
  end
  if exp_ms then call('ZADD', KEYS[3], exp_ms, task_id) end
  if hold then
    local base = 4 + 13 * q
    fair_hold(KEYS[base + 10], KEYS[base + 11], KEYS[base + 12], task_id, 9 - tonumber(prio_s),
      hold)
  end
  local ev = ev_head .. 'TASK_QUEUED' .. ev_tail
  if delayed then
    call('ZADD', KEYS[1], due, task_id)
    ev = ev .. ',"metadata":{"status":"pending","available_at":"' .. avail .. '"}}'
  else
    ev = ev .. '}'
  end
  call(publish, channel, ev)
  return {'new', status, entry_id, now, due, exp_ms or ''}
end

local out = {}
for i = 0, n - 1 do
  local ok, reply = pcall(submit_one, 7 + 15 * i, first_task_key + 3 * i)
  if not ok then
    -- A failed redis.call raises a table {err = message}; a Lua error, a string.
    if type(reply) == 'table' then reply = reply.err end
    reply = tostring(reply)
    -- A replica (a demoted primary) refuses every write: the whole call fails with its READONLY
    -- (Redis 6.2 prefixes it with the script's position), so the client drops the connection
    -- and asks the sentinels for the primary again (docs/operations.md, "Sentinel").
    local readonly = string.find(reply, 'READONLY ', 1, true)
    if readonly then return redis.error_reply(string.sub(reply, readonly)) end
    reply = {'err', 'REDIS', reply}
  end
  out[i + 1] = reply
end
if #recent > 0 then
  call('ZADD', KEYS[2], unpack(recent))
  call('ZREMRANGEBYRANK', KEYS[2], 0, -(tonumber(ARGV[5]) + 1))
end
return out
