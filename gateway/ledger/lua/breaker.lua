-- breaker.lua: a push call found its target unavailable: the target's breaker cools down (the first
-- half of an outage; outage.lua then gives the batch back on the job's slot). One slot: the target's.
-- KEYS[1] target breaker hash   KEYS[2] target waiting set (job ids waiting on the target)
-- ARGV[1] message   ARGV[2] minimum cooldown (ms; Retry-After, 0 = none)   ARGV[3] first cooldown (ms)
-- ARGV[4] longest cooldown (ms)   ARGV[5] job id
-- Returns {until_ms, since_ms}
-- Breaker: since_ms (first failure of this outage), until_ms (no call before), fails (cooldown
-- doublings), error, probe_ms (slot.lua: one probe call in flight once the cooldown is over).
-- Calls that fail together while the breaker is already cooling do not double the cooldown again, so
-- running it again for the same failure (a retry after a timeout) changes nothing but the message.
local now = now_ms()
local b = redis.call('HMGET', KEYS[1], 'since_ms', 'until_ms', 'fails')
local since = tonumber(b[1]) or now
local until_ms = tonumber(b[2]) or 0
local fails = tonumber(b[3]) or 0
if until_ms <= now then
  fails = fails + 1
  local cooldown = math.min(tonumber(ARGV[3]) * 2 ^ (fails - 1), tonumber(ARGV[4]))
  cooldown = math.max(cooldown, tonumber(ARGV[2]))
  until_ms = now + cooldown
end
redis.call('HSET', KEYS[1], 'since_ms', int(since), 'until_ms', int(until_ms), 'fails', int(fails),
  'error', ARGV[1])
redis.call('HDEL', KEYS[1], 'probe_ms')
redis.call('SADD', KEYS[2], ARGV[5])
return {int(until_ms), int(since)}
