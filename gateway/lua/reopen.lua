-- reopen.lua: resume a job: put its uncommitted batches back in the pool at their current stage.
-- KEYS[1] job   KEYS[2] leases   KEYS[3] failed   KEYS[4] log   KEYS[5..4+S] ready:0..ready:S-1
-- KEYS[5+S..] batch:<seq> for the seqs in ARGV[7..]
-- ARGV[1] number of stages S   ARGV[2] log maxlen   ARGV[3] actor   ARGV[4] 'all' (failed, stuck leases)
--         or 'failed' (only failed batches: retry-failed)   ARGV[5] budget total
-- ARGV[6] tolerated failure %   ARGV[7..] seqs
-- Returns {'ok', reopened count, job status after} | {'corrupt'}
-- Invariant 3: committed batches and committed stages are never re-opened; a re-opened batch resumes
-- from its recorded start cursor at the first stage it has not committed.
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
local now = now_ms()
local nstages = tonumber(ARGV[1])
local first_batch = 5 + nstages
local reopened = 0
local n_failed = tonumber(job['n_failed'])
local n_open = tonumber(job['n_open'])
for i = 7, #ARGV do
  local key = KEYS[first_batch + i - 7]
  local seq = ARGV[i]
  local batch = load(key)
  local was = batch and batch['status']
  if was == 'failed' or (ARGV[4] == 'all' and was == 'leased') then
    local ready = KEYS[5 + tonumber(batch['stage'])]
    local chg = {status = 'pending', lease_token = '', deadline_ms = '', ready_ms = int(now)}
    if was == 'failed' then
      chg['attempt'] = '0'
      n_failed = n_failed - 1
      n_open = n_open + 1
      redis.call('ZREM', KEYS[3], seq)
    end
    redis.call('ZREM', KEYS[2], seq)
    redis.call('ZADD', ready, now, seq)
    save(key, batch, chg)
    reopened = reopened + 1
    log(KEYS[4], ARGV[2], {'event', 'batch_reopened', 'seq', seq, 'stage', batch['stage'],
      'was', was, 'actor', ARGV[3]})
  end
end
local chg = {n_failed = int(n_failed), n_open = int(n_open), updated_ms = int(now)}
-- resume always runs the job again; retry-failed only when it re-opened something, and never unpauses
local status = job['status']
if status ~= 'paused' and (ARGV[4] == 'all' or reopened > 0) then
  chg['status'] = 'running'
  chg['finished_ms'] = ''
  chg['error'] = ''
  -- nothing left to run (e.g. the last batch committed after a cancel): finish now
  finish_changes(job, chg, now, ARGV[5], tonumber(ARGV[6]))
end
save(KEYS[1], job, chg)
log(KEYS[4], ARGV[2], {'event', 'job_resumed', 'reopened', int(reopened), 'actor', ARGV[3]})
return {'ok', int(reopened), job['status']}
