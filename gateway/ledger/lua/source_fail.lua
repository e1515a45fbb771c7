-- source_fail.lua: reading the job's source at its frontier failed while planning the next batch.
-- KEYS[1] job   KEYS[2] log   KEYS[3] audit
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] message   ARGV[2] '1' retryable / '0' not   ARGV[3] maximum attempts   ARGV[4] initial interval (ms)
-- ARGV[5] backoff coefficient   ARGV[6] maximum interval (ms)   ARGV[7] jitter in [0,1)   ARGV[8] log maxlen
-- Returns {'retry', retry_at_ms, failures} | {'wait', retry_at_ms} | {'failed'} | {'status', s} | {'corrupt'}
-- Invariant: a source that breaks is retried under the first stage's retry policy, counted once per
-- retry window however many callers hit the failure, and then fails the job with the error; a job
-- never waits on a broken source forever. A successful plan (plan.lua) resets the count.
use_outbox(KEYS[#KEYS])
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'status', 'missing'} end
if job['status'] ~= 'running' then return {'status', job['status']} end
local now = now_ms()
local retry_at = tonumber(job['src_retry_ms'] or '0')
if retry_at > now then return {'wait', int(retry_at)} end
local failures = tonumber(job['src_failures'] or '0') + 1
if ARGV[2] ~= '1' or failures >= tonumber(ARGV[3]) then
  local err = 'source unreadable after ' .. failures .. ' attempt(s): ' .. ARGV[1]
  save(KEYS[1], job, {status = 'failed', error = err, src_failures = int(failures), src_error = ARGV[1],
    finished_ms = int(now), updated_ms = int(now)})
  log(KEYS[2], ARGV[8], {'event', 'job_failed', 'from', 'running', 'actor', 'source', 'reason', err})
  audit(KEYS[3], {'event', 'job_failed', 'from', 'running', 'actor', 'source', 'reason', err})
  return {'failed'}
end
local delay = backoff_ms(failures, tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]))
retry_at = now + delay
save(KEYS[1], job, {src_failures = int(failures), src_error = ARGV[1], src_retry_ms = int(retry_at),
  updated_ms = int(now)})
log(KEYS[2], ARGV[8], {'event', 'source_retry', 'attempt', int(failures), 'error', ARGV[1],
  'retry_in_ms', int(delay)})
return {'retry', int(retry_at), int(failures)}
