-- slot.lua: take a slot for one call in flight to a platform target, unless it is full or cooling down.
-- KEYS[1] target slots zset   KEYS[2] target cooldown string
-- ARGV[1] limit   ARGV[2] holder id   ARGV[3] slot lifetime (ms; a crashed holder's slot frees itself)
-- Returns {'ok'} | {'full'} | {'cooldown', remaining ms}
-- Invariant: at most <limit> calls to one target are in flight, across every worker process.
local cooling = redis.call('PTTL', KEYS[2])
if cooling > 0 then return {'cooldown', cooling} end
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return {'full'} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
return {'ok'}
