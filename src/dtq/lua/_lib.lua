-- _lib.lua: helpers prepended to every dtq script by dtq/scripts.py (not a script of its own).
-- Nothing here touches a key that the calling script did not receive in KEYS.

-- The one clock (DESIGN 5): Redis server time in epoch milliseconds.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Epoch ms -> ISO 8601 UTC with milliseconds ("2026-01-28T17:00:00.000Z").
local function iso(ms)
  local s = math.floor(ms / 1000)
  local days = math.floor(s / 86400)
  local sod = s - days * 86400
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return string.format('%04d-%02d-%02dT%02d:%02d:%02d.%03dZ', y, m, d,
    math.floor(sod / 3600), math.floor(sod % 3600 / 60), sod % 60, ms % 1000)
end

-- Lifetimes (DESIGN 11, docs/redis-schema.md "Lifetimes"): a task's hash and history have no
-- TTL while the task is PENDING, QUEUED, RETRYING or RUNNING, whatever its age: retention is
-- never a deadline for waiting or running work. The script that makes a task terminal gives
-- both the retention (`retain`, and `hist` with retention_s); a script that leaves it
-- non-terminal removes any TTL (`persist`, and `hist` with retention_s nil): a task requeued
-- from the DLQ had one, and so has a task an older dtq wrote.

-- Append already-encoded JSON entries (one or more, in order) to a task's history (DESIGN 7),
-- capped at 100, and give the list the hash's lifetime: EXPIRE retention_s, or PERSIST when
-- retention_s is nil (the task is not terminal). RPUSH returns the new length: a list of 100
-- or fewer needs no LTRIM (the common case).
local function hist_push(key, retention_s, ...)
  if redis.call('RPUSH', key, ...) > 100 then
    redis.call('LTRIM', key, -100, -1)
  end
  if retention_s then
    redis.call('EXPIRE', key, retention_s)
  else
    redis.call('PERSIST', key)
  end
end

-- Append one state change to the task's history, as a table encoded here (see hist_push).
local function hist(key, retention_s, ts, from, to, attempt, worker, reason, extra)
  local e = extra or {}
  e.ts = ts
  e.from = from or cjson.null
  e.to = to
  e.attempt = tonumber(attempt) or 0
  if worker and worker ~= '' then e.worker_id = worker end
  if reason and reason ~= '' then e.reason = reason end
  hist_push(key, retention_s, cjson.encode(e))
end

-- Publish one event of contract section 8 on `channel` (dtq.keys.events): the classic
-- dtq:events with PUBLISH, or a queue's shard channel dtq:{<queue>}:events, in the script's
-- slot, with SPUBLISH (sharded pub/sub, cluster layout). A '{' as the name's fifth byte says
-- which: no redis.call to find out.
local function emit(channel, event_id, ts, etype, task_id, queue, task_type, attempt, worker, meta)
  local ev = {event_id = event_id, ts = ts, type = etype, task_id = task_id, queue = queue,
    task_type = task_type, attempt = tonumber(attempt) or 0,
    worker_id = (worker and worker ~= '') and worker or cjson.null}
  if meta then ev.metadata = meta end
  local publish = string.byte(channel, 5) == 123 and 'SPUBLISH' or 'PUBLISH'
  redis.call(publish, channel, cjson.encode(ev))
end

-- Set the idempotency record's state (contract section 5; DESIGN 11). Only the task the record
-- names updates it: a record naming another task is left as it is (this task's record was
-- removed, by hand or by the TTL an older dtq gave it while the task waited, and another
-- submit took the key). A missing record is written again for this task. `processing` has no
-- TTL: a duplicate submit of a task that still waits or runs never makes a second task;
-- `completed` and `failed` live DTQ_IDEM_TTL_S from the task's end.
local function idem_state(key, idem_key, task_id, state, ts, idem_ttl_s)
  if idem_key == nil or idem_key == '' then return end
  local rec = redis.call('GET', key)
  if rec then
    local ok, r = pcall(cjson.decode, rec)
    if not ok or type(r) ~= 'table' or r.task_id ~= task_id then return end
  end
  local value = cjson.encode({task_id = task_id, state = state, updated_at = ts})
  if state == 'processing' then
    redis.call('SET', key, value)
  else
    redis.call('SET', key, value, 'EX', idem_ttl_s)
  end
end

-- Remove a task's stream entry. An entry already delivered to a consumer (in the PEL) stays:
-- that consumer's start script, or the reaper's, sees the terminal status and XACKs + XDELs it.
-- Returns true when the entry is gone, false when it was left for its consumer.
local function drop_entry(stream, group, entry_id)
  if not entry_id or entry_id == '' then return true end
  if redis.call('EXISTS', stream) == 0 then return true end
  local p = redis.call('XPENDING', stream, group, entry_id, entry_id, 1)
  if #p > 0 then return false end
  redis.call('XDEL', stream, entry_id)
  return true
