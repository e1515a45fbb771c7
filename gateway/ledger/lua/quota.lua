-- quota.lua: admit one request under a tenant's quotas, or say which quota refuses it and for how long.
-- KEYS[1] the tenant's rate key (string: the GCRA's theoretical arrival time, ms; expires when idle)
-- KEYS[2] (optional) the tenant's active-jobs set (job ids)
-- ARGV[1] rate limit: requests per period (0 = no rate limit)   ARGV[2] period (ms)
-- ARGV[3] active-jobs limit (0 = none; only with KEYS[2])   ARGV[4] job id to add (only with KEYS[2])
-- Returns {'ok'} | {'active', members} | {'rate', wait_ms}
-- Rate: the generic cell rate algorithm (one key per tenant and quota): requests are spaced
-- period/limit apart on average, and a burst of up to <limit> requests is let through at once; a
-- refused request is not counted. Both checks are made before anything is written, so a refusal
-- changes nothing. Invariant: the set never holds more than <limit> ids when this script adds one, and
-- every request let through is counted, across every process, because both happen in this one script.
local now = now_ms()
local limit, period = tonumber(ARGV[1]), tonumber(ARGV[2])
local new_tat
if limit > 0 then
  local wait
  wait, new_tat = gcra_wait(KEYS[1], limit, period, now)
  if wait then return {'rate', wait} end
end
if KEYS[2] then
  local active_limit = tonumber(ARGV[3])
  if active_limit > 0 then
    local members = redis.call('SCARD', KEYS[2])
    if members >= active_limit then return {'active', members} end
  end
  redis.call('SADD', KEYS[2], ARGV[4])
end
if new_tat then gcra_take(KEYS[1], new_tat, now) end
return {'ok'}
