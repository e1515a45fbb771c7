-- amend.lua: record that a result sink has the new outputs of a delivered batch whose quarantined items
-- were retried (an amendment: docs/design.md "Result sinks and compaction", push/sinks.py).
-- KEYS[1] job   KEYS[2] sink   KEYS[3] sinklate (zset of such batches' seqs)   KEYS[4] batch:<seq>
-- KEYS[5] items:<seq>
-- ARGV[1] seq   ARGV[2] the sink file offset the caller read   ARGV[3] the offset after the amendment
-- (the same when nothing was written)   ARGV[4] the batch's retry count (qr) the amendment carries
-- ARGV[5] now (ms, the caller's clock; only recorded)   ARGV[6] items the amendment delivered
-- Returns {'ok'} | {'gone'}: the batch was superseded by a rewind or is no longer there; dropped from
--         the amendments due, nothing delivered
--       | {'duplicate'}: the seq is not due (a repeat of a call that took effect); nothing written
--       | {'raced', offset}: another deliverer moved the file offset; nothing written
--       | {'changed', status}: the batch is running again (another retry) or its retry count moved
--         since the caller read it; nothing written, the amendment is made again once it commits
--       | {'corrupt'}
-- Invariant: the offset moves only from the value the caller read (compare-and-set), under the file
-- lock the caller holds, as compact.lua's does; a seq leaves the amendments due exactly when the
-- offset moves over its amendment. Once no item of the batch is quarantined any more its record and
-- items go, as compact.lua removes any delivered batch's: the range summary stands for it.
if redis.call('ZSCORE', KEYS[3], ARGV[1]) == false then return {'duplicate'} end
local function drop()
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('HINCRBY', KEYS[2], 'late', -1)
end
local off_now = redis.call('HGET', KEYS[2], 'off') or '0'
if tonumber(off_now) ~= tonumber(ARGV[2]) then return {'raced', off_now} end
local batch = load(KEYS[4])
if batch == false then return {'corrupt'} end
if batch == nil or batch['status'] == 'superseded' then
  drop()
  return {'gone'}
end
if batch['status'] ~= 'completed' or (batch['qr'] or '0') ~= ARGV[4] then
  return {'changed', batch['status']}
end
drop()
redis.call('HSET', KEYS[2], 'off', ARGV[3], 'updated_ms', ARGV[5])
if tonumber(ARGV[6]) > 0 then  -- none when every retried item was quarantined again
  redis.call('HINCRBY', KEYS[2], 'amended', 1)
  redis.call('HINCRBY', KEYS[2], 'amended_items', tonumber(ARGV[6]))
end
if (batch['bq'] or '') == '' then
  redis.call('DEL', KEYS[4], KEYS[5])
else
  save(KEYS[4], batch, {qri = '', qrs = ''})
end
return {'ok'}
