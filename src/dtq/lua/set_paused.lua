-- set_paused.lua: pause or resume a queue (contract sections 2, 11; DESIGN 10).
-- Pause sets dtq:queue:<queue>:paused = "1" (and records the queue name in dtq:queues, so a
-- queue paused before its first task is listed); resume deletes it. Workers do not read a
-- paused queue's streams. Only a real change publishes CONFIGURATION_CHANGED with
-- metadata {queue, paused}; the audit entry (queue_pause / queue_resume) is written either way.
--
-- KEYS[1] = dtq:queue:<queue>:paused   KEYS[2] = dtq:stream:audit
-- KEYS[3] = dtq:queues, flat layout only (the cluster layout's caller adds it in its own call)
-- ARGV[1] queue  [2] "1" pause | "0" resume  [3] events channel  [4] event_id
-- ARGV[5] audit actor ("" = no audit entry)  [6] audit request_id or ""
-- Returns 1 when the state changed, 0 when it already was so
local queue = ARGV[1]
local pause = ARGV[2] == '1'
local changed
if pause then
  changed = redis.call('SET', KEYS[1], '1', 'NX') and true or false
  if KEYS[3] then redis.call('SADD', KEYS[3], queue) end
else
  changed = redis.call('DEL', KEYS[1]) == 1
end
local ts = iso(now_ms())
if changed then
  emit(ARGV[3], ARGV[4], ts, 'CONFIGURATION_CHANGED', cjson.null, queue, cjson.null, 0, nil,
    {queue = queue, paused = pause})
end
audit(KEYS[2], ARGV[5], ARGV[6], pause and 'queue_pause' or 'queue_resume', '', queue, ts)
return changed and 1 or 0
