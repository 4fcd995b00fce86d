-- limit_sweep.lua: give back the places of a concurrency limit that no running task holds
-- (docs/limits.md, "Places that nothing holds"). A place is a task id in the limit's running
-- set; start.lua takes it and sets RUNNING in one call, and finish.lua (or start.lua, for a
-- redelivered task that ends there) gives it back and leaves RUNNING in one call, so a member
-- whose task is RUNNING is a live place and is never touched. A member whose task hash is gone
-- (deleted by hand, or expired after the task ended) or is in any other status was left by an
-- end that no longer named the limit (it was deleted or narrowed while its task's worker was
-- dead): it is removed, and for each place freed the first waiter is made due (limit_promote
-- in _lib), as a finish would.
--
-- KEYS[1] = the limit's running set (<prefix>:running)
-- KEYS[2] = its waiting set (<prefix>:waiting)
-- KEYS[3] = the retry schedule of the limit's queue
-- KEYS[3 + i] = dtq:task:<id> of the i-th candidate
-- ARGV[i] = the i-th candidate's task id (a member of the running set read before this call)
-- Returns the task ids whose places it removed (how many: the reply's length)
local removed = {}
local now = nil
for i = 1, #ARGV do
  local id = ARGV[i]
  if redis.call('HGET', KEYS[3 + i], 'status') ~= 'running'
      and redis.call('ZREM', KEYS[1], id) == 1 then
    removed[#removed + 1] = id
    now = now or now_ms()
    limit_promote(KEYS[2], KEYS[3], now)
  end
end
return removed
