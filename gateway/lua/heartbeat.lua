-- heartbeat.lua: extend a live lease and store the worker's progress details.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] leases
-- ARGV[1] lease token   ARGV[2] extension (ms)   ARGV[3] progress (JSON, '' to keep)
-- Returns {'ok', deadline_ms, job status} | {'stale', status, attempt} | {'cancelled'} | {'corrupt'}
--       | {'missing'}
-- Invariant: only the current holder (matching token) can extend; the deadline only moves forward.
local batch, refused = leased_batch(KEYS[2], KEYS[1], ARGV[1])
if refused then return refused end
local deadline = now_ms() + tonumber(ARGV[2])
if deadline < tonumber(batch['deadline_ms']) then deadline = tonumber(batch['deadline_ms']) end
local chg = {deadline_ms = int(deadline)}
if ARGV[3] ~= '' then chg['progress'] = ARGV[3] end
save(KEYS[2], batch, chg)
redis.call('ZADD', KEYS[3], deadline, batch['seq'])
local status = redis.call('HGET', KEYS[1], 'status') or 'missing'
return {'ok', int(deadline), status}
