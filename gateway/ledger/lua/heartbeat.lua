-- heartbeat.lua: extend a live lease and store the worker's progress details; end a run past max_run.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] leases
-- KEYS[4] failed   KEYS[5] log   KEYS[6..5+S] ready:0..ready:S-1   (needed only with ARGV[4])
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] lease token   ARGV[2] extension (ms)   ARGV[3] progress (JSON, '' to keep)
-- ARGV[4] the stage's max_run (ms; absent or '' = no limit)   ARGV[5] '1' when the stage is a push stage
-- ARGV[6] '1' when a run past max_run is retryable (the stage is idempotent)   ARGV[7] maximum attempts
-- ARGV[8] initial interval (ms)   ARGV[9] backoff coefficient   ARGV[10] maximum interval (ms)
-- ARGV[11] jitter in [0,1)   ARGV[12] log maxlen   ARGV[13] budget total   ARGV[14] tolerated failure %
-- ARGV[15] actor
-- Returns {'ok', deadline_ms, job status} | {'max_run', 'retry'|'failed', attempt, max_run (ms)}
--       | {'stale', status, attempt} | {'cancelled'} | {'corrupt'} | {'missing'}
-- The attempt's max_run clock starts at its lease (pull stage) or its platform call (push stage,
-- begin.lua's called_ms; before the call it has not started). A heartbeat never extends the lease past
-- start + max_run (the batch then records capped_ms = that cap, which expire.lua recognises); one that
-- comes at or after it fails the attempt here, with error type 'max_run', retried only if ARGV[6] says
-- so. A held job is not failed (it changes nothing by itself): its lease stays at the cap.
-- Invariant: only the current holder (matching token) can extend; the deadline only moves forward,
-- and never past start + max_run.
use_outbox(KEYS[#KEYS])
local batch, refused = leased_batch(KEYS[2], KEYS[1], ARGV[1])
if refused then return refused end
local now = now_ms()
local deadline = now + tonumber(ARGV[2])
if deadline < tonumber(batch['deadline_ms']) then deadline = tonumber(batch['deadline_ms']) end
local chg = {}
local max_run = tonumber(ARGV[4] or '')
local start = max_run and run_start(batch, ARGV[5] == '1')
local status = redis.call('HGET', KEYS[1], 'status') or 'missing'
if start then
  local cap = start + max_run
  if now >= cap and status ~= 'held' then
    local job = load(KEYS[1])
    if job == false then return {'corrupt'} end
    if job == nil then return {'missing'} end
    local k = {job = KEYS[1], batch = KEYS[2], leases = KEYS[3], failed = KEYS[4], log = KEYS[5],
      ready = {unpack(KEYS, 6)}}
    local outcome = fail_attempt(k, job, batch, batch['seq'], {now = now, message = max_run_message(max_run),
      error_type = 'max_run', retryable = ARGV[6] == '1', max_attempts = tonumber(ARGV[7]),
      initial_ms = tonumber(ARGV[8]), coef = tonumber(ARGV[9]), max_ms = tonumber(ARGV[10]),
      jitter = tonumber(ARGV[11]), maxlen = ARGV[12], budget_total = ARGV[13],
      tolerated_pct = tonumber(ARGV[14]), actor = ARGV[15]})
    if outcome == 'corrupt' then return {'corrupt'} end
    return {'max_run', outcome, batch['attempt'], int(max_run)}
  end
  if deadline >= cap then
    deadline = cap
    chg['capped_ms'] = int(cap)
  end
end
chg['deadline_ms'] = int(deadline)
if ARGV[3] ~= '' then chg['progress'] = ARGV[3] end
save(KEYS[2], batch, chg)
redis.call('ZADD', KEYS[3], deadline, batch['seq'])
return {'ok', int(deadline), status}
