-- recover.lua: a task whose stream entry was removed outside dtq (XDEL, XTRIM, the stream
-- deleted by hand) gets a new entry (DESIGN 3; docs/delivery-guarantees.md, "Entries removed
-- outside dtq"). The hash holds everything the entry held, so the new entry is the old one again
-- with a new id, and the hash's entry_id names it. The scheduler leader's pass over the task
-- hashes (dtq/worker/lost_entries.py) calls it for the QUEUED and RUNNING tasks whose entry it
-- found gone; everything is checked again here:
--   - the hash still names this entry and the task is QUEUED or RUNNING;
--   - the entry is not in its stream, and no consumer has it pending (whoever has it starts it,
--     finishes it, or the reaper takes it over: a dead holder's is acknowledged by the reaper,
--     and then this script resolves it);
--   - a RUNNING task's worker (the hash's worker_id) is not alive: its worker hash is gone (it
--     expires three heartbeat intervals after the last beat) or says stopped. An alive worker
--     runs the task on and records it through finish.lua on the hash. In the cluster layout the
--     worker hash is in another slot: the caller reads it just before and passes what it found
--     (a worker found dead that beats again is fenced like any worker cut off).
-- A QUEUED task waits again (history QUEUED -> QUEUED, reason entry_lost; TASK_QUEUED with
-- metadata.entry_lost). A RUNNING one is a crash redelivery: its new entry goes through
-- start.lua like any entry of a dead worker (attempt + 1, or WorkerLost past max_attempts; a
-- cancel asked meanwhile is honoured there); history RUNNING -> RUNNING, reason entry_lost.
-- A stream deleted with its group gets the group again (from 0: nothing in it was delivered).
--
-- KEYS[1] = dtq:task:<id>   KEYS[2] = dtq:task:<id>:history
-- KEYS[3] = dtq:stream:<queue>:p<priority> (the task's stream, from the hash)
-- KEYS[4] = dtq:task:<id>:payload (an older dtq's: own_payload in _lib)
-- KEYS[5] = dtq:worker:<worker_id> of the hash's worker (placeholder when none), and
-- KEYS[6] = dtq:queues: flat layout only (the cluster layout's caller adds the queue itself)
-- ARGV[1] task_id  [2] the lost entry id  [3] consumer group  [4] the hash's worker_id ("" none)
-- ARGV[5] events channel  [6] event_id
-- ARGV[7] cluster layout only: "1" when the caller found the worker alive, else "0"
-- Returns {"requeued", status, new entry id} | {"skip", why}: why is gone (no hash), status:<s>
--   (not QUEUED or RUNNING), entry (another entry id), present (the entry is in its stream),
--   pending:<consumer>, worker (another worker id) or alive:<worker id>.
local task_id, lost_id, group, worker = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local h = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'attempt', 'max_attempts',
  'queue', 'task_type', 'priority', 'timeout_ms', 'idempotency_key', 'worker_id')
local status = h[1]
if not status then return {'skip', 'gone'} end
if status ~= 'queued' and status ~= 'running' then return {'skip', 'status:' .. status} end
if h[2] ~= lost_id then return {'skip', 'entry'} end
if #redis.call('XRANGE', KEYS[3], lost_id, lost_id, 'COUNT', 1) > 0 then
  return {'skip', 'present'}
end
local p = redis.pcall('XPENDING', KEYS[3], group, lost_id, lost_id, 1)
if p.err == nil and #p > 0 then return {'skip', 'pending:' .. p[1][2]} end
if status == 'running' then
  if (h[10] or '') ~= worker then return {'skip', 'worker'} end
  local alive
  if KEYS[5] then
    alive = redis.call('EXISTS', KEYS[5]) == 1
      and redis.call('HGET', KEYS[5], 'status') ~= 'stopped'
  else
    alive = ARGV[7] == '1'
  end
  if worker ~= '' and alive then return {'skip', 'alive:' .. worker} end
end

local made = redis.pcall('XGROUP', 'CREATE', KEYS[3], group, '0', 'MKSTREAM')
if type(made) == 'table' and made.err and not string.find(made.err, 'BUSYGROUP', 1, true) then
  return made
end
local prev = tonumber(h[3]) or 0
local queue, task_type = h[5], h[6]
local entry_id = redis.call('XADD', KEYS[3], '*', 'task_id', task_id, 'queue', queue,
  'task_type', task_type, 'payload', task_payload(KEYS[1], KEYS[4]), 'attempt', prev + 1,
  'max_attempts', h[4], 'priority', h[7], 'timeout_ms', h[8], 'idempotency_key', h[9] or '')
local ts = iso(now_ms())
redis.call('HSET', KEYS[1], 'entry_id', entry_id, 'updated_at', ts)
persist(KEYS[1], KEYS[4])
if KEYS[6] then redis.call('SADD', KEYS[6], queue) end
hist(KEYS[2], nil, ts, status, status, prev, status == 'running' and h[10] or '', 'entry_lost',
  {lost_entry_id = lost_id, entry_id = entry_id})
if status == 'queued' then
  emit(ARGV[5], ARGV[6], ts, 'TASK_QUEUED', task_id, queue, task_type, prev, '',
    {entry_lost = true, lost_entry_id = lost_id, entry_id = entry_id})
end
return {'requeued', status, entry_id}
