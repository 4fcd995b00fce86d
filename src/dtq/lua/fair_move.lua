-- fair_move.lua: move held tasks of a fair queue into its streams, in turn (docs/limits.md,
-- "Fairness across keys"). A worker calls it after each start batch of the queue and once a
-- second, with the held zset's first members as it read them just before: each is moved only
-- while it is still the lowest score (the next in turn) and while fewer than FAIR_WINDOW
-- entries are unread in the queue's streams. A member that is not the head any more (a new
-- key's first task came before it) stops the call ("stale"): the caller reads the head again.
-- A moved task gets its stream entry (the fields submit.lua gives one), its hash the entry id
-- (its `fair_key` goes); its status stays QUEUED and nothing is published (the task was queued
-- at its submit). A member whose hash is no longer a held QUEUED task (cancelled or expired:
-- those scripts remove the member themselves; deleted by hand) is dropped.
-- Each move records its round as the band's last served one and prunes the rounds zset of
-- rounds already served; when nothing is held any more, the rounds zset goes.
--
-- KEYS[1] = the queue's fairness hash   KEYS[2] = its held zset   KEYS[3] = its rounds zset
-- KEYS[4 .. 13] = dtq:stream:<queue>:p9 .. p0
-- KEYS[14 + 2i], KEYS[15 + 2i] (i = 0 .. n-1) = dtq:task:<id_i>, its :payload (an older dtq's
--   payload key: task_payload in _lib)
-- ARGV[1 + i] (i = 1 .. n) = the task ids, in the held zset's order as the caller read it
-- Returns {moved, held left, stale (1 | 0)}
local call = redis.call
local room = FAIR_WINDOW - fair_unread(KEYS, 4)
local moved, stale = 0, 0

for i = 1, #ARGV do
  if room <= 0 then break end
  local head = call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if head[1] ~= ARGV[i] then
    stale = 1
    break
  end
  call('ZREM', KEYS[2], head[1])
  local hk = KEYS[12 + 2 * i]
  local h = call('HMGET', hk, 'status', 'entry_id', 'queue', 'task_type', 'attempt',
    'max_attempts', 'priority', 'timeout_ms', 'idempotency_key')
  local score = tonumber(head[2])
  local band = math.floor(score / FAIR_BAND)
  if h[1] == 'queued' and (h[2] == false or h[2] == '') then
    local stream = KEYS[4 + 9 - (tonumber(h[7]) or 5)]
    if call('EXISTS', stream) == 0 then
      for k = 4, 13 do  -- the group on every stream of the queue, as submit.lua makes them
        if call('EXISTS', KEYS[k]) == 0 then
          call('XGROUP', 'CREATE', KEYS[k], 'workers', '0', 'MKSTREAM')
        end
      end
    end
    local entry_id = call('XADD', stream, '*', 'task_id', ARGV[i], 'queue', h[3],
      'task_type', h[4], 'payload', task_payload(hk, KEYS[13 + 2 * i]),
      'attempt', (tonumber(h[5]) or 0) + 1, 'max_attempts', h[6], 'priority', h[7],
      'timeout_ms', h[8], 'idempotency_key', h[9] or '')
    call('HSET', hk, 'entry_id', entry_id)
    call('HDEL', hk, 'fair_key')
    moved = moved + 1
    room = room - 1
  end
  local base = band * FAIR_BAND
  local round = score - base
  if round > (tonumber(call('HGET', KEYS[1], 'r' .. band)) or 0) then
    call('HSET', KEYS[1], 'r' .. band, string.format('%.0f', round))
    call('ZREMRANGEBYSCORE', KEYS[3], string.format('%.0f', base),
      '(' .. string.format('%.0f', score))
  end
end

local left = call('ZCARD', KEYS[2])
if left == 0 then call('DEL', KEYS[3]) end
return {moved, left, stale}
