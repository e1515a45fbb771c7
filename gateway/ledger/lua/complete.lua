-- complete.lua: commit one stage of one batch, in one round trip.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] items:<seq>   KEYS[4] leases   KEYS[5] done   KEYS[6] log
-- KEYS[7..6+S] ready:0..ready:S-1   KEYS[7+S] approvals   KEYS[8+S] approvals:due
-- KEYS[9+S..] approval:<seq>.<stage>.1 for each approval stage (the gates' ``k`` index them)
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- KEYS[#KEYS-1] cost: the job's cost hash, only when ARGV[15] is given
-- ARGV[1] lease token   ARGV[2] output (JSON)   ARGV[3] next cursor (JSON; '' = none given)
-- ARGV[4] items fetched by this stage (JSON list; '' = none)   ARGV[5] item count of ARGV[4]
-- ARGV[6] number of stages   ARGV[7] log maxlen   ARGV[8] budget total   ARGV[9] tolerated failure %
-- ARGV[10] '1' if ARGV[4] was taken from the output's "items" (ignored unless this is the fetch stage)
-- ARGV[11] actor (for the log of a late answer)   ARGV[12] the flow's approval stages (JSON map stage
-- index -> gate, lib.lua; '' = none)   ARGV[13] job id   ARGV[14] tenant
-- ARGV[15] the call's usage (JSON, lib.lua record_cost; '' = none reported; absent = record no cost)
-- ARGV[16] the flow's cost budget (JSON; '' = none)
-- A committed call is counted in the cost hash in this same step (record_cost); a budget it passes pauses
-- the job (the reply's status says so).
-- A batch whose next stage is an approval stage waits there (status waiting_human) with its approval
-- opened here, in the same step as the commit (lib.lua advance, open_approval).
-- A batch that runs in pieces (docs/design.md "Bisection") keeps each piece's output as a part; while
-- pieces are left it goes back to its stage's ready set and next_stage is this stage.
-- Returns {'ok', next_stage (-1 = batch committed), job status, attempt, stage[, approval id opened or ''
--   [, why the call ran (call_reason), '1' if its cost paused the job else '0'] (given ARGV[15])]}
--       | {'duplicate', stage, attempt}  (the same lease already committed this stage)
--       | {'stale', status, attempt} | {'cancelled'} | {'corrupt', why?} | {'missing'} | {'invalid', message}
-- Invariant 1: a stage result is committed at most once. The fencing token is checked, the output
-- stored, the stage or the low watermark advanced and the log appended, all here. A cancelled job
-- takes no answer (it goes to the log as late_answer). Every change is computed and its counters
-- checked before the first write.
use_outbox(KEYS[#KEYS])
local batch = load(KEYS[2])
if batch == false then return {'corrupt'} end
if batch == nil then return {'missing'} end
local token = ARGV[1]
if batch['status'] ~= 'leased' or batch['lease_token'] ~= token then
  for i = 0, tonumber(ARGV[6]) - 1 do
    local committed = batch['c:' .. i]
    if committed and string.sub(committed, -#token - 1) == ' ' .. token then
      return {'duplicate', int(i), string.match(committed, '^(%d+)')}
    end
  end
  if redis.call('HGET', KEYS[1], 'status') == 'cancelled' then
    log(KEYS[6], ARGV[7], {'event', 'late_answer', 'seq', batch['seq'], 'stage', batch['stage'],
      'answer', 'completed', 'actor', ARGV[11], 'error', 'job cancelled'})
    return {'cancelled'}
  end
  return {'stale', batch['status'], batch['attempt']}
end
local items = ARGV[4]
if items ~= '' and batch['stage'] ~= '0' then
  if ARGV[10] ~= '1' then return {'invalid', 'only the first (fetching) stage may send items'} end
  items = ''
end
local now = now_ms()
local seq = batch['seq']
local attempt = batch['attempt']
local stage = tonumber(batch['stage'])
local reason = call_reason(batch)  -- before the writes below move the batch on
local nstages = tonumber(ARGV[6])
local gates = nil
if (ARGV[12] or '') ~= '' then gates = cjson.decode(ARGV[12]) end
local sets_cursor = ARGV[3] ~= '' and batch['end_cursor'] == ''
local gated = gates ~= nil and gates[tostring(stage + 1)] ~= nil
-- the job record changes only when the batch is committed, waits for a person, or its fetch stage
-- moves the frontier
local job, jchg = nil, nil
if stage + 1 >= nstages or sets_cursor or gated then
  job = load(KEYS[1])
  if not job then return {'corrupt'} end
  jchg = {updated_ms = int(now)}
end
-- status leaves 'leased' below, which voids the token; the committing token is kept for duplicates
local bchg = {}
if batch['error'] ~= '' then bchg['error'] = '' end
bchg['out:' .. stage] = ARGV[2]
bchg['st:' .. stage] = 'completed'
bchg['c:' .. stage] = attempt .. ' ' .. token
if items ~= '' then bchg['n_items'] = ARGV[5] end
if sets_cursor then
  bchg['end_cursor'] = ARGV[3]
  if job['blocked'] == seq then
    jchg['blocked'] = ''
    if ARGV[3] == 'null' then jchg['exhausted'] = '1' else jchg['frontier'] = ARGV[3] end
  end
end
-- Bisection (docs/design.md "Bisection"): a piece of the batch, or the items of a pass that left some
-- quarantined, answered; its output is kept as a part, the next piece is leased afresh, and once none is
-- left the stage's output is the parts together
local piece = selection(batch, stage)
if piece then
  bchg['out:' .. stage] = nil
  add_part(batch, bchg, stage, piece, ARGV[2])
  local bis = bis_at(batch, stage)
  if bis and #bis.p > 1 then
    table.remove(bis.p, 1)
    next_piece(batch, bchg, stage, bis, now)
    redis.call('ZREM', KEYS[4], seq)
    redis.call('ZADD', KEYS[7 + stage], now, seq)
    save(KEYS[2], batch, bchg)
    log(KEYS[6], ARGV[7], {'event', 'piece_completed', 'seq', seq, 'stage', int(stage),
      'attempt', attempt, 'items', piece_label(piece)})
    return {'ok', int(stage), redis.call('HGET', KEYS[1], 'status') or 'missing', attempt, int(stage)}
  end
  if bis then bchg['bis'] = '' end
  bchg['out:' .. stage] = merged_output(batch, bchg, stage)
end
local S = nstages
local k = {job = KEYS[1], batch = KEYS[2], items = KEYS[3], leases = KEYS[4], done = KEYS[5],
  log = KEYS[6], ready = {unpack(KEYS, 7, 6 + S)}, approvals = KEYS[7 + S], due = KEYS[8 + S]}
local next_stage, write, refused = advance(k, job, batch, bchg, jchg, {now = now, stage = stage,
  nstages = nstages, gates = gates, maxlen = ARGV[7], budget_total = ARGV[8],
  tolerated_pct = tonumber(ARGV[9]), job_id = ARGV[13], tenant = ARGV[14]})
if refused then return refused end
-- writes
redis.call('ZREM', KEYS[4], seq)
if items ~= '' then redis.call('SET', KEYS[3], items) end
write()
save(KEYS[2], batch, bchg)
if job then save(KEYS[1], job, jchg) end
log(KEYS[6], ARGV[7], {'event', 'stage_completed', 'seq', seq, 'stage', int(stage),
  'attempt', attempt, 'duration_ms', int(now - tonumber(batch['leased_ms']))})
local budget_paused = nil
if ARGV[15] ~= nil then
  budget_paused = record_cost(KEYS[#KEYS - 1], KEYS[1], KEYS[6], ARGV[7], batch, int(stage), reason, now,
    ARGV[15], ARGV[16])
end
-- the job's status as it is now (read, not assumed, when the job record was not loaded: a pause
-- between lease and answer must show in the answer and the log)
local status = job and job['status'] or redis.call('HGET', KEYS[1], 'status') or 'missing'
if budget_paused then status = 'paused' end
local reply = {'ok', int(next_stage), status, attempt, int(stage)}
if bchg['approval'] then reply[6] = bchg['approval'] end
if ARGV[15] ~= nil then  -- why the call ran, and '1' when its cost paused the job
  reply[6], reply[7], reply[8] = reply[6] or '', reason, budget_paused and '1' or '0'
end
return reply
