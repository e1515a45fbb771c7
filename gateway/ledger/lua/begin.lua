-- begin.lua: a push-mode worker is about to call the platform for a leased batch stage.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] leases   KEYS[4] ready:<stage>   KEYS[5] log
-- ARGV[1] lease token   ARGV[2] lease length (ms)   ARGV[3] log maxlen
-- ARGV[4] 'release': give the lease back without a call (a stopping worker), whatever the job's status;
--         'claim': a worker took the attempt off the queue: the stage's lease clock starts now, no call
--         yet (called_ms unset), so a worker killed before its call lets the lease expire unspent
-- ARGV[5] why a 'release' gives the lease back, for the log ('' = worker_stopping; e.g. target_busy)
-- Returns {'ok', deadline_ms} | {'released', job status} | {'stale', status, attempt} | {'cancelled'}
--       | {'corrupt'} | {'missing'}
-- Invariant: a platform call starts only for the current lease of a running job, decided here in one
-- step, so a cancel (which voids leases) either came before and no call starts, or came after the
-- call had begun. The lease clock restarts now: time spent queued for a worker does not count. A job
-- that is paused, held or failed releases the lease back to the ready set without spending an attempt.
local batch, refused = leased_batch(KEYS[2], KEYS[1], ARGV[1])
if refused then return refused end
local status = redis.call('HGET', KEYS[1], 'status') or 'missing'
local now = now_ms()
local seq = batch['seq']
if status == 'running' and ARGV[4] ~= 'release' then
  local deadline = now + tonumber(ARGV[2])
  local chg = {deadline_ms = int(deadline)}
  if ARGV[4] ~= 'claim' then chg['called_ms'] = int(now) end
  save(KEYS[2], batch, chg)
  redis.call('ZADD', KEYS[3], deadline, seq)
  return {'ok', int(deadline)}
end
give_back(KEYS[2], KEYS[3], KEYS[4], batch, now)
local reason = (ARGV[5] or '') ~= '' and ARGV[5] or (ARGV[4] == 'release' and 'worker_stopping' or 'job_status')
log(KEYS[5], ARGV[3], {'event', 'call_not_started', 'seq', seq, 'stage', batch['stage'],
  'attempt', batch['attempt'], 'job_status', status, 'reason', reason})
return {'released', status}
