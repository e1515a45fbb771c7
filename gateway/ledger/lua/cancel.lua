-- cancel.lua: cancel a job for good and void every outstanding lease, in one step.
-- KEYS[1] job   KEYS[2] leases   KEYS[3] log   KEYS[4] audit   KEYS[5..] batch:<seq> for the seqs in ARGV[4..]
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] log maxlen   ARGV[2] actor   ARGV[3] reason   ARGV[4..] the seqs the caller saw leased
-- Returns {'ok', old status, voided count} | {'already'} | {'refused', status} | {'raced'}
--       | {'corrupt'} | {'missing'}
-- Invariant: after this script no lease of the job is current: every leased batch goes back to pending
-- with no token, so a queued push call cannot begin (begin.lua) and a late heartbeat, complete or fail
-- gets 'cancelled' and changes nothing. Counters are untouched (a voided batch stays open, uncommitted).
-- 'raced' means the leases zset holds a seq the caller did not pass; the caller reads again and retries.
use_outbox(KEYS[#KEYS])
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'missing'} end
local old = job['status']
if old == 'cancelled' then return {'already'} end
if old == 'succeeded' then return {'refused', old} end
local n = #ARGV - 3
if redis.call('ZCARD', KEYS[2]) ~= n then return {'raced'} end
for i = 4, #ARGV do
  if not redis.call('ZSCORE', KEYS[2], ARGV[i]) then return {'raced'} end
end
local voided = 0
for i = 4, #ARGV do
  local key = KEYS[i + 1]
  local batch = load(key)
  if batch and batch['status'] == 'leased' then
    local chg = {status = 'pending', lease_token = '', deadline_ms = '', error = 'job cancelled'}
    chg['st:' .. batch['stage']] = 'pending'  -- nothing runs the stage once its lease is void
    save(key, batch, chg)
    voided = voided + 1
  end
end
redis.call('DEL', KEYS[2])
local now = now_ms()
save(KEYS[1], job, {status = 'cancelled', updated_ms = int(now), finished_ms = int(now), held_reason = ''})
log(KEYS[3], ARGV[1], {'event', 'job_cancelled', 'from', old, 'actor', ARGV[2], 'voided', int(voided)})
audit(KEYS[4], {'event', 'job_cancelled', 'from', old, 'actor', ARGV[2], 'reason', ARGV[3],
  'voided', int(voided)})
return {'ok', old, int(voided)}