end

-- The fencing rule's first half (DESIGN 3, docs/delivery-guarantees.md), for a script of the
-- worker that holds an entry: the entry must be pending for this worker, or gone from its
-- stream (removed outside dtq: the task's hash is then the lease, which the caller checks).
-- Returns why the caller is fenced (nil: it is not), and whether the entry is gone.
local function entry_fence(stream, group, entry_id, worker)
  -- pcall: a stream deleted with its group (NOGROUP) holds the entry no more.
  local p = redis.pcall('XPENDING', stream, group, entry_id, entry_id, 1)
  if p.err ~= nil or #p == 0 then
    if #redis.call('XRANGE', stream, entry_id, entry_id, 'COUNT', 1) > 0 then
      return 'not_pending', false
    end
    return nil, true
  end
  if p[1][2] ~= worker then return 'owner:' .. p[1][2], false end
  return nil, false
end

-- A place of a limit came free (docs/limits.md, "How a limit is enforced"): the first task
-- parked for a place (highest priority, then parked longest, to the ms) is made due now in the
-- retry schedule, for the scheduler to promote. A member no longer in the schedule (cancelled,
-- expired, or promoted by its own re-check meanwhile) is dropped and the next one taken.
-- True when a waiter was made due: the worker then promotes it at once (without waiting for
-- the scheduler's next pass).
local function limit_promote(waiting, schedule, now)
  while true do
    local w = redis.call('ZPOPMIN', waiting)
    if #w == 0 then return false end
    local due = redis.call('ZSCORE', schedule, w[1])
    if due then
      if tonumber(due) > now then redis.call('ZADD', schedule, now, w[1]) end
      return true
    end
  end
end

-- Append one operator action to the audit stream (contract 13) in the script that makes the
-- change, so the entry and the change are one atomic step. No actor: nothing is written.
-- Fields: the contract's {actor, action, task_id, ts, request_id} plus `queue` (extension: a
-- queue-level action has no task id to say which queue it touched), and `schedule` for an
-- action on a schedule (extension). MAXLEN ~ 10000.
local function audit(key, actor, request_id, action, task_id, queue, ts, schedule)
  if actor == nil or actor == '' then return end
  if schedule then
    redis.call('XADD', key, 'MAXLEN', '~', 10000, '*', 'actor', actor, 'action', action,
      'task_id', task_id or '', 'queue', queue or '', 'ts', ts, 'request_id', request_id or '',
      'schedule', schedule)
    return
  end
  redis.call('XADD', key, 'MAXLEN', '~', 10000, '*', 'actor', actor, 'action', action,
    'task_id', task_id or '', 'queue', queue or '', 'ts', ts, 'request_id', request_id or '')
end

-- The payload is the hash's `payload` field (contract section 2). The dtq before this one kept
-- it in a string key of its own, dtq:task:<id>:payload, with the hash's lifetime; a task it
-- wrote may still be stored (waiting tasks never expire now). `retain` and `persist` move such
-- a key into its hash the first time a script gives the task a lifetime, so that the payload
-- lives exactly as long as its hash; for any other task this costs one HEXISTS. Callers have
-- read the hash's status first: the hash exists.
local function own_payload(hash_key, old_payload_key)
  if redis.call('HEXISTS', hash_key, 'payload') == 1 then return end
  local v = redis.call('GET', old_payload_key)
  if v then
    redis.call('HSET', hash_key, 'payload', v)
    redis.call('DEL', old_payload_key)
  end
end

-- A task that reached a terminal state: its hash lives DTQ_TASK_RETENTION_S from now.
-- When a producer waits for it (wait.lua set the hash's `waited` field), the terminal state is
-- also pushed to them, in this same script: done_key (dtq:task:<id>:done) becomes a stream of
-- one entry {status} with the hash's lifetime, which the waiters' XREAD BLOCK on it returns.
-- A node of a workflow (idempotency key "dtq-wf:<wid>:<node>", docs/workflows.md) has its end
-- appended to its queue's outbox (outbox_key, dtq:wfbox:<queue>) in this same script: one
-- entry {task_id, status, key}, which the workers' relay applies to the workflow and then
-- deletes (the stream holds the ends not applied yet). Any other task pays one HMGET of four
-- fields for both. Scripts that leave a task terminal as it was (a DLQ discard or purge) pass
-- neither key: its end was told when it was reached.
-- `known`: those four fields ({waited, idempotency_key, status, task_id}) when the caller has
-- them already (finish.lua read them in its first HMGET, and set the status): no HMGET then.
local function retain(hash_key, old_payload_key, retention_s, done_key, outbox_key, known)
  own_payload(hash_key, old_payload_key)
  redis.call('EXPIRE', hash_key, retention_s)
  if not done_key then return end
  local h = known or redis.call('HMGET', hash_key, 'waited', 'idempotency_key', 'status',
    'task_id')
  if h[1] then
    redis.call('DEL', done_key)
    redis.call('XADD', done_key, '*', 'status', h[3])
    redis.call('EXPIRE', done_key, retention_s)
  end
  if outbox_key and h[2] and string.sub(h[2], 1, 7) == 'dtq-wf:' then
    redis.call('XADD', outbox_key, '*', 'task_id', h[4] or '', 'status', h[3], 'key', h[2])
  end
end

-- A task that is (again, or still) not terminal: its hash keeps no TTL.
local function persist(hash_key, old_payload_key)
  own_payload(hash_key, old_payload_key)
  redis.call('PERSIST', hash_key)
end

-- The task's payload JSON, for the stream or dead-letter entry a script writes: the hash's
-- field, or the old payload key of a task not moved yet (see own_payload). '{}' when neither
-- is there, which dtq never leaves; it is what a read of such a task shows too.
local function task_payload(hash_key, old_payload_key)
  return redis.call('HGET', hash_key, 'payload') or redis.call('GET', old_payload_key) or '{}'
end

-- Fairness across keys (docs/limits.md, "Fairness across keys"). A fair queue keeps at most
-- FAIR_WINDOW entries unread in its streams; the others are held in its held zset, each scored
-- band * FAIR_BAND + round, where a task's round is its key's next one in its band and never a
-- round already served: a key new to the queue is served in the current round. The lowest
-- score goes into its stream first, so the bands keep their strict order and, within a band,
-- the keys take turns.
local FAIR_WINDOW = 64
local FAIR_BAND = 1099511627776  -- 2^40 rounds per band: scores stay exact integers

-- A task's key value under the queue's fairness path ("payload.a.b"): as dtq.limits.key_value,
-- a string as it is, another JSON value as compact JSON, "_none" when the payload has none
-- there; a longer value than 128 bytes is cut and suffixed with its hash.
local function fair_value(payload, path)
  local ok, v = pcall(cjson.decode, payload)
  if not ok then return '_none' end
  for name in string.gmatch(string.sub(path, 9), '[^.]+') do
    if type(v) ~= 'table' or v[name] == nil then return '_none' end
    v = v[name]
  end
  if type(v) ~= 'string' then v = cjson.encode(v) end
  if v == '' then return '_none' end
  if #v > 128 then v = string.sub(v, 1, 111) .. '~' .. string.sub(redis.sha1hex(v), 1, 16) end
  return v
end

-- How many entries of a queue's streams (keys[first] .. keys[first + 9]) no consumer has read:
-- each stream's length less its pending entries.
local function fair_unread(keys, first)
  local n = 0
  for k = first, first + 9 do
    local len = redis.call('XLEN', keys[k])
    if len > 0 then
      local p = redis.pcall('XPENDING', keys[k], 'workers')
      if type(p) == 'table' and p.err == nil then len = len - p[1] end
      if len > 0 then n = n + len end
    end
  end
  return n
end

-- Hold one task of a fair queue (its hash written with the caller's fields).
local function fair_hold(kfair, kheld, krounds, task_id, band, value)
  local base = band * FAIR_BAND
  local round = tonumber(redis.call('HGET', kfair, 'r' .. band)) or 0
  local member = band .. ':' .. value
  local last = tonumber(redis.call('ZSCORE', krounds, member))
  if last and last - base + 1 > round then round = last - base + 1 end
  local score = string.format('%.0f', base + round)
  redis.call('ZADD', krounds, score, member)
  redis.call('ZADD', kheld, score, task_id)
end

-- Set or clear a queue's fairness path from its keyed limits (limit_put, limit_delete): the
-- key of the first of them by name; none: the queue is served in plain priority order.
local function fair_config(klimits, kfair, queue)
  local all = redis.call('HGETALL', klimits)
  local best, path = nil, nil
  for i = 1, #all, 2 do
    local ok, d = pcall(cjson.decode, all[i + 1])
    if ok and type(d) == 'table' and (d.queue or 'default') == queue
        and type(d.key) == 'string' and (best == nil or all[i] < best) then
      best, path = all[i], d.key
    end
  end
  if path then redis.call('HSET', kfair, 'key', path) else redis.call('HDEL', kfair, 'key') end
end
