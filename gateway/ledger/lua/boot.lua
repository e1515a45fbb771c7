-- boot.lua: the deployment's generation: join it (or start the next one), renew, leave, record that
-- start-up recovery has been decided. One plain hash, no checksum (it is rebuilt by the next start).
-- KEYS[1] boot (hash: gen, gen_ms, decided, claim, claim_until, and m:<member> = liveness deadline ms)
-- ARGV[1] op: 'join' | 'decided' | 'leave'
-- ARGV[2] member id (host|pid|start time|token)   ARGV[3] member lifetime (ms)
-- ARGV[4] decision claim lifetime (ms)   ARGV[5] the generation the caller belongs to ('' = none yet)
-- ARGV[6..] members the caller found dead (same host, process gone): removed before counting
-- Returns (join) {state, gen, gen_ms}: state 'ready' (recovery decided: jobs may run), 'decide' (the
--         caller holds the decision claim: it runs the recovery pass, then calls 'decided'), 'wait'
--         (another member is deciding) | (decided) {'ok'} or {'lost'} (the claim was taken over)
--         | (leave) {'ok'}
-- Invariant: a new generation starts only when no other member is alive (every earlier process
-- stopped or crashed); gen_ms is then taken before any member of the new generation may run a job,
-- and exactly one live member at a time holds the claim to decide its recovery. The very first
-- generation on a ledger has nothing to recover and is decided at once.
local boot = KEYS[1]
local now = now_ms()
local op = ARGV[1]
local me = 'm:' .. ARGV[2]
if op == 'leave' then
  redis.call('HDEL', boot, me)
  return {'ok'}
end
local gen = tonumber(redis.call('HGET', boot, 'gen') or '0')
if op == 'decided' then
  if tostring(gen) == ARGV[5] and redis.call('HGET', boot, 'claim') == ARGV[2] then
    redis.call('HSET', boot, 'decided', gen)
    redis.call('HDEL', boot, 'claim', 'claim_until')
    return {'ok'}
  end
  return {'lost'}
end
for i = 6, #ARGV do redis.call('HDEL', boot, 'm:' .. ARGV[i]) end
local flat = redis.call('HGETALL', boot)
local alive = 0
for i = 1, #flat, 2 do
  local field = flat[i]
  if string.sub(field, 1, 2) == 'm:' and field ~= me then
    if tonumber(flat[i + 1]) < now then redis.call('HDEL', boot, field) else alive = alive + 1 end
  end
end
if gen == 0 then
  gen = 1
  redis.call('HSET', boot, 'gen', gen, 'gen_ms', int(now), 'decided', gen)
elseif ARGV[5] ~= tostring(gen) and alive == 0 then
  -- nobody of the last generation is alive: this is a restart; recovery must be decided again
  gen = gen + 1
  redis.call('HSET', boot, 'gen', gen, 'gen_ms', int(now))
  redis.call('HDEL', boot, 'claim', 'claim_until')
end
redis.call('HSET', boot, me, int(now + tonumber(ARGV[3])))
local gen_ms = redis.call('HGET', boot, 'gen_ms')
if tonumber(redis.call('HGET', boot, 'decided') or '0') == gen then return {'ready', gen, gen_ms} end
local claim = redis.call('HGET', boot, 'claim')
local claim_until = tonumber(redis.call('HGET', boot, 'claim_until') or '0')
if (not claim) or claim == ARGV[2] or claim_until < now then
  redis.call('HSET', boot, 'claim', ARGV[2], 'claim_until', int(now + tonumber(ARGV[4])))
  return {'decide', gen, gen_ms}
end
return {'wait', gen, gen_ms}
