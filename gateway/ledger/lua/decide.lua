-- decide.lua: record a person's (or the timeout's) decision on an approval and act on it, in one step.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] approval:<seq>.<stage>.<round>   KEYS[4] approvals
-- KEYS[5] approvals:due   KEYS[6] items:<seq>   KEYS[7] leases   KEYS[8] done   KEYS[9] failed
-- KEYS[10] log   KEYS[11..10+S] ready:0..ready:S-1
-- KEYS[11+S..] approval:<seq>.<stage>.1 for each approval stage (the gates' ``k`` index them)
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] decision: approve | reject | fail (reject, and the job fails: on_timeout fail)
-- ARGV[2] actor   ARGV[3] comment   ARGV[4] edited output (JSON; '' = the shown one)
-- ARGV[5] 'timeout' (only once the deadline passed) | 'person' | 'void' (only record the approval void if
-- its batch no longer waits on it; else {'live'})   ARGV[6] number of stages S
-- ARGV[7] log maxlen   ARGV[8] budget total   ARGV[9] tolerated failure %
-- ARGV[10] the flow's approval stages (JSON gates, lib.lua; '' = none)   ARGV[11] job id   ARGV[12] tenant
-- Returns {'ok', status (approved|rejected), job status, next approval id opened ('')}
--       | {'decided', status, decision, actor, decided_ms}  (decided before: nothing changes)
--       | {'void', batch status} (the batch no longer waits on it: re-planned; recorded void)
--       | {'not_due'} | {'live'} | {'cancelled'} | {'held'} | {'missing'} | {'corrupt'}
-- Invariant: an approval is decided at most once and a decided one never changes; approve commits the
-- stage at most once (the batch must be waiting on this very approval) and moves the batch on as a
-- commit does (lib.lua advance); reject fails the batch for good with error type 'rejected' through
-- fail_attempt, so the failure budget decides the job. A platform approval with a run to resume
-- (record 'platform') approved goes back to its stage's ready set without spending an attempt: the
-- next attempt collects the resumed run's answer. A platform record keeps the decision's output
-- (ARGV[4]) as 'output': what the resumer answers the platform's run with.
use_outbox(KEYS[#KEYS])
local rec = load(KEYS[3])
if rec == false then return {'corrupt'} end
if rec == nil then return {'missing'} end
if rec['status'] ~= 'pending' then
  return {'decided', rec['status'], rec['decision'], rec['actor'], rec['decided_ms']}
end
local now = now_ms()
if ARGV[5] == 'timeout' and tonumber(rec['deadline_ms']) > now then return {'not_due'} end
local job = load(KEYS[1])
if not job then return {'corrupt'} end
if job['status'] == 'cancelled' then return {'cancelled'} end
if ARGV[5] == 'timeout' and job['status'] == 'held' then return {'held'} end
local batch = load(KEYS[2])
if batch == false then return {'corrupt'} end
local id = rec['id']
local S = tonumber(ARGV[6])
if not batch or batch['status'] ~= 'waiting_human' or batch['approval'] ~= id then
  save(KEYS[3], rec, {status = 'void', decided_ms = int(now), actor = ARGV[2]})
  redis.call('ZREM', KEYS[5], id)
  return {'void', batch and batch['status'] or 'missing'}
end
if ARGV[5] == 'void' then return {'live'} end  -- the supervisor's clean-up decides nothing that waits
local decision = ARGV[1]
local seq = batch['seq']
local stage = tonumber(batch['stage'])
local rchg = {status = decision == 'approve' and 'approved' or 'rejected',
  decision = decision == 'approve' and 'approve' or 'reject', actor = ARGV[2], comment = ARGV[3],
  decided_ms = int(now), edited = ARGV[4] ~= '' and '1' or ''}
if rec['platform'] ~= '' then rchg['output'] = ARGV[4] end  -- the person's answer, for the resumer
local jchg = {updated_ms = int(now), n_waiting = int(n_waiting(job, {}) - 1)}
local bchg = {approval = ''}
local k = {job = KEYS[1], batch = KEYS[2], items = KEYS[6], leases = KEYS[7], done = KEYS[8],
  failed = KEYS[9], log = KEYS[10], ready = {unpack(KEYS, 11, 10 + S)}, approvals = KEYS[4],
  due = KEYS[5]}
local next_id = ''
local after = function() end
if decision == 'approve' and rec['platform'] ~= '' then
  -- the platform's run waits for this answer: the resumer (Python) continues it; the batch is ready
  -- at its stage again, and the next attempt asks the run for its outcome (the handle is kept)
  bchg['status'] = 'pending'
  bchg['ready_ms'] = int(now)
  bchg['unspent'] = int(tonumber(batch['unspent'] or '0') + 1)
  bchg['st:' .. stage] = 'pending'
  settle_waiting(job, jchg)
  after = function() redis.call('ZADD', k.ready[stage + 1], now, seq) end
elseif decision == 'approve' then
  local output = ARGV[4]
  if output == '' then
    if rec['show'] ~= '' then output = batch['out:' .. rec['show']] or 'null'
    elseif rec['prompt'] ~= '' then output = rec['prompt']
    else output = batch['out:' .. (stage - 1)] or 'null' end
  end
  bchg['out:' .. stage] = output
  bchg['st:' .. stage] = 'completed'
  bchg['c:' .. stage] = batch['attempt'] .. ' approval:' .. id
  local gates = nil
  if ARGV[10] ~= '' then gates = cjson.decode(ARGV[10]) end
  local next_stage, write, refused = advance(k, job, batch, bchg, jchg, {now = now, stage = stage,
    nstages = S, gates = gates, maxlen = ARGV[7], budget_total = ARGV[8],
    tolerated_pct = tonumber(ARGV[9]), job_id = ARGV[11], tenant = ARGV[12]})
  if refused then return refused end
  local bad = negative_counter(job, jchg)
  if bad then return refuse_corrupt(KEYS[1], KEYS[10], ARGV[7], bad .. ' would go negative deciding ' .. id) end
  after = write
  next_id = bchg['approval']
  log(KEYS[10], ARGV[7], {'event', 'stage_completed', 'seq', seq, 'stage', int(stage), 'attempt',
    batch['attempt'], 'approval', id, 'actor', ARGV[2]})
else
  local why = 'rejected by ' .. ARGV[2]
  if ARGV[5] == 'timeout' then why = 'approval timed out (on_timeout: ' .. decision .. ')' end
  if ARGV[3] ~= '' then why = why .. ': ' .. ARGV[3] end
  if decision == 'fail' and live(job['status']) then  -- on_timeout fail: the job fails with the batch
    jchg['status'] = 'failed'
    jchg['error'] = 'approval ' .. id .. ' timed out (on_timeout: fail)'
    jchg['finished_ms'] = int(now)
    jchg['held_reason'] = ''
  end
  local outcome = fail_attempt(k, job, batch, seq, {now = now, message = string.sub(why, 1, 2000),
    retryable = false, error_type = 'rejected', max_attempts = 1, initial_ms = 0, coef = 1, max_ms = 0,
    jitter = 0, maxlen = ARGV[7], budget_total = ARGV[8], tolerated_pct = tonumber(ARGV[9]),
    actor = ARGV[2], bchg = bchg, jchg = jchg})
  if outcome == 'corrupt' then return {'corrupt'} end
end
if decision == 'approve' then
  after()
  save(KEYS[2], batch, bchg)
  save(KEYS[1], job, jchg)
end
save(KEYS[3], rec, rchg)
redis.call('ZREM', KEYS[5], id)
emit('approval.decided', int(now), {approval_id = id, seq = tonumber(seq), stage = rec['stage_name'],
  stage_index = stage, kind = rec['kind'], decision = rchg['decision'], status = rchg['status'],
  actor = ARGV[2], comment = ARGV[3], edited = rchg['edited'] == '1', timed_out = ARGV[5] == 'timeout',
  job_status = job['status']})
log(KEYS[10], ARGV[7], {'event', 'approval_decided', 'seq', seq, 'stage', int(stage), 'approval', id,
  'decision', rchg['decision'], 'actor', ARGV[2]})
return {'ok', rchg['status'], job['status'], next_id or ''}
