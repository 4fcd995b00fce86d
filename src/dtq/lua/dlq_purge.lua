-- dlq_purge.lua: one chunk of a DLQ purge (contract section 11: the DLQ trimmed to 0).
-- The caller reads the DLQ oldest first in chunks of at most 100 entries and sends each here:
-- every entry is XDELed, and its task's hash (when it is still DEAD_LETTERED, still names this
-- entry, and its metadata is what the caller read) gets the caller's metadata with
-- discarded = true and a history entry: a purge never destroys a task silently. The first
-- chunk carries the actor, so the one audit entry "dlq_purge" is atomic with the first removal
-- (an empty DLQ still gets its audit entry).
--
-- KEYS[1] = dtq:stream:dead-letter   KEYS[2] = dtq:stream:audit
-- KEYS[3 + 3i .. 5 + 3i] = dtq:task:<id_i>, its :history, its :payload (an older dtq's
--   payload key: own_payload in _lib)   (i = 0 .. n-1)
-- ARGV[1] audit actor ("" = no audit entry)  [2] audit request_id or ""  [3] task retention s
-- ARGV[4 + 4i .. 7 + 4i] = entry id, task_id, metadata JSON read by the caller,
--                          new metadata JSON ("" = leave the hash alone)
-- Returns {removed entries, marked hashes}
local retention = tonumber(ARGV[3])
local ts = iso(now_ms())
local removed, marked = 0, 0
local n = (#ARGV - 3) / 4
for i = 0, n - 1 do
  local a = 4 + 4 * i
  local entry_id, task_id, expect, meta = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local kh, khist, kpayload = KEYS[3 + 3 * i], KEYS[4 + 3 * i], KEYS[5 + 3 * i]
  removed = removed + redis.call('XDEL', KEYS[1], entry_id)
  if meta ~= '' then
    local h = redis.call('HMGET', kh, 'status', 'metadata', 'dlq_entry_id', 'attempt')
    if h[1] == 'dead_lettered' and (h[2] or '') == expect
        and (not h[3] or h[3] == '' or h[3] == entry_id) then
      redis.call('HDEL', kh, 'dlq_entry_id')
      redis.call('HSET', kh, 'metadata', meta, 'updated_at', ts)
      retain(kh, kpayload, retention)
      hist(khist, retention, ts, 'dead_lettered', 'dead_lettered', h[4], nil, 'dlq_purge',
        {dlq_entry_id = entry_id, task_id = task_id})
      marked = marked + 1
    end
  end
end
audit(KEYS[2], ARGV[1], ARGV[2], 'dlq_purge', '', '', ts)
return {removed, marked}
