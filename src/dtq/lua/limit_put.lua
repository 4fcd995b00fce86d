-- limit_put.lua: create or update one rate/concurrency limit's definition (docs/limits.md) in
-- its queue's limits hash, with its audit entry and a CONFIGURATION_CHANGED event in one call.
-- Workers read the hash every second: a change takes effect within a second. A definition that
-- is the stored one changes nothing ("unchanged": no event, the audit entry still written).
-- The limit's state (rate, running, waiting keys) is not touched: an update keeps the places
-- taken and the tasks parked. The queue's fairness path is set again from its keyed limits
-- (fair_config in _lib: docs/limits.md, "Fairness across keys").
--
-- KEYS[1] = the limits hash of the limit's queue   KEYS[2] = the audit stream
-- KEYS[3] = the queue's fairness hash   KEYS[4] = dtq:queues (flat layout only)
-- ARGV[1] name  [2] queue  [3] definition JSON  [4] events channel  [5] event id
-- ARGV[6] audit actor  [7] request id
-- Returns 'created' | 'updated' | 'unchanged'
local call = redis.call
local name, queue, def = ARGV[1], ARGV[2], ARGV[3]
local ts = iso(now_ms())
local old = call('HGET', KEYS[1], name)
local outcome = 'updated'
if not old then outcome = 'created' elseif old == def then outcome = 'unchanged' end
if outcome ~= 'unchanged' then
  call('HSET', KEYS[1], name, def)
  if KEYS[4] then call('SADD', KEYS[4], queue) end
  fair_config(KEYS[1], KEYS[3], queue)
  emit(ARGV[4], ARGV[5], ts, 'CONFIGURATION_CHANGED', cjson.null, queue, cjson.null, 0, nil,
    {limit = name, change = outcome})
end
if ARGV[6] ~= '' then
  call('XADD', KEYS[2], 'MAXLEN', '~', 10000, '*', 'actor', ARGV[6], 'action', 'limit_put',
    'task_id', '', 'queue', queue, 'ts', ts, 'request_id', ARGV[7], 'limit', name)
end
return outcome
