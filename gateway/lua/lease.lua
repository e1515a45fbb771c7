-- lease.lua: hand one ready batch's current stage to a worker.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] items:<seq>   KEYS[4] ready:<stage>   KEYS[5] leases
-- KEYS[6] log   KEYS[7] failed
-- ARGV[1] seq   ARGV[2] stage   ARGV[3] lease length (ms)   ARGV[4] new lease token
-- ARGV[5] concurrency   ARGV[6] log maxlen   ARGV[7] budget total   ARGV[8] tolerated failure %
-- Returns {'ok', attempt, deadline_ms, start_cursor, end_cursor, items, input}
--       | {'busy'} | {'raced'} | {'status', s} | {'corrupt', 'job'|'batch'}
-- Invariant: one batch stage is leased to at most one holder; the attempt (fencing token) rises by one
-- per lease; at most <concurrency> batches of a job are leased at once.
local job = load(KEYS[1])
if job == false then return {'corrupt', 'job'} end
if job == nil then return {'status', 'missing'} end
if job['status'] ~= 'running' then return {'status', job['status']} end
if redis.call('ZCARD', KEYS[5]) >= tonumber(ARGV[5]) then return {'busy'} end
local seq = ARGV[1]
local now = now_ms()
local ready_at = redis.call('ZSCORE', KEYS[4], seq)
if not ready_at or tonumber(ready_at) > now then return {'raced'} end
local batch = load(KEYS[2])
if not batch then
  -- Corrupt (or vanished) batch: never run it; it counts as a failed batch.
  redis.call('ZREM', KEYS[4], seq)
  redis.call('ZADD', KEYS[7], seq, seq)
  local chg = {updated_ms = int(now)}
  failed_for_good(job, chg, seq, now, ARGV[7], tonumber(ARGV[8]))
  save(KEYS[1], job, chg)
  log(KEYS[6], ARGV[6], {'event', 'batch_corrupt', 'seq', seq, 'error', 'checksum mismatch'})
  return {'corrupt', 'batch'}
end
if batch['status'] ~= 'pending' or batch['stage'] ~= ARGV[2] then
  redis.call('ZREM', KEYS[4], seq)
  return {'raced'}
end
local attempt = tonumber(batch['attempt']) + 1
local deadline = now + tonumber(ARGV[3])
local chg = {status = 'leased', attempt = int(attempt), lease_token = ARGV[4],
  leased_ms = int(now), deadline_ms = int(deadline)}
chg['st:' .. ARGV[2]] = 'running'
save(KEYS[2], batch, chg)
redis.call('ZREM', KEYS[4], seq)
redis.call('ZADD', KEYS[5], deadline, seq)
log(KEYS[6], ARGV[6], {'event', 'stage_started', 'seq', seq, 'stage', ARGV[2], 'attempt', int(attempt)})
local items = redis.call('GET', KEYS[3]) or ''
local input = batch['out:' .. (tonumber(ARGV[2]) - 1)] or ''
return {'ok', int(attempt), int(deadline), batch['start_cursor'], batch['end_cursor'], items, input}
