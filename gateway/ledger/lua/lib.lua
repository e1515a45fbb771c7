-- lib.lua: helpers prepended to every ledger script (Redis 6.2 has no shared functions).
-- Touches only keys its callers pass in; builds no key names.

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function int(n)
  return string.format('%d', n)
end

-- Checksum of a record: sha1 over its 'name NUL value' entries in sorted order, joined by NUL;
-- 'checksum' and 'corrupt' excluded. gateway/records.py computes the same digest in Python.
-- seal(map) answers the digest with what it was made of: the sorted names and, beside them, the flat
-- list name1, value1, name2, value2, ... that table.concat joins with NUL into exactly those entries
-- (no string is built per entry: a record's load makes no garbage beyond its table). Sorting the
-- names sorts the entries the same way: a name ends at its NUL, and Lua compares strings NUL segment
-- by NUL segment.
local function seal(map)
  local names = {}
  for name in pairs(map) do
    if name ~= 'checksum' and name ~= 'corrupt' then names[#names + 1] = name end
  end
  table.sort(names)
  local flat = {}
  for i = 1, #names do
    flat[2 * i - 1] = names[i]
    flat[2 * i] = map[names[i]]
  end
  return redis.sha1hex(table.concat(flat, '\0')), {names = names, flat = flat}
end

local function digest(map)
  return (seal(map))
end

-- Records this script loaded, by key: the map load returned and its seal. load answers a record loaded
-- before from here (every write to a record goes through save, which keeps map and seal current, or
-- marks it corrupt, which drops it from here), and save re-seals only the entries it changes.
local LOADED = {}

-- Load a hash as a table. Returns nil when absent, false when it fails its checksum
-- (the record is then marked corrupt, which keeps it from running).
local function load(key)
  local known = LOADED[key]
  if known then return known.map end
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local map = {}
  for i = 1, #flat, 2 do map[flat[i]] = flat[i + 1] end
  if map['corrupt'] then return false end
  local sum, sealed = seal(map)
  if map['checksum'] ~= sum then
    redis.call('HSET', key, 'corrupt', '1')
    return false
  end
  sealed.map = map
  LOADED[key] = sealed
  return map
end

-- The digest of ``map`` after ``changes`` were applied to it, from its seal where load made one (the
-- changed values replaced, new names put in their sorted place), else from scratch.
local function reseal(key, map, changes)
  local sealed = LOADED[key]
  if not sealed or sealed.map ~= map then
    LOADED[key] = nil  -- a record written whole (new), or from another table: loaded again if needed
    return (seal(map))
  end
  local names, flat = sealed.names, sealed.flat
  for name, value in pairs(changes) do
    if name ~= 'checksum' and name ~= 'corrupt' then
      local lo, hi = 1, #names + 1  -- the first place whose name does not sort before this one
      while lo < hi do
        local mid = math.floor((lo + hi) / 2)
        if names[mid] < name then lo = mid + 1 else hi = mid end
      end
      if names[lo] == name then
        flat[2 * lo] = value
      else
        table.insert(names, lo, name)
        table.insert(flat, 2 * lo - 1, value)
        table.insert(flat, 2 * lo - 1, name)
      end
    end
  end
  return redis.sha1hex(table.concat(flat, '\0'))
end

-- A tenant's rate quota by the generic cell rate algorithm (quota.lua): requests are spaced
-- period/limit ms apart on average, a burst of up to <limit> let through at once. gcra_wait answers
-- nil and the key's next value when a request is let through, else how long to wait (ms); gcra_take
-- counts the request (a refused one is not counted). ``key``: the tenant's rate key (the theoretical
-- arrival time, ms; expires when idle).
local function gcra_wait(key, limit, period, now)
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local new_tat = tat + period / limit
  if new_tat - now > period then return math.ceil(new_tat - now - period), nil end
  return nil, new_tat
end

local function gcra_take(key, new_tat, now)
  redis.call('SET', key, string.format('%.3f', new_tat), 'PX', math.ceil(new_tat - now) + 1)
end

-- The batch record held under ``token``, or the reply for a caller whose lease is not current:
-- {'corrupt'}, {'missing'}, {'cancelled'} (the job was cancelled: its leases are void) or
-- {'stale', batch status, attempt}. Returns (batch, nil) or (nil, reply).
local function leased_batch(batch_key, job_key, token)
  local batch = load(batch_key)
  if batch == false then return nil, {'corrupt'} end
  if batch == nil then return nil, {'missing'} end
  if batch['status'] ~= 'leased' or batch['lease_token'] ~= token then
    if redis.call('HGET', job_key, 'status') == 'cancelled' then return batch, {'cancelled'} end
    return batch, {'stale', batch['status'], batch['attempt']}
  end
  return batch, nil
end

-- The job's event outbox (keys.py ``JobKeys.events``). A script that may change the job's status names
-- it with use_outbox(KEYS[n]) before its first write; save() then appends the event in the same step
-- as the status it reports, so an event exists exactly when its state change committed.
local OUTBOX = nil
local function use_outbox(key) OUTBOX = key end

-- Job statuses a subscriber can hear of, by event type (docs/design.md "Event webhooks").
local JOB_EVENTS = {succeeded = 'job.succeeded', failed = 'job.failed', cancelled = 'job.cancelled',
  paused = 'job.paused'}

-- The outbox entry for a job record (it has 'n_open'; a batch has not) whose status goes from ``old``
-- to map['status']. The event id is '<job_id>:<entry id>' (the deliverer joins them).
local function job_event(map, old)
  local kind = JOB_EVENTS[map['status']]
  if map['n_open'] == nil or kind == nil or map['status'] == old then return nil end
  if OUTBOX == nil then error('ledger script changed a job status without its outbox key') end
  return {'type', kind, 'status', map['status'], 'from', old or '', 'at_ms', map['updated_ms'] or '',
    'n_done', map['n_done'], 'n_failed', map['n_failed'], 'items_done', map['items_done'],
    'error', map['error'] or ''}
end

-- '1' once this script changed a job record's status (save); scripts.py's wrapper answers it beside the
-- reply, so the job index is filed again only after a script that moved a status (jobindex.py run).
local STATUS_MOVED = '0'

-- Write changed fields and the new checksum in one HSET (and the job's event, see job_event).
local function save(key, map, changes)
  local old = map['status']
  local args = {}
  for name, value in pairs(changes) do
    map[name] = value
    args[#args + 1] = name
    args[#args + 1] = value
  end
  map['checksum'] = nil
  args[#args + 1] = 'checksum'
  args[#args + 1] = reseal(key, map, changes)
  local event = job_event(map, old)
  if map['n_open'] ~= nil and map['status'] ~= old then STATUS_MOVED = '1' end
  redis.call('HSET', key, unpack(args))
  if event then redis.call('XADD', OUTBOX, '*', unpack(event)) end
end

-- Append an event that is not a job status change (batch.failed, approval.requested, approval.decided)
-- to the outbox, in the script whose write it reports. ``data`` is the event's payload (a table, sent
-- as JSON by the deliverer; gateway/ledger/events.py documents each type's fields).
local function emit(kind, at_ms, data)
  if OUTBOX == nil then error('ledger script emitted ' .. kind .. ' without its outbox key') end
  redis.call('XADD', OUTBOX, '*', 'type', kind, 'at_ms', at_ms, 'data', cjson.encode(data))
end

local function log(key, maxlen, fields)
  redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', unpack(fields))
end

-- The audit stream: control events, never trimmed (retention expires it with the job).
local function audit(key, fields)
  redis.call('XADD', key, '*', unpack(fields))
end

-- Counters kept in the job record. Each equals a recount over the batches of the current plan
-- (seqs base_seq .. next_seq-1): n_open = pending or leased, n_done = completed, n_failed = failed,
-- items_done = items of completed batches.
local COUNTERS = {'n_open', 'n_done', 'n_failed', 'items_done'}

-- nil when every counter the job would have after ``changes`` is >= 0, else the name of the first
-- that is not. Scripts call this before their first write: a counter going negative is a ledger bug,
-- and the script then marks the job corrupt instead of writing anything (see refuse_corrupt).
local function negative_counter(job, changes)
  for _, name in ipairs(COUNTERS) do
    local v = tonumber(changes[name] or job[name])
    if v == nil or v < 0 then return name end
  end
  return nil
end

-- Mark the job corrupt (it never runs again until an operator looks) and say why in the log.
local function refuse_corrupt(job_key, log_key, maxlen, why)
  redis.call('HSET', job_key, 'corrupt', '1')
  LOADED[job_key] = nil
  log(log_key, maxlen, {'event', 'ledger_invariant_broken', 'error', why})
  return {'corrupt', why}
end

-- Statuses in which a job still decides its own end when its last open batch commits.
local function live(status)
  return status == 'running' or status == 'paused' or status == 'held' or status == 'waiting_human'
end

-- Open batches waiting for a person (batch status waiting_human); absent in jobs older than approvals.
local function n_waiting(job, changes)
  return tonumber(changes['n_waiting'] or job['n_waiting'] or '0')
end

-- A running job whose source is exhausted and whose every open batch waits for a person is
-- waiting_human; one that has work again (a decision advanced a batch) is running. Other statuses
-- (paused, held, ended) are left as they are.
local function settle_waiting(job, changes)
  local status = changes['status'] or job['status']
  if status ~= 'running' and status ~= 'waiting_human' then return end
  local exhausted = (changes['exhausted'] or job['exhausted']) == '1'
  local blocked = changes['blocked'] or job['blocked']
  local open = tonumber(changes['n_open'] or job['n_open'])
  local all_wait = exhausted and blocked == '' and open > 0 and n_waiting(job, changes) == open
  local want = all_wait and 'waiting_human' or 'running'
  if want ~= status then changes['status'] = want end
end

-- Backoff for the attempt that just failed: min(initial * coef^(attempt-1), max), equal jitter.
local function backoff_ms(attempt, initial_ms, coef, max_ms, jitter)
  local delay = initial_ms * (coef ^ (attempt - 1))
  if delay > max_ms then delay = max_ms end
  return math.floor(delay * (0.5 + 0.5 * jitter))
end

-- Failure budget: too many failed batches for tolerated_pct of max(budget_total, planned)?
local function over_budget(job, budget_total, tolerated_pct)
  local planned = tonumber(job['next_seq']) - tonumber(job['base_seq'])
  local total = math.max(tonumber(budget_total), planned, 1)
  return tonumber(job['n_failed']) * 100 > tolerated_pct * total
end

-- Whether quarantined items are more than the failure budget allows: quarantined items count against
-- tolerated_pct as a share of the items planned so far (failed batches count as batches, over_budget).
local function items_over_budget(job, changes, tolerated_pct)
  local quar = tonumber(changes['n_quar'] or job['n_quar'] or '0')
  if quar == 0 then return false end
  local planned = tonumber(changes['items_planned'] or job['items_planned'] or '0')
  return quar * 100 > tolerated_pct * math.max(planned, 1)
end

-- Decide a running job's end once its source is exhausted and no batch is open.
local function finish_changes(job, changes, now, budget_total, tolerated_pct)
  local status = changes['status'] or job['status']
  if not live(status) then return end
  local exhausted = (changes['exhausted'] or job['exhausted']) == '1'
  local blocked = changes['blocked'] or job['blocked']
  local open = tonumber(changes['n_open'] or job['n_open'])
  if exhausted and blocked == '' and open == 0 then
    local failed = tonumber(changes['n_failed'] or job['n_failed'])
    local merged = {next_seq = job['next_seq'], base_seq = job['base_seq'], n_failed = failed}
    if (failed > 0 and over_budget(merged, budget_total, tolerated_pct))
        or items_over_budget(job, changes, tolerated_pct) then  -- quarantined items (Bisection)
      changes['status'] = 'failed'
      changes['error'] = 'failure budget exceeded'
    else
      changes['status'] = 'succeeded'
    end
    changes['finished_ms'] = int(now)
    changes['held_reason'] = ''  -- a held job that ends is held no more
  else
    settle_waiting(job, changes)
  end
end

-- Job bookkeeping for a batch that failed for good (out of attempts, fatal, or corrupt). A batch whose
-- fetch stage was to yield the next cursor leaves the rest of the source unreachable: the job fails
-- (retry-failed re-opens the batch). Otherwise the failure budget decides.
local function failed_for_good(job, jchg, seq, now, budget_total, tolerated_pct)
  jchg['n_failed'] = int(tonumber(job['n_failed']) + 1)
  jchg['n_open'] = int(tonumber(job['n_open']) - 1)
  if not live(job['status']) then return end
  local merged = {next_seq = job['next_seq'], base_seq = job['base_seq'], n_failed = jchg['n_failed']}
  if job['blocked'] == seq then
    jchg['status'] = 'failed'
    jchg['error'] = 'batch ' .. seq .. ' failed before its fetch stage gave the next cursor'
    jchg['finished_ms'] = int(now)
    jchg['held_reason'] = ''
  elseif over_budget(merged, budget_total, tolerated_pct) then
    jchg['status'] = 'failed'
    jchg['error'] = 'failure budget exceeded at batch ' .. seq
    jchg['finished_ms'] = int(now)
    jchg['held_reason'] = ''
  else
    finish_changes(job, jchg, now, budget_total, tolerated_pct)
  end
end

-- A stage attempt failed (reported, or its lease expired). Retry with backoff while
-- attempts remain and the error is retryable; otherwise the batch fails for good and
-- the failure budget decides the job. Returns 'retry', 'failed' or 'corrupt' (nothing written but the
-- corrupt mark). Attempts a lease was released from without a platform call ('unspent') do not count.
-- p.error_type (optional) is recorded in the batch ('error_type') and the log entry.
-- Give a leased batch back to its stage's ready set, ready at ``ready_at``, without spending its attempt
-- (unspent + 1 balances the lease's attempt + 1): a call that never began, or found its target down.
local function give_back(batch_key, leases_key, ready_key, batch, ready_at)
  local chg = {status = 'pending', lease_token = '', deadline_ms = '', ready_ms = int(ready_at),
    unspent = int(tonumber(batch['unspent'] or '0') + 1)}
  chg['st:' .. batch['stage']] = 'pending'
  save(batch_key, batch, chg)
  redis.call('ZREM', leases_key, batch['seq'])
  redis.call('ZADD', ready_key, ready_at, batch['seq'])
end

local function fail_attempt(k, job, batch, seq, p)
  local stage = batch['stage']
  local now = p.now
  local attempt = tonumber(batch['attempt'])
  local spent = attempt - tonumber(batch['unspent'] or '0')
  local bchg = p.bchg or {}
  bchg['lease_token'], bchg['deadline_ms'], bchg['error'] = '', '', p.message
  bchg['st:' .. stage] = 'failed'
  -- error_type (e.g. 'max_run') is kept with the error; a later failure without one clears it
  if p.error_type or batch['error_type'] then bchg['error_type'] = p.error_type or '' end
  -- a platform run an earlier call started (handle.lua): kept only when its outcome is still unknown
  -- (p.keep_handle: a plain lease expiry), so the next attempt asks about it before triggering again
  if not p.keep_handle and (batch['handle'] or '') ~= '' then
    bchg['handle'] = ''
    bchg['handle_stage'] = ''
  end
  local jchg = p.jchg or {}
  jchg['updated_ms'] = int(now)
  local outcome, ready_at
  if p.retryable and spent < p.max_attempts then
    ready_at = now + math.max(backoff_ms(spent, p.initial_ms, p.coef, p.max_ms, p.jitter),
      p.min_delay_ms or 0)
    bchg['status'] = 'pending'
    bchg['ready_ms'] = int(ready_at)
    outcome = 'retry'
  else
    bchg['status'] = 'failed'
    failed_for_good(job, jchg, seq, now, p.budget_total, p.tolerated_pct)
    outcome = 'failed'
  end
  local bad = negative_counter(job, jchg)
  if bad then
    refuse_corrupt(k.job, k.log, p.maxlen, bad .. ' would go negative failing batch ' .. seq)
    return 'corrupt'
  end
  redis.call('ZREM', k.leases, seq)
  if outcome == 'retry' then
    redis.call('ZADD', k.ready[tonumber(stage) + 1], ready_at, seq)
  else
    redis.call('ZADD', k.failed, seq, seq)
  end
  save(k.batch, batch, bchg)
  if outcome == 'failed' then  -- before the job's own event it may cause (job.failed)
    emit('batch.failed', int(now), {seq = tonumber(seq), stage = tonumber(stage), attempt = attempt,
      error = p.message, error_type = p.error_type or cjson.null,
      job_status = jchg['status'] or job['status']})
  end
  save(k.job, job, jchg)
  local entry = {'event', outcome == 'retry' and 'retry_scheduled' or 'batch_failed',
    'seq', seq, 'stage', stage, 'attempt', int(attempt), 'error', p.message,
    'retryable', p.retryable and '1' or '0', 'actor', p.actor}
  if p.error_type then
    entry[#entry + 1] = 'error_type'
    entry[#entry + 1] = p.error_type
  end
  log(k.log, p.maxlen, entry)
  return outcome
end

-- When the running attempt's max_run clock started: the call (push stage, begin.lua's called_ms of
-- this lease), else the lease; nil for a push stage whose call has not begun (queued or waiting for a
-- slot: that time does not count).
local function run_start(batch, push)
  local leased = tonumber(batch['leased_ms'] or '') or 0
  if push then
    local called = tonumber(batch['called_ms'] or '') or -1
    if called < leased then return nil end
    return called
  end
  return leased
end

local function max_run_message(max_run_ms)
  return 'ran past max_run (' .. string.format('%g', max_run_ms / 1000) .. ' s)'
end

-- Bisection (docs/design.md "Bisection"). A stage with on_fatal: bisect runs a batch that failed with a
-- non-transient error in pieces: lists of the batch's item indices. Batch fields, all absent until
-- used: 'bis' = JSON {s = stage, p = pending pieces, the first one is the one leased}; 'bx' = extra
-- calls spent on pieces; 'bq' = JSON list of quarantined item indices, each with 'qe:<i>' (the error),
-- 'qt:<i>' (error type), 'qs:<i>' (stage), 'qa:<i>' (when); 'only' = JSON list of the indices a
-- retry of quarantined items runs; 'bp:<stage>' = JSON list of the piece labels committed at that
-- stage, each piece's output in 'bo:<stage>:<label>'; 'n_good' = items counted in the job's items_done.
-- A piece's label is its indices joined by ','; the job counts quarantined items in 'n_quar'.

local function json_list(text)
  if text == nil or text == '' then return {} end
  return cjson.decode(text)
end

-- cjson encodes an empty table as {}: pieces and index lists are lists
local function encode_list(list)
  if #list == 0 then return '[]' end
  return cjson.encode(list)
end

-- The bisection state of ``batch`` at ``stage``, or nil when it does not run in pieces there.
local function bis_at(batch, stage)
  if (batch['bis'] or '') == '' then return nil end
  local bis = cjson.decode(batch['bis'])
  if tonumber(bis.s) ~= tonumber(stage) then return nil end
  return bis
end

-- The indices this pass runs: the retry's 'only' list, else every item not quarantined.
local function pass_indices(batch)
  if (batch['only'] or '') ~= '' then return json_list(batch['only']) end
  local out, q = {}, {}
  for _, i in ipairs(json_list(batch['bq'])) do q[i] = true end
  for i = 0, tonumber(batch['n_items']) - 1 do
    if not q[i] then out[#out + 1] = i end
  end
  return out
end

-- The indices the lease of ``batch`` at ``stage`` hands out (the Python twin is bisect.selection), or
-- nil for the whole batch (no bisection, no quarantine, no retry: the path every other batch takes).
local function selection(batch, stage)
  local bis = bis_at(batch, stage)
  if bis then return bis.p[1] end
  if (batch['only'] or '') == '' and (batch['bq'] or '') == '' then return nil end
  return pass_indices(batch)
end

local function piece_label(piece)
  return table.concat(piece, ',')
end

-- Record ``output`` (raw JSON) as the part of stage ``stage`` that ran ``piece``, into bchg.
local function add_part(batch, bchg, stage, piece, output)
  local label = piece_label(piece)
  local labels = json_list(bchg['bp:' .. stage] or batch['bp:' .. stage])
  labels[#labels + 1] = label
  bchg['bp:' .. stage] = cjson.encode(labels)
  bchg['bo:' .. stage .. ':' .. label] = output
end

-- The stage's output once every piece ran: {"parts": [{"items": [indices], "output": <as answered>}]}
-- (built by concatenation: outputs are never decoded and re-encoded).
local function merged_output(batch, bchg, stage)
  local parts = {}
  for _, label in ipairs(json_list(bchg['bp:' .. stage] or batch['bp:' .. stage])) do
    local raw = bchg['bo:' .. stage .. ':' .. label] or batch['bo:' .. stage .. ':' .. label]
    parts[#parts + 1] = '{"items":[' .. label .. '],"output":' .. raw .. '}'
  end
  return '{"parts":[' .. table.concat(parts, ',') .. ']}'
end

-- The next piece is leased afresh (its own attempts) at the same stage: batch changes into bchg. A
-- platform run an earlier piece started (handle.lua) is forgotten: it is not this piece's run.
local function next_piece(batch, bchg, stage, bis, now)
  if (batch['handle'] or '') ~= '' then
    bchg['handle'] = ''
    bchg['handle_stage'] = ''
  end
  bchg['bis'] = cjson.encode({s = tonumber(stage), p = bis.p})
  bchg['status'] = 'pending'
  bchg['attempt'] = '0'
  bchg['unspent'] = '0'
  bchg['lease_token'] = ''
  bchg['deadline_ms'] = ''
  bchg['ready_ms'] = int(now)
  bchg['st:' .. stage] = 'pending'
end

-- Items of a batch to count as done when it commits (n_items, less the quarantined ones), as a change
-- of items_done: a batch re-committed after a retry of quarantined items adds only those that passed.
local function items_done_delta(batch, bchg)
  local n_items = tonumber(bchg['n_items'] or batch['n_items'])
  local bq = bchg['bq'] or batch['bq'] or ''
  if bq == '' and batch['n_good'] == nil then return n_items end
  local good = n_items - #json_list(bq)
  bchg['n_good'] = int(good)
  return good - tonumber(batch['n_good'] or '0')
end


-- Approvals (docs/design.md "Approvals"). A gate is an approval stage's settings as the caller passes
-- them (JSON): {t = timeout ms, o = on_timeout, a = approvers (JSON list, '' = anyone), s = index of
-- the stage whose output is shown ('' = none), n = stage name, k = KEYS index of the record key of
-- round 1 of this batch at that stage}.

-- An approval's id: stable for (job, seq, stage, round), so every retry of the script that opens it
-- names the same record. Round 1 is the batch's first wait at that stage; a batch re-opened there
-- (retry-failed after a rejection) waits again in round 2, and so on.
local function approval_id(job_id, seq, stage, round)
  return job_id .. '.' .. seq .. '.' .. stage .. '.' .. round
end

-- Open an approval for ``batch`` at ``stage``: computes the batch's and the job's changes into bchg and
-- jchg and returns the function writing the record, its deadline and the approval.requested event.
-- The batch holds no lease while it waits (callers release it), so no worker, slot or concurrency.
-- extra: kind ('stage' | 'platform'), prompt (JSON), platform (JSON), token (lease token's sha1).
local function open_approval(k, job, batch, bchg, jchg, p, gate, stage, round, record_key, extra)
  local seq = batch['seq']
  local id = approval_id(p.job_id, seq, stage, round)
  local deadline = p.now + tonumber(gate.t)
  local rec = {id = id, job_id = p.job_id, tenant = p.tenant, seq = seq, stage = int(stage),
    stage_name = gate.n, kind = extra.kind or 'stage', status = 'pending', round = int(round),
    created_ms = int(p.now), deadline_ms = int(deadline), on_timeout = gate.o, approvers = gate.a or '',
    show = gate.s or '', prompt = extra.prompt or '', platform = extra.platform or '',
    token = extra.token or '', decision = '', actor = '', comment = '', decided_ms = '', edited = ''}
  bchg['status'] = 'waiting_human'
  bchg['approval'] = id
  bchg['ap_n:' .. stage] = int(round)
  bchg['st:' .. stage] = 'waiting'
  jchg['n_waiting'] = int(n_waiting(job, jchg) + 1)
  jchg['updated_ms'] = int(p.now)
  return function()
    save(record_key, {}, rec)
    redis.call('ZADD', k.approvals, p.now, id)
    redis.call('ZADD', k.due, deadline, id)
    local approvers = cjson.null
    if rec.approvers ~= '' then approvers = cjson.decode(rec.approvers) end
    local prompt = cjson.null
    if rec.prompt ~= '' then prompt = cjson.decode(rec.prompt) end
    emit('approval.requested', int(p.now), {approval_id = id, seq = tonumber(seq), stage = gate.n,
      stage_index = stage, kind = rec.kind, deadline_ms = deadline, on_timeout = gate.o,
      approvers = approvers, prompt = prompt})
    log(k.log, p.maxlen, {'event', 'approval_requested', 'seq', seq, 'stage', int(stage),
      'approval', id, 'deadline_ms', int(deadline)})
  end
end

-- Move a batch on once its stage p.stage committed (bchg already holds that stage's own fields): to the
-- next stage's ready set, to an approval when the next stage is an approval stage (p.gates), or
-- committed for good (counters, low watermark, the job's end). Changes are computed into bchg and jchg;
-- returns the next stage (-1 = committed), the function doing every write but the two records' saves,
-- and a refusal reply (corrupt) or nil. ``job`` and ``jchg`` may be nil only when the next stage is an
-- ordinary one (the record does not change between stages: complete's hot path).
local function advance(k, job, batch, bchg, jchg, p)
  local seq = batch['seq']
  local next_stage = p.stage + 1
  if next_stage < p.nstages then
    bchg['stage'] = int(next_stage)
    bchg['attempt'] = '0'
    bchg['unspent'] = '0'
    local gate = p.gates and p.gates[tostring(next_stage)]
    -- a batch that waited at this stage before goes to its ready set: the supervisor opens its next round
    if gate and (batch['ap_n:' .. next_stage] or '') == '' then
      local write = open_approval(k, job, batch, bchg, jchg, p, gate, next_stage, 1, KEYS[gate.k], {})
      settle_waiting(job, jchg)
      return next_stage, write, nil
    end
    bchg['status'] = 'pending'
    if jchg then settle_waiting(job, jchg) end
    return next_stage, function() redis.call('ZADD', k.ready[next_stage + 1], p.now, seq) end, nil
  end
  bchg['status'] = 'completed'
  bchg['completed_ms'] = int(p.now)
  local n_items = items_done_delta(batch, bchg)  -- less quarantined items (Bisection)
  jchg['n_done'] = int(tonumber(job['n_done']) + 1)
  jchg['n_open'] = int(tonumber(job['n_open']) - 1)
  jchg['items_done'] = int(tonumber(job['items_done']) + n_items)
  local end_cursor = bchg['end_cursor'] or batch['end_cursor']
  local swept, parked = {}, false
  if seq == job['wm'] then
    -- advance the low watermark over this batch and any completed out of order after it
    local wm = tonumber(seq) + 1
    local cursor = end_cursor
    while true do
      local later = redis.call('HGET', k.done, int(wm))
      if not later then break end
      swept[#swept + 1] = int(wm)
      cursor = later
      wm = wm + 1
    end
    jchg['wm'] = int(wm)
    jchg['committed_cursor'] = cursor
  elseif tonumber(seq) > tonumber(job['wm']) then
    parked = end_cursor
  end
  finish_changes(job, jchg, p.now, p.budget_total, p.tolerated_pct)
  local bad = negative_counter(job, jchg)
  if bad then
    return -1, nil, refuse_corrupt(k.job, k.log, p.maxlen, bad .. ' would go negative committing batch ' .. seq)
  end
  local keep_items = (bchg['bq'] or batch['bq'] or '') ~= ''  -- a retry of quarantined items reads them
  return -1, function()
    if not keep_items then redis.call('DEL', k.items) end
    if #swept > 0 then redis.call('HDEL', k.done, unpack(swept)) end
    if parked then redis.call('HSET', k.done, seq, parked) end
  end, nil
end

-- Cost ledger (docs/design.md "Cost ledger"). Why a stage call ran, from the batch record as it is before
-- this answer is written: 'first' (the stage's first spent attempt), 'rerun' (the attempt before it lost
-- its worker or callback: its lease expired), 'retry' (the attempt before it failed), 'bisection' (a
-- child batch cut by bisection, field split_from, on its first attempt).
local function call_reason(batch)
  local spent = tonumber(batch['attempt'] or '1') - tonumber(batch['unspent'] or '0')
  if spent <= 1 then
    -- a piece of a batch being bisected (docs/design.md "Bisection": field bis)
    if (batch['bis'] or '') ~= '' then return 'bisection' end
    return 'first'
  end
  -- expire.lua's words for a lease that ran out on a call under way (not one that never began)
  if batch['error'] == 'lease expired' then return 'rerun' end
  return 'retry'
end

-- Add one call to the job's totals a budget is measured by (cost hash 'calls', 'tokens', 'price') and say
-- why the job must pause: its spend reached the budget (JSON {t = tokens, p = price}), or the next call
-- would pass it at the job's mean cost per call. nil when it need not, or when it paused for it before
-- (a resumed job goes on past its budget).
local function cost_budget_passed(cost_key, budget, tokens, price)
  redis.call('HINCRBY', cost_key, 'calls', 1)
  if tokens > 0 then redis.call('HINCRBY', cost_key, 'tokens', tokens) end
  if price > 0 then redis.call('HINCRBYFLOAT', cost_key, 'price', price) end
  if redis.call('HGET', cost_key, 'budget_paused') then return nil end
  local b = cjson.decode(budget)
  local calls = tonumber(redis.call('HGET', cost_key, 'calls'))
  for _, unit in ipairs({{'t', 'tokens'}, {'p', 'price'}}) do
    local limit = tonumber(b[unit[1]])
    local spent = tonumber(redis.call('HGET', cost_key, unit[2]) or '0')
    if limit then
      local next_call = spent / calls
      local of = string.format('%g', spent) .. ' of ' .. string.format('%g', limit) .. ' ' .. unit[2]
      if spent >= limit then return 'cost budget reached: ' .. of end
      if spent + next_call > limit then
        return 'cost budget: ' .. of .. ' spent; the next call (about ' .. string.format('%g', next_call)
          .. ') would pass it'
      end
    end
  end
  return nil
end

-- Record one platform call's cost in the job's cost hash (keys.py JobKeys.cost) and pause the job when it
-- passes its flow's budget, or when the next call would (at this job's mean cost per call). ``usage`` is
-- '' or JSON {t = tokens, p = price (decimal text), c = currency}; ``budget`` '' or JSON {t, p}. A call's
-- duration runs from its platform call (begin.lua called_ms) or, in pull mode, its lease. Called by the
-- script that commits or fails the call, so a call is counted exactly when its answer is. Returns the
-- reason the job was paused for, or nil.
local function record_cost(cost_key, job_key, log_key, maxlen, batch, s, reason, now, usage, budget)
  local leased = tonumber(batch['leased_ms'] or '') or now
  local called = tonumber(batch['called_ms'] or '') or -1
  local ms = now - (called >= leased and called or leased)
  local u = (usage ~= nil and usage ~= '') and cjson.decode(usage) or {}
  local tokens = tonumber(u.t) or 0
  local price = tonumber(u.p) or 0
  -- per stage; the job's totals are summed on read (cost.py), but for what a budget needs here
  local function add(name, n) redis.call('HINCRBY', cost_key, name .. ':' .. s, n) end
  local function addf(name, x) redis.call('HINCRBYFLOAT', cost_key, name .. ':' .. s, x) end
  add('calls', 1)
  add('ms', ms)
  if reason ~= 'first' then add('r_' .. reason, 1) end  -- first = calls - the others (cost.py)
  if tokens > 0 or price > 0 then add('paid', 1) end
  if tokens > 0 then add('tokens', tokens) end
  if price > 0 then addf('price', price) end
  if reason == 'rerun' then
    add('redone', 1)
    if tokens > 0 then add('redone_tokens', tokens) end
    if price > 0 then addf('redone_price', price) end
  end
  if type(u.c) == 'string' and u.c ~= '' then
    local seen = redis.call('HGET', cost_key, 'currency')
    if not seen then redis.call('HSET', cost_key, 'currency', u.c)
    elseif seen ~= u.c then redis.call('HSET', cost_key, 'currency', 'mixed') end
  end
  if budget == nil or budget == '' then return nil end
  local why = cost_budget_passed(cost_key, budget, tokens, price)
  if why == nil then return nil end
  local job = load(job_key)
  if not job or job['status'] ~= 'running' then return nil end
  redis.call('HSET', cost_key, 'budget_paused', why)
  save(job_key, job, {status = 'paused', paused_reason = why, updated_ms = int(now)})
  log(log_key, maxlen, {'event', 'job_paused', 'from', 'running', 'actor', 'cost_budget', 'reason', why})
  return why
end
