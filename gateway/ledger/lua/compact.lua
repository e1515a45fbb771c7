-- compact.lua: record a result sink's delivery and fold the delivered batch records into range summaries.
-- KEYS[1] job   KEYS[2] sink (hash: the delivery cursor and the range summaries)
-- KEYS[3..2+N] batch:<seq> for seq = ARGV[1] .. ARGV[3]-1 (N = ARGV[3] - ARGV[1])
-- KEYS[3+N..2+2N] items:<seq> for the same seqs
-- ARGV[1] the sink cursor the caller read (next seq to deliver)   ARGV[2] the file offset it read
-- ARGV[3] the new sink cursor (every seq below it is delivered)   ARGV[4] the new file offset
-- ARGV[5] now (ms, the caller's clock; only recorded)
-- Returns {'ok', seq, offset}: the cursor moved and the records below it are summaries now
--       | {'duplicate', seq, offset}: a repeat of a call that already took effect (the cursor is at or
--         past ARGV[3]): nothing written, the cursor as it is
--       | {'raced', seq, offset}: another deliverer moved the cursor elsewhere; nothing written
--       | {'above_watermark', wm} | {'missing', seq} | {'corrupt', seq} | {'open', seq, status}
-- Invariant: a batch record is removed only when it is below the job's watermark (committed for good,
-- or superseded by a rewind) and below the sink cursor this same script moves, i.e. delivered. The
-- cursor moves only from the value the caller read (compare-and-set), so two deliverers never both
-- record one range, and a deliverer that lost its claim records nothing. Every check comes before the
-- first write. A batch with quarantined items (field bq, bisection) is delivered (its good items'
-- outputs) and counted in its range, but its record and items key stay: the quarantine listing and a
-- retry of its items read them. Range summaries: one per contiguous run of seqs of one generation, in the sink hash as
-- field 'r:<first seq>' = JSON {first, last, gen, cursor, end_cursor, batches, items, superseded}
-- ('rlast' names the last one's first seq); a new run that continues the last one (same generation,
-- next seq) is merged into it. (A hash field, not a zset member: a one-member zset costs 990 bytes.)
local function sink_cursor()
  local got = redis.call('HMGET', KEYS[2], 'seq', 'off')
  return tonumber(got[1] or '0'), tonumber(got[2] or '0')
end
local from, to = tonumber(ARGV[1]), tonumber(ARGV[3])
local seq_now, off_now = sink_cursor()
if seq_now ~= from or off_now ~= tonumber(ARGV[2]) then
  if seq_now >= to then return {'duplicate', int(seq_now), int(off_now)} end
  return {'raced', int(seq_now), int(off_now)}
end
local wm = tonumber(redis.call('HGET', KEYS[1], 'wm') or '0')
if to > wm then return {'above_watermark', int(wm)} end
local n = to - from
-- read and check every record first
local runs = {}
local run = nil
local keep = {}  -- batches with quarantined items keep their record (docs/design.md "Bisection")
local delivered, items = 0, 0
for i = 0, n - 1 do
  local batch = load(KEYS[3 + i])
  local seq = from + i
  if batch == nil then return {'missing', int(seq)} end
  if batch == false then return {'corrupt', int(seq)} end
  local status = batch['status']
  if status ~= 'completed' and status ~= 'superseded' then return {'open', int(seq), status} end
  if (batch['bq'] or '') ~= '' then keep[i] = true end
  local gen = batch['gen'] or '0'
  if run == nil or run.gen ~= gen then
    run = {first = seq, last = seq, gen = gen, cursor = cjson.null, end_cursor = cjson.null,
      batches = 0, items = 0, superseded = 0, started = false}
    runs[#runs + 1] = run
  end
  run.last = seq
  if status == 'completed' then
    if not run.started then
      run.cursor = cjson.decode(batch['start_cursor'] or 'null')
      run.started = true
    end
    run.end_cursor = cjson.decode(batch['end_cursor'] ~= '' and batch['end_cursor'] or 'null')
    run.batches = run.batches + 1
    run.items = run.items + tonumber(batch['n_items'] or '0')
    delivered, items = delivered + 1, items + tonumber(batch['n_items'] or '0')
  else
    run.superseded = run.superseded + 1
  end
end
-- merge the first run into the last summary when it continues it
local rlast = redis.call('HGET', KEYS[2], 'rlast')
local last = rlast and redis.call('HGET', KEYS[2], 'r:' .. rlast)
if #runs > 0 and last then
  local prev = cjson.decode(last)
  local head = runs[1]
  if prev.last + 1 == head.first and tostring(prev.gen) == head.gen then
    head.first = prev.first
    if prev.batches > 0 then head.cursor = prev.cursor end
    if head.batches == 0 then head.end_cursor = prev.end_cursor end
    head.batches = head.batches + prev.batches
    head.items = head.items + prev.items
    head.superseded = head.superseded + prev.superseded
  end
end
-- writes
for _, r in ipairs(runs) do
  r.started = nil
  redis.call('HSET', KEYS[2], 'r:' .. int(r.first), cjson.encode(r), 'rlast', int(r.first))
end
for i = 0, n - 1 do
  if not keep[i] then redis.call('DEL', KEYS[3 + i], KEYS[3 + n + i]) end
end
redis.call('HSET', KEYS[2], 'seq', int(to), 'off', ARGV[4], 'updated_ms', ARGV[5])
redis.call('HINCRBY', KEYS[2], 'batches', delivered)
redis.call('HINCRBY', KEYS[2], 'items', items)
return {'ok', int(to), ARGV[4]}
