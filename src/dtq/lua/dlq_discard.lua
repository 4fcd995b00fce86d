-- dlq_discard.lua: drop a dead-lettered task from the DLQ stream, never the task itself
-- (contract section 11). The entry is XDELed; the hash stays DEAD_LETTERED, with metadata
-- (built by the caller: discarded = true) set only if the old metadata is still what the
-- caller read (compare-and-set), and a history entry dead_lettered -> dead_lettered.
--
-- KEYS[1] = dtq:task:<id>   KEYS[2] = dtq:task:<id>:history   KEYS[3] = dtq:stream:dead-letter
-- KEYS[4] = dtq:stream:audit
-- KEYS[5] = dtq:task:<id>:payload (an older dtq's payload key: own_payload in _lib)
-- ARGV[1] task_id  [2] metadata JSON read by the caller  [3] new metadata JSON
-- ARGV[4] DLQ entry id found by scanning, "" (used when the hash has no dlq_entry_id)
-- ARGV[5] task retention s  [6] audit actor ("" = no audit entry)  [7] audit request_id or ""
-- Returns {"discarded", removed DLQ entries (0|1)}
--       | {"err", "NOT_FOUND"} | {"err", "STATUS", status} | {"err", "STALE"}
local task_id = ARGV[1]
local h = redis.call('HMGET', KEYS[1], 'status', 'metadata', 'dlq_entry_id', 'attempt', 'queue')
if not h[1] then return {'err', 'NOT_FOUND'} end
if h[1] ~= 'dead_lettered' then return {'err', 'STATUS', h[1]} end
if (h[2] or '') ~= ARGV[2] then return {'err', 'STALE'} end
local ts = iso(now_ms())
local retention = tonumber(ARGV[5])
local dlq_id = h[3]
if not dlq_id or dlq_id == '' then dlq_id = ARGV[4] end
local removed = 0
if dlq_id ~= '' then removed = redis.call('XDEL', KEYS[3], dlq_id) end
redis.call('HDEL', KEYS[1], 'dlq_entry_id')
redis.call('HSET', KEYS[1], 'metadata', ARGV[3], 'updated_at', ts)
retain(KEYS[1], KEYS[5], retention)
hist(KEYS[2], retention, ts, 'dead_lettered', 'dead_lettered', h[4], nil, 'dlq_discard',
  {dlq_entry_id = dlq_id})
audit(KEYS[4], ARGV[6], ARGV[7], 'dlq_discard', task_id, h[5], ts)
return {'discarded', removed}
