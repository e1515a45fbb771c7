-- cancel.lua: cancel a job for good and void every outstanding lease, in one step.
-- KEYS[1] job   KEYS[2] leases   KEYS[3] log   KEYS[4] audit
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] log maxlen   ARGV[2] actor   ARGV[3] reason
-- Returns {'ok', old status, voided count} | {'already'} | {'refused', status} | {'corrupt'} | {'missing'}
-- Invariant: after this script no lease of the job is current: every leased batch goes back to pending
-- with no token, so a queued push call cannot begin (begin.lua) and a late heartbeat, complete or fail
-- gets 'cancelled' and changes nothing. Counters are untouched (a voided batch stays open, uncommitted).
-- Key names: the batch:<seq> keys of the leased seqs are built here from KEYS[1], as lease.lua does: which
-- seqs are leased is only known inside the script. (Passing them in lost the race to a busy job's leasers:
-- a lease between the caller's read and the script made it read again, up to giving up.) They carry the
-- job's hash tag, so they live in KEYS[1]'s slot (docs/design.md, "Records and keys").
use_outbox(KEYS[#KEYS])
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'missing'} end
local old = job['status']
if old == 'cancelled' then return {'already'} end
if old == 'succeeded' then return {'refused', old} end
if string.sub(KEYS[1], -4) ~= ':job' then return redis.error_reply('KEYS[1] is not a job key') end
local base = string.sub(KEYS[1], 1, -5)
local voided = 0
for _, seq in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local key = base .. ':batch:' .. seq
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
