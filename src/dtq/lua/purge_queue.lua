-- purge_queue.lua: one chunk of `dtq purge --queue Q` (DESIGN 10): cancel tasks of the queue
-- that have not started. The caller finds candidates (members of dtq:retry:schedule and
-- dtq:retry:claimed that belong to the queue, then entries of the queue's streams) and sends
-- at most 100 per call, so no call runs long. For each one this script re-reads the hash:
--   * pending / queued / retrying, this queue, metadata still what the caller read: CANCELLED
--     with the caller's metadata (purged = true), schedule/claim/expiry members removed, its
--     live entry XDELed (an entry already delivered to a consumer stays for that consumer's
--     start script, and the id goes to dtq:cancelled, as in cancel.lua), idempotency state
--     failed, history reason "purge", TASK_CANCELLED with metadata {from, purged};
--   * metadata changed since the caller read it: left as is, its id returned as stale;
--   * running or finished, or another queue's: untouched;
--   * hash gone (deleted outside dtq, or expired under an older dtq, which gave waiting tasks a
--     TTL): its orphan entry or members are removed.
-- The first chunk carries the actor: the operation's one audit entry "purge" is atomic with it.
--
-- KEYS[1] = dtq:retry:schedule   KEYS[2] = dtq:retry:claimed   KEYS[3] = dtq:expiry
-- KEYS[4] = dtq:cancelled   KEYS[5] = dtq:stream:audit   KEYS[6..15] = dtq:stream:<queue>:p9..p0
-- KEYS[16] = the queue's held zset (tasks held by fairness: docs/limits.md)
-- KEYS[17] = the queue's workflow outbox (a workflow node's end: retain in _lib)
-- KEYS[18 + 5i .. 22 + 5i] = dtq:task:<id_i>, its :history, its idempotency record key,
--   its :payload (an older dtq's payload key: own_payload in _lib), its :done (retain in _lib)
-- ARGV[1] queue  [2] task retention s  [3] idempotency TTL s  [4] events channel
-- ARGV[5] audit actor ("" = no audit entry)  [6] audit request_id or ""
-- ARGV[7 + 6i .. 12 + 6i] = task_id, stream entry id seen ("" for a schedule member), its
--   priority band ("" likewise), event_id, metadata JSON read by the caller, new metadata JSON
-- Returns {cancelled count, stale task ids...}
local queue = ARGV[1]
local retention = tonumber(ARGV[2])
local ts = iso(now_ms())
local cancelled = 0
local stale = {}
local n = (#ARGV - 6) / 6

local function band_stream(band) return KEYS[6 + (9 - tonumber(band))] end

for i = 0, n - 1 do
  local a = 7 + 6 * i
  local task_id, seen, band, event_id = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local kh, khist, kidem = KEYS[18 + 5 * i], KEYS[19 + 5 * i], KEYS[20 + 5 * i]
  local kpayload, kdone = KEYS[21 + 5 * i], KEYS[22 + 5 * i]
  local h = redis.call('HMGET', kh, 'status', 'entry_id', 'queue', 'task_type', 'attempt',
    'idempotency_key', 'metadata', 'priority')
  local status = h[1]
  if not status then
    if seen ~= '' then drop_entry(band_stream(band), 'workers', seen) end
    redis.call('ZREM', KEYS[1], task_id)
    redis.call('ZREM', KEYS[2], task_id)
    redis.call('ZREM', KEYS[3], task_id)
    redis.call('ZREM', KEYS[16], task_id)
  elseif h[3] == queue and (status == 'pending' or status == 'queued' or status == 'retrying') then
    if (h[7] or '') ~= ARGV[a + 4] then
      stale[#stale + 1] = task_id
    else
      redis.call('HSET', kh, 'status', 'cancelled', 'updated_at', ts, 'finished_at', ts,
        'metadata', ARGV[a + 5])
      retain(kh, kpayload, retention, kdone, KEYS[17])
      redis.call('ZREM', KEYS[1], task_id)
      redis.call('ZREM', KEYS[2], task_id)
      redis.call('ZREM', KEYS[3], task_id)
      if status == 'queued' then
        if not drop_entry(band_stream(h[8]), 'workers', h[2]) then
          redis.call('SADD', KEYS[4], task_id)
        end
        redis.call('ZREM', KEYS[16], task_id)
      end
      if seen ~= '' and seen ~= h[2] then drop_entry(band_stream(band), 'workers', seen) end
      idem_state(kidem, h[6], task_id, 'failed', ts, ARGV[3])
      hist(khist, retention, ts, status, 'cancelled', h[5], nil, 'purge')
      emit(ARGV[4], event_id, ts, 'TASK_CANCELLED', task_id, queue, h[4], h[5], nil,
        {from = status, purged = true})
      cancelled = cancelled + 1
    end
  end
end
audit(KEYS[5], ARGV[5], ARGV[6], 'purge', '', queue, ts)
local out = {cancelled}
for _, tid in ipairs(stale) do out[#out + 1] = tid end
return out
