-- fail.lua: a worker reports that its stage attempt failed.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] leases   KEYS[4] failed   KEYS[5] log
-- KEYS[6..5+S] ready:0..ready:S-1
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] lease token   ARGV[2] message   ARGV[3] '1' retryable / '0' fatal   ARGV[4] maximum attempts
-- ARGV[5] initial interval (ms)   ARGV[6] backoff coefficient   ARGV[7] maximum interval (ms)
-- ARGV[8] jitter in [0,1)   ARGV[9] log maxlen   ARGV[10] budget total   ARGV[11] tolerated failure %
-- ARGV[12] actor   ARGV[13] minimum delay before the retry (ms; Retry-After)
-- ARGV[14] error type ('' = none; e.g. outcome_unknown, shown with the batch and in retry-failed)
-- ARGV[15] the call's usage (JSON, lib.lua record_cost; '' = none reported; absent = record no cost:
-- not a platform call)   ARGV[16] the flow's cost budget (JSON; '' = none)
-- KEYS[#KEYS-1] cost: the job's cost hash, only when ARGV[15] is given
-- Returns {'retry'|'failed', attempt, job status[, why the call ran, '1' if its cost paused the job]}
--       | {'stale', status, attempt} | {'cancelled'}
--       | {'corrupt'} | {'missing'}
-- Invariant: only the current lease holder can fail an attempt; a batch out of attempts or with a fatal
-- error fails for good and the failure budget decides the job.
use_outbox(KEYS[#KEYS])
local batch, refused = leased_batch(KEYS[2], KEYS[1], ARGV[1])
if refused then
  if refused[1] == 'cancelled' then
    log(KEYS[5], ARGV[9], {'event', 'late_answer', 'seq', batch['seq'], 'answer', 'failed',
      'actor', ARGV[12], 'error', 'job cancelled'})
  end
  return refused
end
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
local reason = call_reason(batch)  -- before fail_attempt records this attempt's error
local stage = batch['stage']
local k = {job = KEYS[1], batch = KEYS[2], leases = KEYS[3], failed = KEYS[4], log = KEYS[5],
  ready = {unpack(KEYS, 6)}}
local outcome = fail_attempt(k, job, batch, batch['seq'], {now = now_ms(), message = ARGV[2],
  retryable = ARGV[3] == '1', max_attempts = tonumber(ARGV[4]), initial_ms = tonumber(ARGV[5]),
  coef = tonumber(ARGV[6]), max_ms = tonumber(ARGV[7]), jitter = tonumber(ARGV[8]), maxlen = ARGV[9],
  budget_total = ARGV[10], tolerated_pct = tonumber(ARGV[11]), actor = ARGV[12],
  min_delay_ms = tonumber(ARGV[13]), error_type = (ARGV[14] or '') ~= '' and ARGV[14] or nil})
if outcome == 'corrupt' then return {'corrupt'} end
if ARGV[15] ~= nil then
  local paused = record_cost(KEYS[#KEYS - 1], KEYS[1], KEYS[5], ARGV[9], batch, stage, reason, now_ms(),
    ARGV[15], ARGV[16])
  return {outcome, batch['attempt'], paused and 'paused' or job['status'], reason, paused and '1' or '0'}
end
return {outcome, batch['attempt'], job['status']}
