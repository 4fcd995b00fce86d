-- expire.lua: mark not-started tasks EXPIRED (DESIGN 6): one task for mark_expired, a batch of
-- them for the scheduler's sweep (one call for several tasks: the call's overhead, the Redis
-- clock and the ISO time are paid once per batch, not per task). A retrying task passes
-- RETRYING -> QUEUED -> EXPIRED here (the transition table is not widened; the history shows
-- both steps). Index cleanup: schedule, claim and expiry members and the stream entry go (a
-- delivered, not-started entry stays for its consumer to ACK).
--
-- The sweep does not read the tasks first: it gives each task's hash, history and old payload
-- keys only. A task that needs more keys (QUEUED: its stream entry goes; an idempotency key:
-- its record says failed) is then left unchanged and named in the reply with what its keys
-- are made of; the sweep calls again for it with all eight keys. Delayed tasks, the usual
-- burst, take one call.
--
-- KEYS[1] = dtq:retry:schedule   KEYS[2] = dtq:retry:claimed   KEYS[3] = dtq:expiry
-- KEYS[4] = dtq:stream:audit
-- then, per task in order, 4 or 8 keys (its ARGV says which): dtq:task:<id>,
--   dtq:task:<id>:history, dtq:task:<id>:payload (an older dtq's payload key: own_payload in
--   _lib), dtq:task:<id>:done (where a waiting producer is told: retain in _lib)
--   [, dtq:stream:<queue>:p<N>, dtq:idempotency:<queue>:<key> (placeholder when none), the
--   queue's held zset (a task held by fairness leaves it: docs/limits.md), the queue's
--   workflow outbox (a workflow node's end: retain in _lib; a node has an idempotency key,
--   so it is always given its 8 keys)]
-- ARGV[1] mode: "manual" (now, whatever expires_at says) | "sweep" (only if due)
-- ARGV[2] task retention s  [3] idempotency TTL s  [4] events channel
-- ARGV[5] audit actor ("" = no audit entry, as for the sweep)  [6] audit request_id or ""
-- then three values per task i, from ARGV[6 + 3 * (i - 1) + 1]: task_id, event_id, and how
--   many keys it has (4 or 8)
-- An audit entry (action "expire") is appended for each task marked expired.
-- Returns one reply per task, in order: {"expired", from, queue, task_type} | {"skip", why}
--   | {"keys", queue, priority, idempotency_key} (4 keys given, 8 needed: nothing changed)
--   | {"err", "NOT_FOUND"} | {"err", "STATUS", status}
local call = redis.call
local publish = string.byte(ARGV[4], 5) == 123 and 'SPUBLISH' or 'PUBLISH'  -- as emit in _lib
local sweep = ARGV[1] == 'sweep'
local retention = tonumber(ARGV[2])
local now = now_ms()
local ts = iso(now)
local reason = sweep and 'ttl' or 'mark_expired'
-- History entries and events are built as strings: every value in them is a status, a
-- validated queue or task type name, a hex id, a number or a timestamp (as in submit.lua).
local hist_tail = ',"reason":"' .. reason .. '"'
local expired_meta = '{"expired_at":"' .. ts .. '","reason":"' .. reason .. '"'
local out = {}
local k = 4  -- the keys before this task's
for i = 1, (#ARGV - 6) / 3 do
  local a = 6 + 3 * (i - 1)
  local task_id, event_id, full = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3] == '8'
  local tkey, hkey, pkey, dkey = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local skey, ikey, fkey, okey
  if full then skey, ikey, fkey, okey = KEYS[k + 5], KEYS[k + 6], KEYS[k + 7], KEYS[k + 8]; k = k + 8
  else k = k + 4 end
  local h = call('HMGET', tkey, 'status', 'entry_id', 'queue', 'task_type', 'attempt',
    'idempotency_key', 'expires_at_ms', 'expires_at', 'priority')
  local status, queue, task_type = h[1], h[3] or '', h[4] or ''
  local idem = h[6] or ''
  -- HMGET gives false for a missing field: tonumber(h[7] or '') is nil for "no deadline".
  local exp_ms = tonumber(h[7] or '')
  if not status then
    if sweep then call('ZREM', KEYS[3], task_id); out[i] = {'skip', 'gone'}
    else out[i] = {'err', 'NOT_FOUND'} end
  elseif status ~= 'pending' and status ~= 'queued' and status ~= 'retrying' then
    if sweep then call('ZREM', KEYS[3], task_id); out[i] = {'skip', status}
    else out[i] = {'err', 'STATUS', status} end
  elseif sweep and exp_ms == nil then
    call('ZREM', KEYS[3], task_id)
    out[i] = {'skip', 'no_deadline'}
  elseif sweep and exp_ms > now then
    -- The deadline moved (a reschedule extended it): score the member with it again, so it is
    -- not looked at every second and does not hold a place in every batch.
    call('ZADD', KEYS[3], exp_ms, task_id)
    out[i] = {'skip', 'not_due'}
  elseif not full and (status == 'queued' or idem ~= '') then
    out[i] = {'keys', queue, h[9] or '0', idem}
  else
    local attempt = tonumber(h[5]) or 0
    local from = status == 'retrying' and 'queued' or status
    local last = '{"ts":"' .. ts .. '","from":"' .. from .. '","to":"expired","attempt":' ..
      attempt .. hist_tail .. ',"expired_at":"' .. ts .. '"}'
    if status == 'retrying' then
      hist_push(hkey, retention, '{"ts":"' .. ts .. '","from":"retrying","to":"queued",' ..
        '"attempt":' .. attempt .. hist_tail .. '}', last)
    else
      hist_push(hkey, retention, last)
    end
    call('HSET', tkey, 'status', 'expired', 'expired_at', ts, 'updated_at', ts)
    retain(tkey, pkey, retention, dkey, okey)
    call('ZREM', KEYS[1], task_id)
    call('ZREM', KEYS[2], task_id)
    call('ZREM', KEYS[3], task_id)
    if status == 'queued' then
      drop_entry(skey, 'workers', h[2])
      call('ZREM', fkey, task_id)
    end
    idem_state(ikey, idem, task_id, 'failed', ts, ARGV[3])
    local meta = expired_meta
    if h[8] and h[8] ~= '' then meta = meta .. ',"expires_at":"' .. h[8] .. '"' end
    call(publish, ARGV[4], '{"event_id":"' .. event_id .. '","ts":"' .. ts ..
      '","type":"TASK_EXPIRED","task_id":"' .. task_id .. '","queue":"' .. queue ..
      '","task_type":"' .. task_type .. '","attempt":' .. attempt .. ',"worker_id":null,"metadata":'
      .. meta .. '}}')
    audit(KEYS[4], ARGV[5], ARGV[6], 'expire', task_id, queue, ts)
    out[i] = {'expired', status, queue, task_type}
  end
end
return out
