-- rest.lua: shrink the keys of a job at rest whose results are delivered to its sink.
-- KEYS[1] job   KEYS[2] log   KEYS[3..] keys re-encoded at their size: audit, events, sink
-- ARGV[1] log entries to keep (log_at_rest)
-- Returns {'ok'} | {'live', status}: the job runs (or was resumed): nothing done
-- Invariant: no entry of the audit or events streams and no field of any hash is lost: each key is
-- dumped and restored in this one script (its TTL kept), which only drops the slack Redis 6.2 leaves
-- in a stream's 4 KB listpack node or a grown hash. Only the execution log loses entries (its oldest,
-- beyond ARGV[1]), as its cap does while the job runs.
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'succeeded' and status ~= 'failed' and status ~= 'cancelled' then
  return {'live', status or 'missing'}
end
redis.call('XTRIM', KEYS[2], 'MAXLEN', tonumber(ARGV[1]))
for i = 2, #KEYS do
  local payload = redis.call('DUMP', KEYS[i])
  if payload then
    local ttl = redis.call('PTTL', KEYS[i])
    if ttl < 0 then ttl = 0 end
    redis.call('RESTORE', KEYS[i], ttl, payload, 'REPLACE')
  end
end
return {'ok'}
