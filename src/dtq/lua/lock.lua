-- lock.lua: the scheduler's leader lock (contract sections 2, 4, 6): SET NX PX, owner-checked.
-- Only the holder may refresh or release it, so a scheduler that lost the lock (it stalled past
-- the lock's PX and another took over) can never extend or delete the new leader's lock.
--
-- KEYS[1] = dtq:lock:scheduler
-- ARGV[1] op: "acquire" (take it if free, refresh it if ours) | "refresh" (only if ours)
--           | "release" (delete it, only if ours)
-- ARGV[2] owner (the worker_id)   ARGV[3] lock TTL in ms (10000)
-- Returns 1 when, after the call, the lock is ours (acquire, refresh) or was ours and is now
-- released (release); 0 otherwise.
local op, owner = ARGV[1], ARGV[2]
local holder = redis.call('GET', KEYS[1])
if op == 'release' then
  if holder == owner then
    redis.call('DEL', KEYS[1])
    return 1
  end
  return 0
end
if holder == owner then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
if op == 'acquire' and not holder then
  redis.call('SET', KEYS[1], owner, 'NX', 'PX', ARGV[3])
  return 1
end
return 0
