-- qretry.lua: run quarantined items of one committed batch again (docs/design.md "Bisection").
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] quarantine   KEYS[4] log   KEYS[5] audit
-- KEYS[6..5+S] ready:0..ready:S-1   KEYS[#KEYS-2] sink   KEYS[#KEYS-1] sinklate
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] the item indices to retry (JSON list; '' = every quarantined item of the batch)
-- ARGV[2] log maxlen   ARGV[3] actor   ARGV[4] S (number of stages)
-- Returns {'ok', items retried, stage, job status} | {'busy', batch status} (the batch is still running:
--         its quarantined items wait for it to commit) | {'none'} (none of those items is quarantined,
--         or the batch belongs to a plan a resume by cursor replaced)
--       | {'refused', job status} (cancelled) | {'missing'} | {'corrupt'}
-- Invariant: the batch re-opens at the earliest stage any of the items was quarantined at, with one
-- piece per item and 'only' naming them (later stages run those items only); the job's counters move
-- as for a committed batch re-opened (n_done - 1, n_open + 1) and n_quar drops by the items retried;
-- items_done moves when the batch commits again (lib.lua items_done_delta). A job that had ended runs
-- again; the items' quarantine entries go in the same step. A batch its result sink already has (below
-- the sink's cursor) is filed in sinklate, 'qri' naming the items retried since its last amendment,
-- 'qrs' the earliest stage they ran again from, and 'qr' counting its retries: once it commits again
-- the sink gets the items' new outputs as an amendment (push/sinks.py, amend.lua).
use_outbox(KEYS[#KEYS])
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'missing'} end
if job['status'] == 'cancelled' then return {'refused', job['status']} end
local batch = load(KEYS[2])
if batch == false then return {'corrupt'} end
if batch == nil then return {'missing'} end
local bq = json_list(batch['bq'])
if #bq == 0 then return {'none'} end
if batch['status'] ~= 'completed' then return {'busy', batch['status']} end
-- a batch of a plan a rewind left behind (resume by cursor) is not the job's any more
if tonumber(batch['seq']) < tonumber(job['base_seq']) then return {'none'} end
local quarantined = {}
for _, i in ipairs(bq) do quarantined[i] = true end
local want = bq
if ARGV[1] ~= '' then want = cjson.decode(ARGV[1]) end
local chosen, picked, stage = {}, {}, nil
for _, i in ipairs(want) do
  if quarantined[i] and not picked[i] then
    picked[i] = true
    chosen[#chosen + 1] = i
    local s = tonumber(batch['qs:' .. i])
    if stage == nil or s < stage then stage = s end
  end
end
if #chosen == 0 then return {'none'} end
table.sort(chosen)
local now = now_ms()
local seq = batch['seq']
local rest, pieces = {}, {}
for _, i in ipairs(bq) do
  if not picked[i] then rest[#rest + 1] = i end
end
for _, i in ipairs(chosen) do pieces[#pieces + 1] = {i} end
local bchg = {status = 'pending', stage = int(stage), attempt = '0', unspent = '0', lease_token = '',
  deadline_ms = '', ready_ms = int(now), error = '', bq = #rest > 0 and encode_list(rest) or '',
  only = encode_list(chosen), bis = cjson.encode({s = stage, p = pieces})}
bchg['st:' .. stage] = 'pending'
if (batch['handle'] or '') ~= '' then  -- an earlier run is not this retry's
  bchg['handle'] = ''
  bchg['handle_stage'] = ''
end
for _, i in ipairs(chosen) do
  bchg['qe:' .. i], bchg['qt:' .. i], bchg['qs:' .. i], bchg['qa:' .. i] = '', '', '', ''
end
local sink, late = KEYS[#KEYS - 2], KEYS[#KEYS - 1]
local delivered = tonumber(redis.call('HGET', sink, 'seq') or '0') > tonumber(seq)
if delivered then
  local owed, seen = json_list(batch['qri']), {}
  for _, i in ipairs(owed) do seen[i] = true end
  for _, i in ipairs(chosen) do
    if not seen[i] then owed[#owed + 1] = i end
  end
  table.sort(owed)
  bchg['qri'] = encode_list(owed)
  bchg['qr'] = int(tonumber(batch['qr'] or '0') + 1)
  local from = tonumber(batch['qrs'] or '') or stage  -- the earliest stage the amendment reports
  bchg['qrs'] = int(math.min(from, stage))
end
local jchg = {n_done = int(tonumber(job['n_done']) - 1), n_open = int(tonumber(job['n_open']) + 1),
  n_quar = int(tonumber(job['n_quar'] or '0') - #chosen), updated_ms = int(now)}
if not live(job['status']) then
  jchg['status'] = 'running'
  jchg['finished_ms'] = ''
  jchg['error'] = ''
end
local bad = negative_counter(job, jchg)
if bad or tonumber(jchg['n_quar']) < 0 then
  return refuse_corrupt(KEYS[1], KEYS[4], ARGV[2], (bad or 'n_quar') .. ' would go negative retrying quarantined items of batch ' .. seq)
end
local members = {}
for _, i in ipairs(chosen) do members[#members + 1] = seq .. '.' .. i end
redis.call('ZREM', KEYS[3], unpack(members))
if delivered and redis.call('ZADD', late, tonumber(seq), seq) == 1 then
  redis.call('HINCRBY', sink, 'late', 1)
end
redis.call('ZADD', KEYS[6 + stage], now, seq)
save(KEYS[2], batch, bchg)
save(KEYS[1], job, jchg)
local label = piece_label(chosen)
log(KEYS[4], ARGV[2], {'event', 'quarantine_retried', 'seq', seq, 'stage', int(stage), 'items', label,
  'actor', ARGV[3]})
audit(KEYS[5], {'event', 'quarantine_retried', 'seq', seq, 'items', label, 'actor', ARGV[3],
  'from', job['status']})
return {'ok', int(#chosen), int(stage), jchg['status'] or job['status']}
