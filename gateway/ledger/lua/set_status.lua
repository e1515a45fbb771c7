-- set_status.lua: move a job between statuses: pause, hold (record-only recovery), release, fail.
-- KEYS[1] job   KEYS[2] log   KEYS[3] audit
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] new status   ARGV[2] allowed current statuses, comma separated   ARGV[3] log maxlen   ARGV[4] actor
-- ARGV[5] reason ('' = none; stored as the job's error for 'failed', as held_reason for 'held')
-- ARGV[6] budget total   ARGV[7] tolerated failure %
-- Returns {'ok', old status} | {'refused', current status} | {'corrupt'} | {'missing'}
-- Invariant: only the status (and its reason) changes; batches, leases and counters are untouched.
use_outbox(KEYS[#KEYS])
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'missing'} end
local old = job['status']
if not string.find(',' .. ARGV[2] .. ',', ',' .. old .. ',', 1, true) then return {'refused', old} end
local now = now_ms()
local new = ARGV[1]
local chg = {status = new, updated_ms = int(now)}
if new == 'failed' or new == 'cancelled' then chg['finished_ms'] = int(now) end
if new == 'failed' then chg['error'] = ARGV[5] end
if new == 'held' then chg['held_reason'] = ARGV[5] end
if old == 'held' then chg['held_reason'] = '' end
if (job['paused_reason'] or '') ~= '' and new ~= 'paused' then chg['paused_reason'] = '' end  -- record_cost's
save(KEYS[1], job, chg)
-- a job released (or un-paused) with nothing left open ends now
if new == 'running' then
  local fin = {}
  finish_changes(job, fin, now, ARGV[6], tonumber(ARGV[7]))
  if fin['status'] then save(KEYS[1], job, fin) end
end
local event = ({paused = 'job_paused', held = 'job_held', failed = 'job_failed'})[new]
  or (old == 'held' and 'job_released' or 'job_resumed')
log(KEYS[2], ARGV[3], {'event', event, 'from', old, 'actor', ARGV[4], 'reason', ARGV[5]})
audit(KEYS[3], {'event', event, 'from', old, 'actor', ARGV[4], 'reason', ARGV[5]})
return {'ok', old}
