-- archive.lua: fold a job at rest (its results delivered to its sink) into one compressed value.
-- KEYS[1] job   KEYS[2] spec   KEYS[3] log   KEYS[4] audit   KEYS[5] events   KEYS[6] past
-- ARGV[1] the job record's checksum as the caller read it
-- ARGV[2..4] the last entry id of log, audit, events as read ('' = empty or absent)
-- ARGV[5] sha1 of the past value as read ('' = none)   ARGV[6] the spec's checksum as read ('' = none)
-- ARGV[7] the new past value (zlib JSON, archive.py: the old past's entries, then the streams' as read,
--         and the spec)   ARGV[8] '1' to fold the events stream too (every subscription has had them)
-- Returns {'ok'}: the past holds ARGV[7]; the spec and the folded streams are gone
--       | {'live', status}: the job runs again, nothing done | {'raced'}: something changed since the
--         read (a new entry, a resume, another archiver), nothing done
-- Invariant: a stream entry or spec field leaves its key only in the step that writes the value that
-- holds it, and only if the key holds exactly what the caller read (its last entry id: the streams are
-- append-only and only this script and rest.lua's trim of the log remove entries; the spec's checksum).
-- The past keeps the job's TTL (retention), so it expires with the job's other keys. A repeat of a call
-- that took effect gets its first answer from the call journal (scripts.observed_source).
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'succeeded' and status ~= 'failed' and status ~= 'cancelled' then
  return {'live', status or 'missing'}
end
if redis.call('HGET', KEYS[1], 'checksum') ~= ARGV[1] then return {'raced'} end
local function last_id(key)
  local top = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if #top == 0 then return '' end
  return top[1][1]
end
for i = 3, 5 do
  if last_id(KEYS[i]) ~= ARGV[i - 1] then return {'raced'} end
end
local past = redis.call('GET', KEYS[6])
if (past and redis.sha1hex(past) or '') ~= ARGV[5] then return {'raced'} end
if (redis.call('HGET', KEYS[2], 'checksum') or '') ~= ARGV[6] then return {'raced'} end
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then
  redis.call('SET', KEYS[6], ARGV[7], 'PX', ttl)
else
  redis.call('SET', KEYS[6], ARGV[7])
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
if ARGV[8] == '1' then redis.call('DEL', KEYS[5]) end
return {'ok'}
