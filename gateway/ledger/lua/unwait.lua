-- unwait.lua: the target a job was waiting on answers again: clear the job's waiting reason.
-- KEYS[1] job   KEYS[2] log   ARGV[1] log maxlen
-- Returns {'ok'} | {'none'} | {'corrupt'}
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil or (job['waiting'] or '') == '' then return {'none'} end
local target = job['waiting_target'] or ''
save(KEYS[1], job, {waiting = '', waiting_target = '', waiting_since_ms = '', waiting_until_ms = ''})
log(KEYS[2], ARGV[1], {'event', 'target_available', 'target', target})
return {'ok'}
