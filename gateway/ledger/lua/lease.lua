-- lease.lua: hand the next ready batch stage of a job to a worker in one round trip; when nothing is
-- ready and a new batch may be cut, take the job's plan lock instead and say where to read.
-- KEYS[1] job   KEYS[2] leases   KEYS[3] log   KEYS[4] failed   KEYS[5] planlock   KEYS[6] src
-- KEYS[7..6+N] ready:<stage> of the N offered stages, in the order of ARGV[10..]
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] new lease token   ARGV[2] concurrency   ARGV[3] log maxlen   ARGV[4] budget total (batches)
-- ARGV[5] tolerated failure %   ARGV[6] plan lock holder ('' = never plan: the first stage is not offered)
-- ARGV[7] plan lock lifetime (ms)   ARGV[8] inline read-ahead: items of src to return from the frontier's
--         offset (0 = none)   ARGV[9] N   ARGV[10..9+2N] (stage, lease length ms) pairs, latest stage first
-- Optional, a pull request's lease quota (one Redis only: the tenant's key is in another slot on a
-- cluster, where the API asks quota.lua first): ARGV[10+2N] requests per period, ARGV[11+2N] period (ms),
-- KEYS[7+N] the tenant's rate key. Counted first, whatever the answer (as POST /lease counts every
-- request); a repeat of the call is answered from the journal, so a request is counted once.
-- Returns {'ok', seq, stage, attempt, deadline_ms, start_cursor, end_cursor, items, input, generation
--         [, piece: JSON list of the item indices to run; absent = all (docs/design.md "Bisection")]}
--       | {'plan', next_seq, frontier, src length, src items...}  (the caller holds the plan lock now)
--       | {'planning'} (another caller holds the plan lock: its batches come soon)
--       | {'source_wait', retry_at_ms, error} (the source failed; not before retry_at)
--       | {'none'} (nothing ready, nothing to plan) | {'busy'} (concurrency reached)
--       | {'status', s} | {'corrupt', 'job'} | {'rate', wait_ms} (the lease quota refused: nothing done)
-- Invariant: one batch stage is leased to at most one holder; the attempt (fencing token) rises by one
-- per lease; at most <concurrency> batches of a job are leased at once; only a running job leases; a
-- corrupt job record refuses, a corrupt batch is never run (it counts as failed for good). The ready set
-- is read here, in the same script that leases, so there is no lost race to retry.
-- Key names: the batch:<seq> and items:<seq> keys of the candidates are built here from KEYS[1] (the job
-- key, '<prefix>:{<job>}:job'), since which seqs are ready is only known inside the script. They carry
-- the job's hash tag, so they live in KEYS[1]'s slot (Redis Cluster serves undeclared keys of the
-- script's own slot; see docs/design.md).
use_outbox(KEYS[#KEYS])
local quota = ARGV[10 + 2 * tonumber(ARGV[9])]
if quota then
  local qkey, qnow = KEYS[7 + tonumber(ARGV[9])], now_ms()
  local wait, new_tat = gcra_wait(qkey, tonumber(quota), tonumber(ARGV[11 + 2 * tonumber(ARGV[9])]), qnow)
  if wait then return {'rate', int(wait)} end
  gcra_take(qkey, new_tat, qnow)
end
local job = load(KEYS[1])
if job == false then return {'corrupt', 'job'} end
if job == nil then return {'status', 'missing'} end
if job['status'] ~= 'running' then return {'status', job['status']} end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[2]) then return {'busy'} end
local base = string.sub(KEYS[1], 1, -5)
if string.sub(KEYS[1], -4) ~= ':job' then return redis.error_reply('KEYS[1] is not a job key') end
local now = now_ms()
local nstages = tonumber(ARGV[9])
for s = 1, nstages do
  local stage = ARGV[8 + 2 * s]
  local lease_ms = tonumber(ARGV[9 + 2 * s])
  local ready = KEYS[6 + s]
  while true do
    local cands = redis.call('ZRANGEBYSCORE', ready, '-inf', now, 'LIMIT', 0, 8)
    if #cands == 0 then break end
    for _, seq in ipairs(cands) do
      local bkey = base .. ':batch:' .. seq
      local batch = load(bkey)
      if not batch then
        -- Corrupt (or vanished) batch: never run it; it counts as a failed batch.
        local chg = {updated_ms = int(now)}
        failed_for_good(job, chg, seq, now, ARGV[4], tonumber(ARGV[5]))
        local bad = negative_counter(job, chg)
        if bad then return refuse_corrupt(KEYS[1], KEYS[3], ARGV[3], bad .. ' would go negative at corrupt batch ' .. seq) end
        redis.call('ZREM', ready, seq)
        redis.call('ZADD', KEYS[4], seq, seq)
        emit('batch.failed', int(now), {seq = tonumber(seq), stage = tonumber(stage), attempt = cjson.null,
          error = 'checksum mismatch', error_type = 'corrupt', job_status = chg['status'] or job['status']})
        save(KEYS[1], job, chg)
        log(KEYS[3], ARGV[3], {'event', 'batch_corrupt', 'seq', seq, 'error', 'checksum mismatch'})
        if job['status'] ~= 'running' then return {'status', job['status']} end
      elseif batch['status'] ~= 'pending' or batch['stage'] ~= stage then
        redis.call('ZREM', ready, seq)
      else
        local attempt = tonumber(batch['attempt']) + 1
        local deadline = now + lease_ms
        local chg = {status = 'leased', attempt = int(attempt), lease_token = ARGV[1],
          leased_ms = int(now), deadline_ms = int(deadline)}
        chg['st:' .. stage] = 'running'
        save(bkey, batch, chg)
        redis.call('ZREM', ready, seq)
        redis.call('ZADD', KEYS[2], deadline, seq)
        log(KEYS[3], ARGV[3], {'event', 'stage_started', 'seq', seq, 'stage', stage, 'attempt', int(attempt)})
        local items = redis.call('GET', base .. ':items:' .. seq) or ''
        local input = batch['out:' .. (tonumber(stage) - 1)] or ''
        local reply = {'ok', seq, stage, int(attempt), int(deadline), batch['start_cursor'],
          batch['end_cursor'], items, input, batch['gen'] or '0'}
        local piece = selection(batch, stage)  -- Bisection: the items this lease runs
        if piece then reply[11] = encode_list(piece) end
        return reply
      end
    end
  end
end
-- nothing ready: may this caller cut the next batch?
if ARGV[6] == '' or job['exhausted'] == '1' or job['blocked'] ~= '' then return {'none'} end
local retry_at = tonumber(job['src_retry_ms'] or '0')
if retry_at > now then return {'source_wait', int(retry_at), job['src_error'] or ''} end
if not redis.call('SET', KEYS[5], ARGV[6], 'NX', 'PX', ARGV[7]) then return {'planning'} end
local reply = {'plan', job['next_seq'], job['frontier']}
local ahead = tonumber(ARGV[8])
if ahead > 0 then
  local ok, cursor = pcall(cjson.decode, job['frontier'])
  if ok and type(cursor) == 'table' and type(cursor['offset']) == 'number' then
    reply[4] = redis.call('LLEN', KEYS[6])
    local window = redis.call('LRANGE', KEYS[6], cursor['offset'], cursor['offset'] + ahead - 1)
    for i = 1, #window do reply[4 + i] = window[i] end
  end
end
return reply
