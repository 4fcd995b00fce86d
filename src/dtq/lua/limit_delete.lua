-- limit_delete.lua: delete one limit's definition from its queue's limits hash (docs/limits.md),
-- with its audit entry and a CONFIGURATION_CHANGED event in one call. Only the definition goes:
-- the state keys stay, so a task running under the limit still releases its place at its
-- finish, and a parked task is still promoted; the per-key state expires when idle.
--
-- The queue's fairness path is set again from the keyed limits left (fair_config in _lib): with
-- none, new tasks go straight into the streams, and the held ones are still moved in turn.
--
-- KEYS[1] = the limits hash of the limit's queue   KEYS[2] = the audit stream
-- KEYS[3] = the queue's fairness hash
-- ARGV[1] name  [2] queue  [3] events channel  [4] event id  [5] audit actor  [6] request id
-- Returns 1 when it was deleted, 0 when there was no such limit in this queue
local call = redis.call
local name, queue = ARGV[1], ARGV[2]
if call('HDEL', KEYS[1], name) == 0 then return 0 end
fair_config(KEYS[1], KEYS[3], queue)
local ts = iso(now_ms())
emit(ARGV[3], ARGV[4], ts, 'CONFIGURATION_CHANGED', cjson.null, queue, cjson.null, 0, nil,
  {limit = name, change = 'deleted'})
if ARGV[5] ~= '' then
  call('XADD', KEYS[2], 'MAXLEN', '~', 10000, '*', 'actor', ARGV[5], 'action', 'limit_delete',
    'task_id', '', 'queue', queue, 'ts', ts, 'request_id', ARGV[6], 'limit', name)
end
return 1
