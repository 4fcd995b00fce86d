-- fire.lua: one schedule's firing (docs/schedules.md): the decision for each tick the caller
-- planned, the enqueue of the ticks that fire and the advance of the schedule's cursor, in one
-- atomic call. dtq/scripts.py prepends submit.lua to this script as the function
-- run_submit(KEYS, ARGV), so a tick's task is made by exactly the code of a submit (admission,
-- idempotency, expiry index, TASK_QUEUED), one task per call of it.
--
-- Exactly once per tick: the caller read the schedule's hash (its `rev`) and planned from it;
-- a call whose rev is not the hash's any more does nothing and replies {'stale', rev} (another
-- process fired, or the schedule changed: the caller reads again). And each tick's task has the
-- idempotency key schedule:<name>:<tick ms> (a manual firing's: schedule:<name>:manual:<...>),
-- so a tick submitted again whatever the cursor says is a duplicate, never a second task.
--
-- KEYS[1] = the schedule's hash   KEYS[2] = its history   KEYS[3] = the schedule index
-- KEYS[4] = the hash of the task of its last firing (placeholder when none)
-- KEYS[5] = the audit stream (a manual firing with an actor writes an entry)
-- KEYS[6 ..] = a submit.lua call's KEYS for the candidates' tasks, all of the schedule's queue:
--   KEYS[6 .. 21] the 3 shared keys, the queue's 10 streams and its 3 fairness keys,
--   KEYS[22 + 3i .. 24 + 3i] the keys of candidate i, KEYS[22 + 3n] the queue's last_submit,
--   KEYS[23 + 3n] dtq:queues (flat
--   layout only)
-- ARGV[1] name   [2] the rev the caller read   [3] mode: "tick" (the firer) | "trigger" (manual)
-- ARGV[4] the cursor after the planned ticks ("" = no tick left: the schedule ended; tick mode)
-- ARGV[5] missed ticks before the first candidate (not fired: catch-up policy)  [6] the first
--   missed tick (ms) or ""  [7] the last or ""  [8] "1" when the count was capped
-- ARGV[9] history cap   [10] n, the number of candidates   [11] event id of SCHEDULE_SKIPPED
--   for the missed ticks   [12] how often (ms) a buffered firing looks at its previous task
-- ARGV[13] audit actor ("" = none)  [14] audit request id
-- ARGV[15 + 3i .. 17 + 3i], candidate i: tick (epoch ms), kind ("tick" | "buffered" |
--   "trigger"), event id of its SCHEDULE_FIRED / SCHEDULE_SKIPPED
-- ARGV[15 + 3n ..] = the submit.lua call's ARGV for the candidates' tasks (one queue), in order
--
-- Each "tick" candidate is decided against the overlap policy when the previous firing's task
-- is not terminal: skip (SCHEDULE_SKIPPED, reason overlap), allow (fires), buffer_one (kept
-- in `buffered_ms`, fired by a later call as a "buffered" candidate once that task ended; a
-- second one while one is buffered is skipped). A "trigger" candidate always fires and leaves
-- the cursor as it is. A candidate the submit refuses (QUEUE_FULL) stops the call there: the
-- cursor stays at that tick, to be tried again (the caller backs off).
--
-- Returns {'gone'} (no such schedule: its index member is removed), {'stale', rev},
--         {'paused'} (tick mode on a paused schedule: nothing fires), or
--         {'ok', rev, index score, cursor, {tick, decision, task_id, detail} per candidate}
-- decision: fired | duplicate (the tick's task exists) | skipped_overlap | buffered | waiting
--   (a buffered firing whose previous task still runs) | rejected (detail: code and message)
local call = redis.call
local h, khist, index = KEYS[1], KEYS[2], KEYS[3]
local name = ARGV[1]
local st = call('HMGET', h, 'rev', 'paused', 'overlap', 'last_task_id', 'buffered_ms', 'cursor',
  'queue', 'task_type')
if not st[1] then  -- every schedule hash has a rev: there is no such schedule
  call('ZREM', index, name)
  return {'gone'}
end
if st[1] ~= ARGV[2] then return {'stale', st[1]} end
local mode = ARGV[3]
local paused = st[2] == '1'
if paused and mode == 'tick' then return {'paused'} end
local overlap, prev, buffered = st[3], st[4] or '', st[5] or ''
local queue, task_type = st[7], st[8]

local now = now_ms()
local ts = iso(now)
local n = tonumber(ARGV[10])
local sub = 15 + 3 * n  -- where the submit ARGV starts
local channel = ARGV[sub + 3]
local hist_cap = tonumber(ARGV[9])

local prev_running = false
if prev ~= '' then
  local s = call('HGET', KEYS[4], 'status')
  prev_running = s == 'pending' or s == 'queued' or s == 'running' or s == 'retrying'
end

local entries = {}
local function decided(e)
  e.ts = ts
  entries[#entries + 1] = cjson.encode(e)
end

-- Candidate i's task through submit.lua's code: its keys and ARGV as a one-task submit call.
local function submit_candidate(i)
  local k, a = {}, {}
  for j = 6, 21 do k[#k + 1] = KEYS[j] end
  for j = 0, 2 do k[#k + 1] = KEYS[22 + 3 * i + j] end
  k[#k + 1] = KEYS[22 + 3 * n]
  if KEYS[23 + 3 * n] then k[#k + 1] = KEYS[23 + 3 * n] end
  for j = 0, 5 do a[#a + 1] = ARGV[sub + j] end
  local t = sub + 6 + 15 * i
  for j = 0, 14 do a[#a + 1] = ARGV[t + j] end
  a[#a + 1] = ARGV[sub + 6 + 15 * n]
  local out = run_submit(k, a)
  if out.err then error(out) end  -- READONLY (a demoted primary): the whole call fails
  return out[1], ARGV[t]
end

local missed = tonumber(ARGV[5])
if missed > 0 then
  local capped = ARGV[8] == '1'
  decided({decision = 'missed', count = missed, capped = capped or nil,
    first = iso(tonumber(ARGV[6])), last = iso(tonumber(ARGV[7]))})
  call('HINCRBY', h, 'missed', missed)
  emit(channel, ARGV[11], ts, 'SCHEDULE_SKIPPED', cjson.null, queue, task_type, 0, nil,
    {schedule = name, reason = 'missed', count = missed, capped = capped or nil,
     first = iso(tonumber(ARGV[6])), last = iso(tonumber(ARGV[7]))})
end

local results = {}
local stop = nil  -- the tick a refused candidate leaves the cursor at
local fired, skipped = 0, 0
local last_tick = nil
local error_detail = ''
for i = 0, n - 1 do
  local tick, kind, evid = tonumber(ARGV[15 + 3 * i]), ARGV[16 + 3 * i], ARGV[17 + 3 * i]
  if kind == 'tick' and tick > now then
    stop = tick  -- not due yet by this server's clock: left for a later call
    break
  end
  local decision, task_id, detail = 'fire', '', ''
  if kind == 'buffered' then
    if tostring(tick) ~= buffered then
      decision = 'none'
    elseif prev_running then
      decision = 'waiting'
    end
  elseif kind == 'tick' and prev_running and overlap ~= 'allow' then
    if overlap == 'buffer_one' and buffered == '' then
      decision, buffered = 'buffered', tostring(tick)
    else
      decision = 'skipped_overlap'
    end
  end
  if decision == 'fire' then
    local r, tid = submit_candidate(i)
    if r[1] == 'new' then
      decision, task_id, detail = 'fired', tid, tostring(now - tick)
      prev, prev_running = tid, r[2] ~= 'expired'
    elseif r[1] == 'dup' or r[2] == 'IDEMPOTENCY_IN_PROGRESS' then
      -- the firing's task exists (its key's record: a replay, or a second trigger of one key)
      local running = r[1] == 'err' or r[2] == 'processing'
      decision, task_id = 'duplicate', r[3]
      if r[3] == prev or prev == '' then prev, prev_running = r[3], running end
    else
      decision, detail = 'rejected', r[2] .. ': ' .. tostring(r[3])
      error_detail = detail
      results[#results + 1] = {tostring(tick), decision, '', detail}
      if kind == 'tick' then stop = tick end
      break
    end
    if kind == 'buffered' then buffered = '' end
  end
  if decision == 'fired' then
    fired = fired + 1
    local meta = {schedule = name, scheduled_for = iso(tick), lag_ms = now - tick}
    if kind == 'trigger' then meta.trigger = 'manual' end
    if kind == 'buffered' then meta.buffered = true end
    emit(channel, evid, ts, 'SCHEDULE_FIRED', task_id, queue, task_type, 0, nil, meta)
    decided({decision = kind == 'trigger' and 'triggered' or 'fired', tick = iso(tick),
      task_id = task_id, lag_ms = now - tick})
  elseif decision == 'skipped_overlap' then
    skipped = skipped + 1
    emit(channel, evid, ts, 'SCHEDULE_SKIPPED', cjson.null, queue, task_type, 0, nil,
      {schedule = name, reason = 'overlap', scheduled_for = iso(tick), running_task_id = prev})
    decided({decision = 'skipped_overlap', tick = iso(tick), running_task_id = prev})
  elseif decision == 'buffered' then
    decided({decision = 'buffered', tick = iso(tick), running_task_id = prev})
  end
  if kind == 'tick' then last_tick = tick end
  results[#results + 1] = {tostring(tick), decision, task_id, detail}
end

local cursor = st[6] or ''
if mode == 'tick' then
  cursor = stop and tostring(stop) or ARGV[4]
end
local poll = now + tonumber(ARGV[12])
local score
if stop and error_detail ~= '' then
  score = poll  -- a refused tick is tried again after a pause, not at once
elseif paused then
  score = '+inf'
elseif cursor == '' then
  score = buffered ~= '' and poll or '+inf'
else
  score = tonumber(cursor)
  if buffered ~= '' and poll < score then score = poll end
end
call('ZADD', index, score, name)
local fields = {'cursor', cursor, 'buffered_ms', buffered, 'last_task_id', prev,
  'last_error', error_detail}
if last_tick then
  fields[#fields + 1] = 'last_tick_ms'
  fields[#fields + 1] = last_tick
end
if fired > 0 then
  fields[#fields + 1] = 'last_fired_at'
  fields[#fields + 1] = ts
  call('HINCRBY', h, 'fired', fired)
end
if skipped > 0 then call('HINCRBY', h, 'skipped_overlap', skipped) end
call('HSET', h, unpack(fields))
local rev = call('HINCRBY', h, 'rev', 1)
if mode == 'trigger' then
  audit(KEYS[5], ARGV[13], ARGV[14], 'schedule_trigger', results[1] and results[1][3] or '',
    queue, ts, name)
end
if #entries > 0 then
  -- newest first; the list keeps the hist_cap latest decisions
  call('LPUSH', khist, unpack(entries))
  call('LTRIM', khist, 0, hist_cap - 1)
end
return {'ok', tostring(rev), tostring(score), cursor, unpack(results)}
