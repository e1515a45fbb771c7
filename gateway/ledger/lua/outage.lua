-- outage.lua: a push call found its target unavailable (connection refused, 429, 503, a webhook not
-- registered yet): the batch waits for the target without spending an attempt. The target's breaker was
-- cooled down just before by breaker.lua, on the target's own slot (a Redis Cluster keeps a script in
-- one slot); its since/until come in ARGV.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] leases   KEYS[4] ready:<stage>   KEYS[5] log   KEYS[6] audit
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox; a pause is an event)
-- ARGV[1] lease token   ARGV[2] message   ARGV[3] breaker until_ms   ARGV[4] breaker since_ms
-- ARGV[5] unused   ARGV[6] pause the job after (ms)   ARGV[7] log maxlen
-- ARGV[8] target label (scheme://host:port)
-- Returns {'waiting', until_ms, since_ms, job status} | {'stale', status, attempt} | {'cancelled'}
--       | {'corrupt'} | {'missing'}
-- Invariant: the batch's attempt is not spent (unspent + 1 balances the lease's attempt + 1); a job
-- whose target stayed down past ARGV[6] is paused with the reason, never failed.
use_outbox(KEYS[#KEYS])
local batch, refused = leased_batch(KEYS[2], KEYS[1], ARGV[1])
if refused then return refused end
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'missing'} end
local now = now_ms()
local seq = batch['seq']
local since = tonumber(ARGV[4])
local until_ms = tonumber(ARGV[3])
-- the batch goes back, ready when the target may be tried again; its attempt is not spent
give_back(KEYS[2], KEYS[3], KEYS[4], batch, until_ms)
local reason = ARGV[8] .. ' unavailable since ' .. int(since) .. ' ms: ' .. ARGV[2]
local jchg = {waiting = ARGV[2], waiting_target = ARGV[8], waiting_since_ms = int(since),
  waiting_until_ms = int(until_ms)}
local paused = false
if job['status'] == 'running' and now - since >= tonumber(ARGV[6]) then
  jchg['status'] = 'paused'
  jchg['updated_ms'] = int(now)
  paused = true
end
save(KEYS[1], job, jchg)
log(KEYS[5], ARGV[7], {'event', 'target_unavailable', 'seq', seq, 'stage', batch['stage'],
  'attempt', batch['attempt'], 'target', ARGV[8], 'error', ARGV[2], 'retry_at_ms', int(until_ms),
  'attempt_spent', '0'})
if paused then
  local why = 'target ' .. ARGV[8] .. ' unavailable for ' .. int((now - since) / 1000) .. ' s: ' .. ARGV[2]
  log(KEYS[5], ARGV[7], {'event', 'job_paused', 'from', 'running', 'actor', 'dispatcher', 'reason', why})
  audit(KEYS[6], {'event', 'job_paused', 'from', 'running', 'actor', 'dispatcher', 'reason', why})
end
return {'waiting', int(until_ms), int(since), job['status']}
