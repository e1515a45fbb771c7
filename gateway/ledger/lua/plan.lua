-- plan.lua: create the next batches of a job at its frontier cursor (lazy planning, K at a time where
-- the source is cheap to read ahead), and lease the first of them to the planner in the same step.
-- KEYS[1] job hash   KEYS[2] ready:0   KEYS[3] log   KEYS[4] leases   KEYS[5] planlock
-- KEYS[6..5+2K] batch:<seq>, items:<seq> pairs for seqs ARGV[1], ARGV[1]+1, ..., ARGV[1]+K-1
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] expected next_seq   ARGV[2] expected frontier (JSON)   ARGV[3] plan lock holder ('' = none)
-- ARGV[4] log maxlen   ARGV[5] budget total (batches)   ARGV[6] tolerated failure %
-- ARGV[7] lease token for the first batch ('' = plan only)   ARGV[8] its lease length (ms)
-- ARGV[9] concurrency   ARGV[10] K (>= 1)
-- ARGV[11..10+4K] per batch, in source order: end cursor (JSON, '' if the first stage will yield it),
--         '1' if the source is exhausted after it, items (JSON list, '' if the first stage fetches them),
--         item count. Batch i starts where batch i-1 ends (the first at ARGV[2]).
-- Returns {'ok', first seq, K} | {'ok', first seq, K, attempt, deadline_ms, start_cursor, end_cursor,
--         items, generation} (the first batch leased with ARGV[7]); every batch records the job's
--         generation (gen: how many re-plans from a cursor came before it) | {'exhausted'} | {'raced'}
--       | {'status', <job status>} | {'corrupt'}
-- Invariant: a batch's start cursor is recorded (and the frontier moved) before anyone can lease it;
-- a compare-and-set on next_seq and frontier keeps two planners from cutting the same range twice;
-- only a batch with an end cursor can be followed by another (a batch whose fetch stage yields its end
-- blocks the frontier); counters move by exactly the batches created (n_open + K). The plan lock is
-- released here if ARGV[3] still holds it, whatever the answer.
use_outbox(KEYS[#KEYS])
if ARGV[3] ~= '' and redis.call('GET', KEYS[5]) == ARGV[3] then redis.call('DEL', KEYS[5]) end
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'status', 'missing'} end
if job['status'] ~= 'running' then return {'status', job['status']} end
if job['next_seq'] ~= ARGV[1] or job['frontier'] ~= ARGV[2] or job['exhausted'] == '1'
    or job['blocked'] ~= '' then
  return {'raced'}
end
local now = now_ms()
local first = tonumber(ARGV[1])
local count = tonumber(ARGV[10])
if count < 1 or #KEYS ~= 6 + 2 * count or #ARGV ~= 10 + 4 * count then
  return redis.error_reply('plan.lua: K does not match the keys and batches passed')
end
-- the batches must chain: only the last may end the source or leave its end to the fetch stage
for i = 1, count - 1 do
  local a = 7 + 4 * i
  if ARGV[a] == '' or ARGV[a + 1] == '1' or tonumber(ARGV[a + 3]) == 0 then
    return redis.error_reply('plan.lua: only the last batch may be empty, exhaust or block')
  end
end
if count == 1 and tonumber(ARGV[14]) == 0 and ARGV[12] == '1' and ARGV[11] ~= '' then
  local chg = {exhausted = '1', updated_ms = int(now)}
  finish_changes(job, chg, now, ARGV[5], tonumber(ARGV[6]))
  save(KEYS[1], job, chg)
  log(KEYS[3], ARGV[4], {'event', 'source_exhausted', 'seq', ARGV[1]})
  return {'exhausted'}
end
local lease = ARGV[7] ~= '' and redis.call('ZCARD', KEYS[4]) < tonumber(ARGV[9])
local reply = {'ok', ARGV[1], int(count)}
local start = ARGV[2]
for i = 1, count do
  local a = 7 + 4 * i
  local seq = int(first + i - 1)
  local bkey, ikey = KEYS[4 + 2 * i], KEYS[5 + 2 * i]
  local fields = {seq = seq, status = 'pending', stage = '0', attempt = '0', start_cursor = start,
    end_cursor = ARGV[a], n_items = int(tonumber(ARGV[a + 3])), lease_token = '', deadline_ms = '',
    error = '', gen = job['gen'] or '0'}
  if ARGV[a + 2] ~= '' then redis.call('SET', ikey, ARGV[a + 2]) end
  if i == 1 and lease then
    local deadline = now + tonumber(ARGV[8])
    fields['status'] = 'leased'
    fields['attempt'] = '1'
    fields['lease_token'] = ARGV[7]
    fields['leased_ms'] = int(now)
    fields['deadline_ms'] = int(deadline)
    fields['st:0'] = 'running'
    redis.call('ZADD', KEYS[4], deadline, seq)
    for _, v in ipairs({'1', int(deadline), start, ARGV[a], ARGV[a + 2], fields['gen']}) do
      reply[#reply + 1] = v
    end
  else
    -- ready at now - K + i: in the past, and in seq order (equal scores would sort '10' before '2')
    redis.call('ZADD', KEYS[2], now - count + i, seq)
  end
  save(bkey, {}, fields)
  log(KEYS[3], ARGV[4], {'event', 'planned', 'seq', seq, 'items', fields['n_items'], 'cursor', start})
  if i == 1 and lease then
    log(KEYS[3], ARGV[4], {'event', 'stage_started', 'seq', seq, 'stage', '0', 'attempt', '1'})
  end
  start = ARGV[a]
end
local last = 7 + 4 * count
local planned_items = 0
for i = 1, count do planned_items = planned_items + tonumber(ARGV[7 + 4 * i + 3]) end
local chg = {next_seq = int(first + count), n_open = int(tonumber(job['n_open']) + count),
  items_planned = int(tonumber(job['items_planned'] or '0') + planned_items), updated_ms = int(now)}
if (job['src_failures'] or '0') ~= '0' then
  chg['src_failures'] = '0'
  chg['src_error'] = ''
end
if ARGV[last] == '' then
  chg['blocked'] = int(first + count - 1)
else
  chg['frontier'] = ARGV[last]
  chg['exhausted'] = ARGV[last + 1]
end
save(KEYS[1], job, chg)
return reply
