-- lease.lua: hand one ready batch's current stage to a worker, trying several candidates in order.
-- KEYS[1] job   KEYS[2] ready:<stage>   KEYS[3] leases   KEYS[4] log   KEYS[5] failed
-- KEYS[6..] batch:<seq>, items:<seq> pairs for the candidate seqs in ARGV[8..]
-- ARGV[1] stage   ARGV[2] lease length (ms)   ARGV[3] new lease token   ARGV[4] concurrency
-- ARGV[5] log maxlen   ARGV[6] budget total   ARGV[7] tolerated failure %   ARGV[8..] candidate seqs
-- Returns {'ok', seq, attempt, deadline_ms, start_cursor, end_cursor, items, input}
--       | {'busy'} | {'raced'} | {'status', s} | {'corrupt', 'job'}
-- Invariant: one batch stage is leased to at most one holder; the attempt (fencing token) rises by one
-- per lease; at most <concurrency> batches of a job are leased at once; only a running job leases.
-- Several callers racing for the same ready set each take the first candidate still ready, so a
-- lost race costs one more candidate, not an empty answer.
local job = load(KEYS[1])
if job == false then return {'corrupt', 'job'} end
if job == nil then return {'status', 'missing'} end
if job['status'] ~= 'running' then return {'status', job['status']} end
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[4]) then return {'busy'} end
local stage = ARGV[1]
local now = now_ms()
for i = 8, #ARGV do
  local seq = ARGV[i]
  local bkey, ikey = KEYS[6 + 2 * (i - 8)], KEYS[7 + 2 * (i - 8)]
  local ready_at = redis.call('ZSCORE', KEYS[2], seq)
  if ready_at and tonumber(ready_at) <= now then
    local batch = load(bkey)
    if not batch then
      -- Corrupt (or vanished) batch: never run it; it counts as a failed batch.
      local chg = {updated_ms = int(now)}
      failed_for_good(job, chg, seq, now, ARGV[6], tonumber(ARGV[7]))
      local bad = negative_counter(job, chg)
      if bad then return refuse_corrupt(KEYS[1], KEYS[4], ARGV[5], bad .. ' would go negative at corrupt batch ' .. seq) end
      redis.call('ZREM', KEYS[2], seq)
      redis.call('ZADD', KEYS[5], seq, seq)
      save(KEYS[1], job, chg)
      log(KEYS[4], ARGV[5], {'event', 'batch_corrupt', 'seq', seq, 'error', 'checksum mismatch'})
      if job['status'] ~= 'running' then return {'status', job['status']} end
    elseif batch['status'] ~= 'pending' or batch['stage'] ~= stage then
      redis.call('ZREM', KEYS[2], seq)
    else
      local attempt = tonumber(batch['attempt']) + 1
      local deadline = now + tonumber(ARGV[2])
      local chg = {status = 'leased', attempt = int(attempt), lease_token = ARGV[3],
        leased_ms = int(now), deadline_ms = int(deadline)}
      chg['st:' .. stage] = 'running'
      save(bkey, batch, chg)
      redis.call('ZREM', KEYS[2], seq)
      redis.call('ZADD', KEYS[3], deadline, seq)
      log(KEYS[4], ARGV[5], {'event', 'stage_started', 'seq', seq, 'stage', stage, 'attempt', int(attempt)})
      local items = redis.call('GET', ikey) or ''
      local input = batch['out:' .. (tonumber(stage) - 1)] or ''
      return {'ok', seq, int(attempt), int(deadline), batch['start_cursor'], batch['end_cursor'], items, input}
    end
  end
end
return {'raced'}
