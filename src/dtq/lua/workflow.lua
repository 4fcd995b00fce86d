-- workflow.lua: every change of a workflow's state (docs/workflows.md), one atomic step each.
-- A workflow's state is two hashes in its home queue's slot (its id is made for that slot):
--   dtq:workflow:<wid>        status (running|succeeded|failed|cancelled|expired), created_at,
--                             updated_at, finished_at (epoch ms), total, done (nodes ended),
--                             home (queue), cancel_requested ("1"), unhandled (the worst end
--                             nothing handled: failed, dead_lettered, expired or cancelled), metadata (JSON),
--                             names (JSON list of the node names, in the order given)
--   dtq:workflow:<wid>:nodes  per node N: N:st (waiting, released, skipped, or the end of its
--                             task: succeeded failed dead_lettered cancelled expired), N:left
--                             (dependencies not yet ended in a way their edge allows), N:kids
--                             (JSON [[child, policy]]), N:after (JSON [[parent, policy, task]]),
--                             N:task (its task id, made at submit), N:queue, N:type, N:req (the
--                             task's submit fields, JSON), N:err (JSON {class, message}, for a
--                             node the workflow ended itself)
-- Both have no TTL while the workflow runs and DTQ_TASK_RETENTION_S from its end.
--
-- A node becomes released when its last dependency ends (its counter reaches 0): the caller
-- then submits its task (idempotency key dtq-wf:<wid>:<node>, so a repeated release is
-- absorbed). The scripts that end a node's task append that end to its queue's outbox
-- (dtq:wfbox:<queue>, retain in _lib); the workers relay each entry to op "end" here.
--
-- KEYS[1] = dtq:workflow:<wid>   KEYS[2] = dtq:workflow:<wid>:nodes
-- KEYS[3] = the home queue's outbox (create: the release entry)   KEYS[4] = dtq:audit (create,
--   cancel: written when an actor is given)
-- ARGV[1] op  [2] workflow id  [3] events channel  [4] event id  [5] retention s
-- op "create": [6] metadata JSON  [7] nodes JSON [{name, task, queue, type, req, after: [[p, policy]]}]
--   [8] actor  [9] request id.  Returns {outbox entry id}.
-- op "end": [6] node  [7] status  [8] error class  [9] error message
-- op "released": nothing more.
-- op "cancel": [6] actor  [7] request id.
-- "end", "released" and "cancel" return {status, released, succeeded, running}:
--   released = flat {name, task id, queue, req, ...} of the nodes to submit: the ones this
--   step released, or, when it changed nothing (a repeated end, op "released"), every released
--   node; succeeded = the task ids of the succeeded nodes once the workflow has ended (their
--   results get their retention then); running = (cancel) flat {task id, node} of the
--   released nodes.
--   {"gone"} when the workflow's hashes are gone.
local op, wid, channel, event_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local retention = tonumber(ARGV[5])
local KW, KN = KEYS[1], KEYS[2]
local now = now_ms()

