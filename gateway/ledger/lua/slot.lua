-- slot.lua: take a slot for one call in flight to a platform target, unless it is full or cooling down.
-- KEYS[1] target slots zset   KEYS[2] target breaker hash (outage.lua)
-- ARGV[1] limit   ARGV[2] holder id   ARGV[3] slot lifetime (ms; a crashed holder's slot frees itself)
-- Returns {'ok'} | {'probe'} | {'full'} | {'cooldown', remaining ms}
-- An open breaker (until_ms set) refuses every call until its cooldown is over, then lets exactly one
-- call through as a probe ({'probe'}; probe_ms marks it for the slot's lifetime). The probe's caller
-- closes the breaker when the target answers (Dispatcher._target_ok) or outage.lua cools it down again.
-- Invariant: at most <limit> calls to one target are in flight, across every worker process; at most
-- one while its breaker is open. A repeat of a call that took a slot (the same holder, a retry after a
-- timeout) answers what the first did, 'ok' or 'probe' (probe_by), and takes nothing more.
local now = now_ms()
local held = redis.call('ZSCORE', KEYS[1], ARGV[2])
if held and tonumber(held) > now then
  if redis.call('HGET', KEYS[2], 'probe_by') == ARGV[2] then return {'probe'} end
  return {'ok'}
end
local b = redis.call('HMGET', KEYS[2], 'until_ms', 'probe_ms')
local probe = false
if b[1] then
  local until_ms = tonumber(b[1])
  if until_ms > now then return {'cooldown', until_ms - now} end
  local probing = tonumber(b[2] or '')
  if probing and probing > now then return {'cooldown', probing - now} end
  redis.call('HSET', KEYS[2], 'probe_ms', now + tonumber(ARGV[3]), 'probe_by', ARGV[2])
  probe = true
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  if probe then redis.call('HDEL', KEYS[2], 'probe_ms', 'probe_by') end
  return {'full'}
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
if probe then return {'probe'} end
return {'ok'}
