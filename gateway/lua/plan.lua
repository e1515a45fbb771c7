-- plan.lua: create the next batch of a job at its frontier cursor (lazy planning).
-- KEYS[1] job hash   KEYS[2] batch:<seq> hash   KEYS[3] items:<seq>   KEYS[4] ready:0   KEYS[5] log
-- ARGV[1] expected next_seq        ARGV[2] expected frontier (JSON)   ARGV[3] end cursor (JSON, '' if
--         the first stage will yield it)   ARGV[4] '1' if the source is exhausted after this batch
-- ARGV[5] items (JSON list, '' if the first stage fetches them)   ARGV[6] item count
-- ARGV[7] log maxlen   ARGV[8] budget total (batches)   ARGV[9] tolerated failure %
-- Returns {'ok', seq} | {'exhausted'} | {'raced'} | {'status', <job status>} | {'corrupt'}
-- Invariant: a batch's start cursor is recorded (and the frontier moved) before anyone can lease it;
-- a compare-and-set on next_seq and frontier keeps two planners from cutting the same range twice.
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'status', 'missing'} end
if job['status'] ~= 'running' then return {'status', job['status']} end
if job['next_seq'] ~= ARGV[1] or job['frontier'] ~= ARGV[2] or job['exhausted'] == '1'
    or job['blocked'] ~= '' then
  return {'raced'}
end
local now = now_ms()
local seq = ARGV[1]
local n_items = tonumber(ARGV[6])
if n_items == 0 and ARGV[4] == '1' and ARGV[3] ~= '' then
  local chg = {exhausted = '1', updated_ms = int(now)}
  finish_changes(job, chg, now, ARGV[8], tonumber(ARGV[9]))
  save(KEYS[1], job, chg)
  log(KEYS[5], ARGV[7], {'event', 'source_exhausted', 'seq', seq})
  return {'exhausted'}
end
local batch = {}
save(KEYS[2], batch, {seq = seq, status = 'pending', stage = '0', attempt = '0',
  start_cursor = ARGV[2], end_cursor = ARGV[3], n_items = int(n_items), lease_token = '',
  deadline_ms = '', error = ''})
if ARGV[5] ~= '' then redis.call('SET', KEYS[3], ARGV[5]) end
redis.call('ZADD', KEYS[4], now, seq)
local chg = {next_seq = int(tonumber(seq) + 1), n_open = int(tonumber(job['n_open']) + 1),
  updated_ms = int(now)}
if (job['src_failures'] or '0') ~= '0' then
  chg['src_failures'] = '0'
  chg['src_error'] = ''
end
if ARGV[3] == '' then
  chg['blocked'] = seq
else
  chg['frontier'] = ARGV[3]
  chg['exhausted'] = ARGV[4]
end
save(KEYS[1], job, chg)
log(KEYS[5], ARGV[7], {'event', 'planned', 'seq', seq, 'items', int(n_items), 'cursor', ARGV[2]})
return {'ok', seq}
