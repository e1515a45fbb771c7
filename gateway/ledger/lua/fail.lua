-- fail.lua: a worker reports that its stage attempt failed.
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] leases   KEYS[4] failed   KEYS[5] log
-- KEYS[6..5+S] ready:0..ready:S-1
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] lease token   ARGV[2] message   ARGV[3] '1' retryable / '0' fatal   ARGV[4] maximum attempts
-- ARGV[5] initial interval (ms)   ARGV[6] backoff coefficient   ARGV[7] maximum interval (ms)
-- ARGV[8] jitter in [0,1)   ARGV[9] log maxlen   ARGV[10] budget total   ARGV[11] tolerated failure %
-- ARGV[12] actor   ARGV[13] minimum delay before the retry (ms; Retry-After)
-- ARGV[14] error type ('' = none; e.g. outcome_unknown, shown with the batch and in retry-failed)
-- Bisection (docs/design.md "Bisection"): KEYS[6+S] quarantine   KEYS[7+S] done
-- KEYS[8+S] items:<seq>   KEYS[9+S] approvals   KEYS[10+S] approvals:due   KEYS[11+S..] approval:<seq>.<stage>.1
-- per approval stage (the gates' ``k`` index them)   ARGV[15] bisect: the stage's cap on extra calls
-- per batch, '0' = no bisection (the caller sets it only for a non-transient error of an on_fatal:
-- bisect stage)   ARGV[16] number of stages S   ARGV[17] approval stages (JSON, lib.lua; '' = none)
-- ARGV[18] job id   ARGV[19] tenant
-- Cost (docs/design.md "Cost ledger"): ARGV[20] the call's usage (JSON, lib.lua record_cost; '' = none
-- reported; absent = record no cost: not a platform call)   ARGV[21] the flow's cost budget (JSON; '' =
-- none)   KEYS[#KEYS-1] cost: the job's cost hash, only when ARGV[20] is given
-- Returns {'retry'|'failed'|'split'|'quarantined', attempt, job status[, why the call ran, '1' if its
--         cost paused the job[, items quarantined ('quarantined' only)]]} | {'stale', status, attempt}
--       | {'cancelled'} | {'corrupt'} | {'missing'}
-- Events: 'batch.failed' (failed for good), 'items.quarantined' (items of a bisecting batch set aside).
-- Invariant: only the current lease holder can fail an attempt; a batch out of attempts or with a fatal
-- error fails for good and the failure budget decides the job.
-- Bisection: the attempt failed with a non-transient error on an on_fatal: bisect stage. The piece
-- that ran (the whole batch, or the piece bisection leased) is split in two halves run one after the
-- other (the first half next), or, a single item or past the cap, quarantined. When no piece is left
-- the stage is done for this pass and the batch moves on (lib.lua advance), committed at once when
-- every item of the pass is quarantined.
local function quarantine(batch, bchg, piece, stage, message, now)
  local bq = json_list(bchg['bq'] or batch['bq'])
  local gone = {}
  for _, i in ipairs(piece) do
    bq[#bq + 1] = i
    gone[i] = true
    bchg['qe:' .. i], bchg['qt:' .. i] = message, ARGV[14] or ''
    bchg['qs:' .. i], bchg['qa:' .. i] = stage, int(now)
  end
  table.sort(bq)
  bchg['bq'] = encode_list(bq)
  if (batch['only'] or '') ~= '' then  -- a retry pass: the item leaves it
    local rest = {}
    for _, i in ipairs(json_list(batch['only'])) do
      if not gone[i] then rest[#rest + 1] = i end
    end
    bchg['only'] = encode_list(rest)
  end
end

local function bisect_failed(k, job, batch, cap, nstages)
  local now, seq, stage, message = now_ms(), batch['seq'], batch['stage'], ARGV[2]
  local attempt = batch['attempt']  -- the failed attempt's (the next piece starts again from 0)
  local S = nstages
  local bis = bis_at(batch, stage)
  local pieces = bis and bis.p or {pass_indices(batch)}
  local piece = table.remove(pieces, 1)
  local bx = tonumber(batch['bx'] or '0')
  local bchg = {error = message, lease_token = '', deadline_ms = ''}
  if (ARGV[14] or '') ~= '' or batch['error_type'] then bchg['error_type'] = ARGV[14] or '' end
  local jchg = {updated_ms = int(now)}
  local outcome
  if #piece > 1 and bx + 2 <= cap then
    local half = math.floor(#piece / 2)
    local first, second = {}, {}
    for i = 1, #piece do
      if i <= half then first[#first + 1] = piece[i] else second[#second + 1] = piece[i] end
    end
    table.insert(pieces, 1, second)
    table.insert(pieces, 1, first)
    bchg['bx'] = int(bx + 2)
    outcome = 'split'
  else
    if #piece > 1 then message = message .. ' (bisection cap reached)' end
    quarantine(batch, bchg, piece, stage, message, now)
    jchg['n_quar'] = int(tonumber(job['n_quar'] or '0') + #piece)
    if live(job['status']) and items_over_budget(job, jchg, tonumber(ARGV[11])) then
      jchg['status'] = 'failed'
      jchg['error'] = 'failure budget exceeded: ' .. jchg['n_quar'] .. ' items quarantined'
      jchg['finished_ms'] = int(now)
      jchg['held_reason'] = ''
    end
    outcome = 'quarantined'
  end
  local write = nil
  if #pieces > 0 then
    next_piece(batch, bchg, stage, {p = pieces}, now)
    write = function() redis.call('ZADD', k.ready[tonumber(stage) + 1], now, seq) end
  else
    -- every piece ran: the stage is done for this pass (its output: the parts that passed)
    bchg['bis'] = ''
    bchg['st:' .. stage] = 'completed'
    bchg['out:' .. stage] = merged_output(batch, bchg, stage)
    local view = setmetatable({}, {__index = function(_, name)
      if bchg[name] ~= nil then return bchg[name] end
      return batch[name]
    end})
    local last = tonumber(stage)
    if #pass_indices(view) == 0 then last = S - 1 end  -- nothing left to run: committed now
    local gates = nil
    if (ARGV[17] or '') ~= '' then gates = cjson.decode(ARGV[17]) end
    local kk = {job = k.job, batch = k.batch, items = KEYS[8 + S], leases = k.leases, done = KEYS[7 + S],
      log = k.log, ready = {unpack(KEYS, 6, 5 + S)}, approvals = KEYS[9 + S], due = KEYS[10 + S]}
    local refused, _next
    _next, write, refused = advance(kk, job, batch, bchg, jchg, {now = now, stage = last, nstages = S,
      gates = gates, maxlen = ARGV[9], budget_total = ARGV[10], tolerated_pct = tonumber(ARGV[11]),
      job_id = ARGV[18], tenant = ARGV[19]})
    if refused then return refused end
  end
  local bad = negative_counter(job, jchg)
  if bad then return refuse_corrupt(k.job, k.log, ARGV[9], bad .. ' would go negative bisecting batch ' .. seq) end
  redis.call('ZREM', k.leases, seq)
  write()
  if outcome == 'quarantined' then
    for _, i in ipairs(piece) do redis.call('ZADD', KEYS[6 + S], tonumber(seq), seq .. '.' .. i) end
  end
  save(k.batch, batch, bchg)
  if outcome == 'quarantined' then  -- before the job's own event it may cause (job.failed)
    emit('items.quarantined', int(now), {seq = tonumber(seq), stage = tonumber(stage),
      attempt = tonumber(attempt), items = piece, error = message,
      error_type = (ARGV[14] or '') ~= '' and ARGV[14] or cjson.null,
      job_status = jchg['status'] or job['status']})
  end
  save(k.job, job, jchg)
  log(k.log, ARGV[9], {'event', outcome == 'split' and 'bisected' or 'quarantined', 'seq', seq,
    'stage', stage, 'attempt', attempt, 'items', piece_label(piece), 'error', message,
    'actor', ARGV[12]})
  return {outcome, attempt, jchg['status'] or job['status']}, outcome == 'quarantined' and #piece or nil
end

use_outbox(KEYS[#KEYS])
local batch, refused = leased_batch(KEYS[2], KEYS[1], ARGV[1])
if refused then
  if refused[1] == 'cancelled' then
    log(KEYS[5], ARGV[9], {'event', 'late_answer', 'seq', batch['seq'], 'answer', 'failed',
      'actor', ARGV[12], 'error', 'job cancelled'})
  end
  return refused
end
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
local reason = call_reason(batch)  -- before fail_attempt records this attempt's error
local stage = batch['stage']
local k = {job = KEYS[1], batch = KEYS[2], leases = KEYS[3], failed = KEYS[4], log = KEYS[5],
  ready = {unpack(KEYS, 6)}}

-- the call's cost, counted in this same step, and the answer saying why it ran (given ARGV[20])
local function counted(reply)
  local kind = reply[1]
  if ARGV[20] == nil or (kind ~= 'retry' and kind ~= 'failed' and kind ~= 'split' and kind ~= 'quarantined') then
    return reply
  end
  local paused = record_cost(KEYS[#KEYS - 1], KEYS[1], KEYS[5], ARGV[9], batch, stage, reason, now_ms(),
    ARGV[20], ARGV[21])
  if paused then reply[3] = 'paused' end
  reply[4] = reason
  reply[5] = paused and '1' or '0'
  return reply
end

if tonumber(ARGV[15] or '0') > 0 and ARGV[3] == '0' then
  local reply, quarantined = bisect_failed(k, job, batch, tonumber(ARGV[15]), tonumber(ARGV[16]))
  reply = counted(reply)
  if quarantined then  -- how many items, for the metric (the reply's 6th entry)
    reply[4], reply[5], reply[6] = reply[4] or '', reply[5] or '', int(quarantined)
  end
  return reply
end
local outcome = fail_attempt(k, job, batch, batch['seq'], {now = now_ms(), message = ARGV[2],
  retryable = ARGV[3] == '1', max_attempts = tonumber(ARGV[4]), initial_ms = tonumber(ARGV[5]),
  coef = tonumber(ARGV[6]), max_ms = tonumber(ARGV[7]), jitter = tonumber(ARGV[8]), maxlen = ARGV[9],
  budget_total = ARGV[10], tolerated_pct = tonumber(ARGV[11]), actor = ARGV[12],
  min_delay_ms = tonumber(ARGV[13]), error_type = (ARGV[14] or '') ~= '' and ARGV[14] or nil})
if outcome == 'corrupt' then return {'corrupt'} end
return counted({outcome, batch['attempt'], job['status']})
