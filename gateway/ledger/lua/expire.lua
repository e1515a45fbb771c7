-- expire.lua: return a batch whose lease ran out to the pool (or fail it when out of attempts).
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] leases   KEYS[4] failed   KEYS[5] log
-- KEYS[6..5+S] ready:0..ready:S-1
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] seq   ARGV[2] maximum attempts   ARGV[3] initial interval (ms)   ARGV[4] backoff coefficient
-- ARGV[5] maximum interval (ms)   ARGV[6] jitter in [0,1)   ARGV[7] log maxlen   ARGV[8] budget total
-- ARGV[9] tolerated failure %   ARGV[10] actor   ARGV[11] '1' when the batch's stage is a push stage
-- ARGV[12] the stage's max_run (ms; absent or '' = no limit)   ARGV[13] '1' when a run past max_run is
-- retryable (the stage is idempotent)
-- A push-stage lease whose call never began (begin.lua sets called_ms; a lease waiting in the worker
-- queue has none, or an older one from an earlier attempt) is released without spending an attempt.
-- A lease that heartbeat.lua capped at this attempt's start + max_run (capped_ms) ran past max_run: it
-- fails with that message and error type 'max_run', retried only if ARGV[13] says so.
-- Returns {'retry'|'failed', attempt} | {'alive'} | {'held'} | {'corrupt'}
-- Invariant: a lease is expired once: the deadline is re-checked here, and the old holder's token is
-- void afterwards (its complete gets 'stale'), so several supervisors cannot double-recover.
use_outbox(KEYS[#KEYS])
local seq = ARGV[1]
local deadline = redis.call('ZSCORE', KEYS[3], seq)
local now = now_ms()
if not deadline or tonumber(deadline) > now then return {'alive'} end
local batch = load(KEYS[2])
local job = load(KEYS[1])
if not batch or not job then
  redis.call('ZREM', KEYS[3], seq)
  return {'corrupt'}
end
-- a held job (record-only recovery) changes nothing until an operator releases it
if job['status'] == 'held' then return {'held'} end
if batch['status'] ~= 'leased' then
  redis.call('ZREM', KEYS[3], seq)
  return {'alive'}
end
local message = 'lease expired'
local retryable, error_type = true, nil
local max_run = tonumber(ARGV[12] or '')
local start = max_run and run_start(batch, ARGV[11] == '1')
if ARGV[11] == '1' and (tonumber(batch['called_ms'] or '') or -1) < (tonumber(batch['leased_ms'] or '') or 0) then
  save(KEYS[2], batch, {unspent = int(tonumber(batch['unspent'] or '0') + 1)})
  message = 'lease expired before its call began (no attempt spent)'
elseif start and tonumber(batch['capped_ms'] or '') == start + max_run then
  message, error_type, retryable = max_run_message(max_run), 'max_run', ARGV[13] == '1'
end
local k = {job = KEYS[1], batch = KEYS[2], leases = KEYS[3], failed = KEYS[4], log = KEYS[5],
  ready = {unpack(KEYS, 6)}}
local outcome = fail_attempt(k, job, batch, seq, {now = now, message = message,
  retryable = retryable, error_type = error_type, max_attempts = tonumber(ARGV[2]), initial_ms = tonumber(ARGV[3]),
  coef = tonumber(ARGV[4]), max_ms = tonumber(ARGV[5]), jitter = tonumber(ARGV[6]), maxlen = ARGV[7],
  budget_total = ARGV[8], tolerated_pct = tonumber(ARGV[9]), actor = ARGV[10],
  keep_handle = error_type == nil})
if outcome == 'corrupt' then return {'corrupt'} end
return {outcome, batch['attempt']}