local function hset_many(key, flat)
  for i = 1, #flat, 1000 do
    redis.call('HSET', key, unpack(flat, i, math.min(i + 999, #flat)))
  end
end

if op == 'create' then
  local nodes = cjson.decode(ARGV[7])
  local flat, kids, names = {}, {}, {}
  for _, n in ipairs(nodes) do
    kids[n.name] = {}
    names[#names + 1] = n.name
  end
  local tasks = {}
  for _, n in ipairs(nodes) do tasks[n.name] = n.task end
  for _, n in ipairs(nodes) do
    local after = {}
    for _, e in ipairs(n.after) do
      local k = kids[e[1]]
      k[#k + 1] = {n.name, e[2]}
      after[#after + 1] = {e[1], e[2], tasks[e[1]]}
    end
    local p = n.name .. ':'
    local left = #n.after
    local nf = {p .. 'st', left == 0 and 'released' or 'waiting', p .. 'left', left,
      p .. 'after', cjson.encode(after), p .. 'task', n.task, p .. 'queue', n.queue,
      p .. 'type', n.type, p .. 'req', n.req}
    for _, v in ipairs(nf) do flat[#flat + 1] = v end
  end
  for _, n in ipairs(nodes) do
    flat[#flat + 1] = n.name .. ':kids'
    -- cjson encodes an empty table as {}: a node without children says [] itself.
    flat[#flat + 1] = #kids[n.name] == 0 and '[]' or cjson.encode(kids[n.name])
  end
  hset_many(KN, flat)
  redis.call('HSET', KW, 'status', 'running', 'created_at', now, 'updated_at', now,
    'total', #nodes, 'done', 0, 'home', nodes[1].queue, 'metadata', ARGV[6],
    'names', cjson.encode(names))
  local entry = redis.call('XADD', KEYS[3], '*', 'kind', 'release', 'workflow_id', wid)
  audit(KEYS[4], ARGV[8], ARGV[9], 'workflow_submit', wid, nodes[1].queue, iso(now))
  emit(channel, event_id, iso(now), 'WORKFLOW_SUBMITTED', cjson.null, nodes[1].queue, cjson.null, 0, nil,
    {workflow_id = wid, status = 'running', nodes = #nodes})
  return {entry}
end

local wf = redis.call('HMGET', KW, 'status', 'cancel_requested', 'home', 'total')
if not wf[1] then return {'gone'} end
local status, cancel_requested, home = wf[1], wf[2] == '1', wf[3]

local RANK = {cancelled = 1, expired = 2, failed = 3, dead_lettered = 3}
local released, changed = {}, false

local function field(n, f) return redis.call('HGET', KN, n .. ':' .. f) end

local function unhandled(s)
  local cur = redis.call('HGET', KW, 'unhandled')
  if (RANK[s] or 0) > (RANK[cur] or 0) then redis.call('HSET', KW, 'unhandled', s) end
end

local function release(n)
  redis.call('HSET', KN, n .. ':st', 'released')
  released[#released + 1] = n
end

-- End node `name` as `s` (with an error when the workflow ended it), then each dependent
-- follows its edge's policy; a dependent ended here is ended the same way (a worklist, not
-- recursion: a chain of 10,000 nodes).
local function finish(name, s, err_class, err_message)
  local work = {{name, s, err_class, err_message}}
  while #work > 0 do
    local item = table.remove(work)
    local n, st = item[1], item[2]
    local cur = field(n, 'st')
    if cur == 'waiting' or cur == 'released' then
      changed = true
      redis.call('HSET', KN, n .. ':st', st)
      if item[3] and item[3] ~= '' then
        redis.call('HSET', KN, n .. ':err', cjson.encode({class = item[3], message = item[4]}))
      end
      redis.call('HINCRBY', KW, 'done', 1)
      local ok, skipped = st == 'succeeded', st == 'skipped'
      local kids = cjson.decode(field(n, 'kids'))
      if not ok and not skipped and #kids == 0 then unhandled(st) end
      for _, k in ipairs(kids) do
        local kid, policy = k[1], k[2]
        if ok or policy == 'continue' then
          local left = redis.call('HINCRBY', KN, kid .. ':left', -1)
          if left <= 0 and field(kid, 'st') == 'waiting' then
            if cancel_requested then
              work[#work + 1] = {kid, 'cancelled', 'WorkflowCancelled', 'the workflow was cancelled'}
            else
              release(kid)
            end
          end
        elseif skipped or policy == 'skip' then
          work[#work + 1] = {kid, 'skipped', 'DependencySkipped',
            'dependency ' .. n .. ' ended ' .. st}
        else
          unhandled(st)
          work[#work + 1] = {kid, 'cancelled', 'DependencyFailed',
            'dependency ' .. n .. ' ended ' .. st}
        end
      end
    end
  end
end

local function all_names() return cjson.decode(redis.call('HGET', KW, 'names')) end

-- The st field of every node, with its name and task id: HMGET in pages.
local function each_node(fn)
  local names = all_names()
  for i = 1, #names, 500 do
    local fields = {}
    for j = i, math.min(i + 499, #names) do
      fields[#fields + 1] = names[j] .. ':st'
      fields[#fields + 1] = names[j] .. ':task'
    end
    local vals = redis.call('HMGET', KN, unpack(fields))
    for j = 1, #vals, 2 do fn(names[i + (j - 1) / 2], vals[j], vals[j + 1]) end
  end
end

local function released_reply(list)
  local out = {}
  for _, n in ipairs(list) do
    local v = redis.call('HMGET', KN, n .. ':task', n .. ':queue', n .. ':req')
    out[#out + 1] = n
    out[#out + 1] = v[1]
    out[#out + 1] = v[2]
    out[#out + 1] = v[3]
  end
  return out
end

local function maybe_end()
  if status ~= 'running' then return end
  local w = redis.call('HMGET', KW, 'done', 'total', 'unhandled')
  if tonumber(w[1]) < tonumber(w[2]) then return end
  local u = w[3]
  if cancel_requested then status = 'cancelled'
  elseif u == 'dead_lettered' then status = 'failed'
  elseif u then status = u
  else status = 'succeeded' end
  redis.call('HSET', KW, 'status', status, 'finished_at', now)
  redis.call('EXPIRE', KW, retention)
  redis.call('EXPIRE', KN, retention)
  emit(channel, event_id, iso(now), 'WORKFLOW_' .. string.upper(status), cjson.null, home, cjson.null, 0, nil,
    {workflow_id = wid, status = status})
end

local function reply(running)
  if changed then redis.call('HSET', KW, 'updated_at', now) end
  local succeeded = {}
  if status ~= 'running' then
    each_node(function(_, st, task) if st == 'succeeded' then succeeded[#succeeded + 1] = task end end)
  end
  return {status, released_reply(released), succeeded, running or {}}
end

if op == 'end' then
  finish(ARGV[6], ARGV[7], ARGV[8], ARGV[9])
  if not changed then
    -- A repeated end (the relay crashed before it submitted what this end released): every
    -- released node is submitted again; their idempotency keys absorb the ones already in.
    each_node(function(n, st) if st == 'released' then released[#released + 1] = n end end)
  end
  maybe_end()
  return reply()
end

if op == 'released' then
  each_node(function(n, st) if st == 'released' then released[#released + 1] = n end end)
  return reply()
end

if op == 'cancel' then
  local running = {}
  if status == 'running' then
    if not cancel_requested then
      cancel_requested = true
      changed = true
      redis.call('HSET', KW, 'cancel_requested', '1')
      audit(KEYS[4], ARGV[6], ARGV[7], 'workflow_cancel', wid, home, iso(now))
    end
    local waiting = {}
    each_node(function(n, st, task)
      if st == 'waiting' then waiting[#waiting + 1] = n
      elseif st == 'released' then
        running[#running + 1] = task
        running[#running + 1] = n
      end
    end)
    for _, n in ipairs(waiting) do
      finish(n, 'cancelled', 'WorkflowCancelled', 'the workflow was cancelled')
    end
    maybe_end()
  end
  return reply(running)
end

return redis.error_reply('ERR unknown workflow op ' .. tostring(op))
