-- limit_delete.lua: delete one limit's definition from its queue's limits hash (docs/limits.md),
-- with its state, its audit entry and a CONFIGURATION_CHANGED event in one call. The state
-- goes with it, so a limit created again under that name starts clean: no place held by a task
-- that ran under the old one (its finish then frees nothing), no rate spent. A task parked in
-- the deleted waiting set is still in the retry schedule: it is due again within
-- PARKED_RECHECK_MS of its park (start.lua) and then starts under the limits it meets then.
-- A keyed limit's state is one set of keys per key value, found by the caller (a SCAN) once
-- the definition is gone: it sends them to this script again with ARGV[7] = "state", which
-- deletes them only while no limit of that name is in the hash (one created again meanwhile
-- keeps its state).
--
-- The queue's fairness path is set again from the keyed limits left (fair_config in _lib): with
-- none, new tasks go straight into the streams, and the held ones are still moved in turn.
--
-- KEYS[1] = the limits hash of the limit's queue   KEYS[2] = the audit stream
-- KEYS[3] = the queue's fairness hash
-- KEYS[4..] = state keys to delete: the limit's own <prefix>:rate, :running, :waiting, or
--             (ARGV[7] = "state") those of its key values
-- ARGV[1] name  [2] queue  [3] events channel  [4] event id  [5] audit actor  [6] request id
-- ARGV[7] "state": delete only the state keys (see above); absent: delete the limit
-- Returns 1 when it was deleted, 0 when there was no such limit in this queue; with "state",
-- how many state keys it deleted, or -1 when a limit of that name exists again
local call = redis.call
local name, queue = ARGV[1], ARGV[2]
if ARGV[7] == 'state' then
  if call('HEXISTS', KEYS[1], name) == 1 then return -1 end
  if #KEYS < 4 then return 0 end
  return call('DEL', unpack(KEYS, 4))
end
if call('HDEL', KEYS[1], name) == 0 then return 0 end
fair_config(KEYS[1], KEYS[3], queue)
if #KEYS >= 4 then call('DEL', unpack(KEYS, 4)) end
local ts = iso(now_ms())
emit(ARGV[3], ARGV[4], ts, 'CONFIGURATION_CHANGED', cjson.null, queue, cjson.null, 0, nil,
  {limit = name, change = 'deleted'})
if ARGV[5] ~= '' then
  call('XADD', KEYS[2], 'MAXLEN', '~', 10000, '*', 'actor', ARGV[5], 'action', 'limit_delete',
    'task_id', '', 'queue', queue, 'ts', ts, 'request_id', ARGV[6], 'limit', name)
end
return 1
