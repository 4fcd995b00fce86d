-- claim_due.lua: the scheduler's claim step (contract section 4, DESIGN 3).
-- First, claims older than the stale age (a scheduler that died between claim and promote)
-- go back to the schedule, due at once. Then at most `limit` due members (score <= Redis TIME)
-- move from the schedule to the claimed set, scored with the claim time. The caller promotes
-- each claimed task with promote.lua, which removes the claim.
--
-- KEYS[1] = dtq:retry:schedule   KEYS[2] = dtq:retry:claimed
-- ARGV[1] limit (at most 100)    ARGV[2] stale age in ms (DTQ_CLAIM_STALE_S * 1000)
-- Returns {{task_id, ...} claimed now, number of stale claims returned, now_ms}
local limit = tonumber(ARGV[1])
local now = now_ms()

local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[2]),
  'LIMIT', 0, limit)
if #stale > 0 then
  local back = {}
  for i, id in ipairs(stale) do
    back[2 * i - 1] = now
    back[2 * i] = id
  end
  redis.call('ZADD', KEYS[1], unpack(back))
  redis.call('ZREM', KEYS[2], unpack(stale))
end

local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, limit)
if #due > 0 then
  local claim = {}
  for i, id in ipairs(due) do
    claim[2 * i - 1] = now
    claim[2 * i] = id
  end
  redis.call('ZADD', KEYS[2], unpack(claim))
  redis.call('ZREM', KEYS[1], unpack(due))
end
return {due, #stale, now}
