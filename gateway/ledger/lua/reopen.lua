-- reopen.lua: resume a job, or retry its failed batches; every decision is taken here, on what the
-- script reads.
-- KEYS[1] job   KEYS[2] leases   KEYS[3] failed   KEYS[4] log   KEYS[5] audit   KEYS[6..5+S] ready:0..S-1
-- KEYS[6+S..] batch:<seq> for the seqs in ARGV[8..]
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] number of stages S   ARGV[2] log maxlen   ARGV[3] actor   ARGV[4] 'resume' | 'retry_failed'
-- ARGV[5] budget total   ARGV[6] tolerated failure %
-- ARGV[7] for retry_failed: how many seqs the caller saw in the failed set (else unused)
-- ARGV[8..] seqs: for resume the uncommitted window (watermark .. next_seq-1) as the caller read it;
--           for retry_failed the members of the failed set
-- Returns {'ok', reopened count, job status after} | {'refused', status} | {'raced'} | {'corrupt'}
--       | {'missing'}
-- Invariant 3: committed batches and committed stages are never re-opened; a re-opened batch resumes
-- from its recorded start cursor at the first stage it has not committed. Counters move with each
-- batch's own status change (failed -> pending: n_failed - 1, n_open + 1; leased -> pending: no change).
-- A cancelled job is final. A succeeded one resumes only by cursor (replan), but retry-failed re-opens
-- the failed batches its failure budget tolerated (their items were never stored) and runs it again;
-- with none failed it answers 0 and the job stays succeeded. A paused one just runs.
-- Batches planned after the caller read the window are pending already, so nothing is missed; for
-- retry_failed the failed set must still be what the caller read ('raced' otherwise).
use_outbox(KEYS[#KEYS])
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'missing'} end
local mode = ARGV[4]
local status = job['status']
if status == 'cancelled' then return {'refused', status} end
local now = now_ms()
if status == 'succeeded' and mode == 'resume' then return {'refused', status} end
if mode == 'resume' and status == 'paused' then
  local chg = {status = 'running', updated_ms = int(now)}
  settle_waiting(job, chg)  -- every open batch waits for a person: waiting_human
  save(KEYS[1], job, chg)
  log(KEYS[4], ARGV[2], {'event', 'job_resumed', 'from', status, 'reopened', '0', 'actor', ARGV[3]})
  audit(KEYS[5], {'event', 'job_resumed', 'from', status, 'reopened', '0', 'actor', ARGV[3]})
  return {'ok', '0', job['status']}
end
if mode == 'retry_failed' then
  if redis.call('ZCARD', KEYS[3]) ~= tonumber(ARGV[7]) then return {'raced'} end
end
local nstages = tonumber(ARGV[1])
local first_batch = 6 + nstages
local n_failed = tonumber(job['n_failed'])
local n_open = tonumber(job['n_open'])
local todo = {}
for i = 8, #ARGV do
  local key = KEYS[first_batch + i - 8]
  local seq = ARGV[i]
  local batch = load(key)
  local was = batch and batch['status']
  if was == 'failed' or (mode == 'resume' and was == 'leased') then
    if mode == 'retry_failed' and not redis.call('ZSCORE', KEYS[3], seq) then return {'raced'} end
    if was == 'failed' then
      n_failed = n_failed - 1
      n_open = n_open + 1
    end
    todo[#todo + 1] = {key = key, seq = seq, batch = batch, was = was}
  end
end
if status == 'succeeded' and #todo == 0 then return {'ok', '0', status} end  -- nothing lost: unchanged
local chg = {n_failed = int(n_failed), n_open = int(n_open), updated_ms = int(now)}
-- resume always runs the job again; retry-failed only when it re-opened something, and never unpauses
if (mode == 'resume' or #todo > 0) and (status == 'running' or status == 'failed' or status == 'held'
    or status == 'succeeded' or status == 'waiting_human') then
  chg['status'] = 'running'
  chg['finished_ms'] = ''
  chg['error'] = ''
  chg['held_reason'] = ''
  -- nothing left to run (e.g. the last batch committed after a failure): finish now
  finish_changes(job, chg, now, ARGV[5], tonumber(ARGV[6]))
end
local bad = negative_counter(job, chg)
if bad then return refuse_corrupt(KEYS[1], KEYS[4], ARGV[2], bad .. ' would go negative on ' .. mode) end
for _, t in ipairs(todo) do
  local bchg = {status = 'pending', lease_token = '', deadline_ms = '', ready_ms = int(now)}
  if t.was == 'failed' then
    bchg['attempt'] = '0'
    bchg['unspent'] = '0'
    redis.call('ZREM', KEYS[3], t.seq)
  else
    bchg['st:' .. t.batch['stage']] = 'pending'  -- the lease taken back: the stage runs no more
  end
  redis.call('ZREM', KEYS[2], t.seq)
  redis.call('ZADD', KEYS[6 + tonumber(t.batch['stage'])], now, t.seq)
  save(t.key, t.batch, bchg)
  log(KEYS[4], ARGV[2], {'event', 'batch_reopened', 'seq', t.seq, 'stage', t.batch['stage'],
    'was', t.was, 'actor', ARGV[3]})
end
save(KEYS[1], job, chg)
local event = mode == 'resume' and 'job_resumed' or 'retry_failed'
log(KEYS[4], ARGV[2], {'event', event, 'from', status, 'reopened', int(#todo), 'actor', ARGV[3]})
audit(KEYS[5], {'event', event, 'from', status, 'reopened', int(#todo), 'actor', ARGV[3]})
return {'ok', int(#todo), job['status']}
