-- schedule_put.lua: create or update a schedule (docs/schedules.md), atomically with the
-- firer: the hash, its index member, a history entry and the audit entry in one call.
--
-- A definition that is the stored one changes nothing ("unchanged", rev kept). One whose
-- spec (cron or interval, zone, anchor, start, end) is the stored one keeps the cursor, so a
-- deploy that upserts its schedules again neither fires nor loses a tick; a new spec takes the
-- caller's cursor (its first tick from now). A schedule declared in code (source "code") that
-- a worker paused as removed from its code is resumed by the next upsert from code; any other
-- pause stays.
--
-- KEYS[1] = the schedule's hash   KEYS[2] = its history   KEYS[3] = the schedule index
-- KEYS[4] = the audit stream      KEYS[5] = dtq:queues (flat layout only)
-- ARGV[1] name  [2] queue  [3] task_type  [4] definition JSON  [5] spec key (JSON)
-- ARGV[6] the cursor for a new spec ("" = no tick: it ended)  [7] source ("api" | "code")
-- ARGV[8] paused: "1" | "0" | "" (not said: a new schedule is active, a stored one keeps its)
-- ARGV[9] history cap  [10] events channel  [11] event id  [12] audit actor  [13] request id
-- ARGV[14] the overlap policy (kept beside the definition: fire.lua reads it)
-- ARGV[15] "create" (only if there is none), "update" (only if there is one) or "" (either)
-- Returns {'created' | 'updated' | 'unchanged', rev}, or {'exists', rev} / {'missing', ''}
--   when ARGV[15] refused (nothing written)
local call = redis.call
local h, khist, index = KEYS[1], KEYS[2], KEYS[3]
local name, queue, def, spec_key = ARGV[1], ARGV[2], ARGV[4], ARGV[5]
local source, want_paused = ARGV[7], ARGV[8]
local now = now_ms()
local ts = iso(now)
local old = call('HMGET', h, 'rev', 'definition', 'spec_key', 'paused', 'paused_reason',
  'cursor', 'source', 'buffered_ms')

if ARGV[15] == 'create' and old[1] then return {'exists', old[1]} end
if ARGV[15] == 'update' and not old[1] then return {'missing', ''} end
local outcome, cursor, paused, reason
if not old[1] then
  outcome, cursor = 'created', ARGV[6]
  paused, reason = want_paused == '1' and '1' or '0', ''
  call('HSET', h, 'name', name, 'created_at', ts, 'fired', 0, 'skipped_overlap', 0, 'missed', 0,
    'last_task_id', '', 'buffered_ms', '', 'last_error', '', 'rev', 0)
else
  paused, reason = old[4], old[5] or ''
  if want_paused ~= '' and want_paused ~= paused then
    paused, reason = want_paused, ''
  elseif source == 'code' and paused == '1' and reason == 'removed from code' then
    paused, reason = '0', ''
  end
  cursor = old[3] == spec_key and old[6] or ARGV[6]
  if old[2] == def and old[7] == source and paused == old[4] and reason == (old[5] or '') then
    audit(KEYS[4], ARGV[12], ARGV[13], 'schedule_put', '', queue, ts, name)
    return {'unchanged', old[1]}
  end
  outcome = 'updated'
end
call('HSET', h, 'queue', queue, 'task_type', ARGV[3], 'definition', def, 'spec_key', spec_key,
  'cursor', cursor, 'source', source, 'paused', paused, 'paused_reason', reason,
  'overlap', ARGV[14], 'updated_at', ts)
local score = '+inf'
if paused ~= '1' and cursor ~= '' then score = cursor end
call('ZADD', index, score, name)
if KEYS[5] then call('SADD', KEYS[5], queue) end
local rev = call('HINCRBY', h, 'rev', 1)
call('LPUSH', khist, cjson.encode({ts = ts, decision = outcome, source = source}))
call('LTRIM', khist, 0, tonumber(ARGV[9]) - 1)
emit(ARGV[10], ARGV[11], ts, 'CONFIGURATION_CHANGED', cjson.null, queue, cjson.null, 0, nil,
  {schedule = name, change = outcome})
audit(KEYS[4], ARGV[12], ARGV[13], 'schedule_put', '', queue, ts, name)
return {outcome, tostring(rev)}
