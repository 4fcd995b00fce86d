-- progress.lua: store a running handler's latest ctx.progress() on its task and publish
-- TASK_PROGRESS (deliberate extension; docs/handlers.md, "Progress"). The worker sends at most
-- one call per task every interval (dtq.worker.progress), never after the attempt's finish.
--
-- Fenced like finish.lua: only while the entry is still pending for this consumer (XPENDING on
-- that one id; an entry removed from its stream outside dtq: the hash is the lease, and it must
-- name this worker) and the hash is RUNNING this entry at this attempt under this worker.
-- Otherwise nothing is written and the reply says why: the worker's reporter stops on it.
--
-- The hash's `progress` field: JSON {fraction, data, updated_at (Redis clock), attempt}. It is
-- kept when the task reaches its terminal state; readers show it only while its attempt is the
-- task's (a retry's next attempt starts without progress), and the next call replaces it.
--
-- KEYS[1] = dtq:task:<id>   KEYS[2] = the entry's stream
-- ARGV[1] task_id  [2] entry_id  [3] worker_id  [4] consumer group  [5] attempt (digits)
-- ARGV[6] fraction as JSON ("null" or a number from 0 to 1)  [7] data as compact JSON (both
-- checked by the worker: dtq.models.check_progress)
-- ARGV[8] events channel  [9] event_id
-- Returns {"ok", updated_at} | {"fenced", why}
local entry_id, worker, group = ARGV[2], ARGV[3], ARGV[4]
local attempt = tonumber(ARGV[5])

local fenced = entry_fence(KEYS[2], group, entry_id, worker)
if fenced then return {'fenced', fenced} end
local h = redis.call('HMGET', KEYS[1], 'status', 'entry_id', 'attempt', 'worker_id', 'queue',
  'task_type')
if not h[1] then return {'fenced', 'missing'} end
if h[1] ~= 'running' then return {'fenced', 'status:' .. h[1]} end
if h[2] ~= entry_id then return {'fenced', 'entry'} end
if tonumber(h[3]) ~= attempt then return {'fenced', 'attempt'} end
if h[4] ~= worker then return {'fenced', 'worker'} end

local ts = iso(now_ms())
-- The field is spliced from the worker's JSON, so the data is kept exactly; the event's
-- metadata goes through cjson like every event's (numbers keep 14 significant digits, an
-- empty array reads as {}).
redis.call('HSET', KEYS[1], 'progress', '{"fraction":' .. ARGV[6] .. ',"data":' .. ARGV[7]
  .. ',"updated_at":"' .. ts .. '","attempt":' .. ARGV[5] .. '}')
emit(ARGV[8], ARGV[9], ts, 'TASK_PROGRESS', ARGV[1], h[5], h[6], attempt, worker,
  {fraction = cjson.decode(ARGV[6]), data = cjson.decode(ARGV[7])})
return {'ok', ts}
