-- set_status.lua: move a job between statuses a caller may ask for (pause, resume, cancel).
-- KEYS[1] job   KEYS[2] log
-- ARGV[1] new status   ARGV[2] allowed current statuses, comma separated   ARGV[3] log maxlen   ARGV[4] actor
-- Returns {'ok', old status} | {'refused', current status} | {'corrupt'} | {'missing'}
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'missing'} end
local old = job['status']
if not string.find(',' .. ARGV[2] .. ',', ',' .. old .. ',', 1, true) then return {'refused', old} end
local now = now_ms()
local chg = {status = ARGV[1], updated_ms = int(now)}
if ARGV[1] == 'cancelled' then chg['finished_ms'] = int(now) end
save(KEYS[1], job, chg)
log(KEYS[2], ARGV[3], {'event', 'job_' .. ARGV[1], 'from', old, 'actor', ARGV[4]})
return {'ok', old}
