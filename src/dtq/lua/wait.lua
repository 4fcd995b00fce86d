-- wait.lua: a producer starts waiting for tasks to end (Queue.wait, wait_many, as_completed;
-- docs/sdk.md "Waiting for a task"). For each task: unknown (no hash: never existed, or its
-- retention ran out) -> 0; already terminal -> 1; else the hash gets `waited` = 1, so that
-- the script that makes it terminal pushes the end to dtq:task:<id>:done (retain in _lib), and
-- -> 2. The check and the registration are one step, so no end can fall between them: the
-- waiter then blocks with XREAD on the done stream from id 0, which returns at once if the
-- entry is already there.
--
-- A done stream left from an earlier end of a task that is not terminal any more (a dead
-- letter requeued) is deleted here, so that it does not wake the new waiter at once.
--
-- KEYS[2i - 1] = dtq:task:<id_i>   KEYS[2i] = dtq:task:<id_i>:done
-- Returns one integer per task, in order.
local terminal = {succeeded = true, failed = true, dead_lettered = true, cancelled = true,
  expired = true}
local out = {}
for i = 1, #KEYS / 2 do
  local hash, done = KEYS[2 * i - 1], KEYS[2 * i]
  local status = redis.call('HGET', hash, 'status')
  if not status then
    out[i] = 0
  elseif terminal[status] then
    out[i] = 1
  else
    redis.call('HSET', hash, 'waited', '1')
    redis.call('DEL', done)
    out[i] = 2
  end
end
return out
