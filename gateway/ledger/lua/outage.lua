-- outage.lua: a push call found its target unavailable (connection refused, 429, 503, a webhook not
-- registered yet): the target cools down and the batch waits for it without spending an attempt.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] leases   KEYS[4] ready:<stage>   KEYS[5] log   KEYS[6] audit
-- KEYS[7] target breaker hash   KEYS[8] target waiting set (job ids waiting on the target)
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox; a pause is an event)
-- ARGV[1] lease token   ARGV[2] message   ARGV[3] minimum cooldown (ms; Retry-After, 0 = none)
-- ARGV[4] first cooldown (ms)   ARGV[5] longest cooldown (ms)   ARGV[6] pause the job after (ms)
-- ARGV[7] log maxlen   ARGV[8] target label (scheme://host:port)   ARGV[9] job id
-- Returns {'waiting', until_ms, since_ms, job status} | {'stale', status, attempt} | {'cancelled'}
--       | {'corrupt'} | {'missing'}
-- Breaker (KEYS[7]): since_ms (first failure of this outage), until_ms (no call before), fails (cooldown
-- doublings), error, probe_ms (slot.lua: one probe call in flight once the cooldown is over).
-- Calls that fail together while the breaker is already cooling do not double the cooldown again.
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
local b = redis.call('HMGET', KEYS[7], 'since_ms', 'until_ms', 'fails')
local since = tonumber(b[1]) or now
local until_ms = tonumber(b[2]) or 0
local fails = tonumber(b[3]) or 0
if until_ms <= now then
  fails = fails + 1
  local cooldown = math.min(tonumber(ARGV[4]) * 2 ^ (fails - 1), tonumber(ARGV[5]))
  cooldown = math.max(cooldown, tonumber(ARGV[3]))
  until_ms = now + cooldown
end
redis.call('HSET', KEYS[7], 'since_ms', int(since), 'until_ms', int(until_ms), 'fails', int(fails),
  'error', ARGV[2])
redis.call('HDEL', KEYS[7], 'probe_ms')
redis.call('SADD', KEYS[8], ARGV[9])
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
