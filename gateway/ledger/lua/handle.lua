-- handle.lua: remember the platform run a push call started (its poll handle), so that if this lease
-- runs out (a worker killed while polling, a callback lost) the next attempt asks the platform for that
-- run's outcome before it triggers the flow again.
-- KEYS[1] batch:<seq>   KEYS[2] job   ARGV[1] lease token   ARGV[2] handle (JSON)
-- Returns {'ok'} | {'stale', status, attempt} | {'cancelled'} | {'corrupt'} | {'missing'}
-- fail_attempt clears it (a known outcome needs no asking) except on a plain lease expiry.
local batch, refused = leased_batch(KEYS[1], KEYS[2], ARGV[1])
if refused then return refused end
save(KEYS[1], batch, {handle = ARGV[2], handle_stage = batch['stage']})
return {'ok'}
