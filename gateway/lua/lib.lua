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
local function digest(map)
  local entries = {}
  for name, value in pairs(map) do
    if name ~= 'checksum' and name ~= 'corrupt' then entries[#entries + 1] = name .. '\0' .. value end
  end
  table.sort(entries)
  return redis.sha1hex(table.concat(entries, '\0'))
end

-- Load a hash as a table. Returns nil when absent, false when it fails its checksum
-- (the record is then marked corrupt, which keeps it from running).
local function load(key)
  local flat = redis.call('HGETALL', key)
  if #flat == 0 then return nil end
  local map = {}
  for i = 1, #flat, 2 do map[flat[i]] = flat[i + 1] end
  if map['corrupt'] or map['checksum'] ~= digest(map) then
    redis.call('HSET', key, 'corrupt', '1')
    return false
  end
  return map
end

-- Write changed fields and the new checksum in one HSET.
local function save(key, map, changes)
  local args = {}
  for name, value in pairs(changes) do
    map[name] = value
    args[#args + 1] = name
    args[#args + 1] = value
  end
  map['checksum'] = nil
  args[#args + 1] = 'checksum'
  args[#args + 1] = digest(map)
  redis.call('HSET', key, unpack(args))
end

local function log(key, maxlen, fields)
  local args = {key, 'MAXLEN', '~', maxlen, '*'}
  for i = 1, #fields do args[#args + 1] = fields[i] end
  redis.call('XADD', unpack(args))
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

-- Decide a running job's end once its source is exhausted and no batch is open.
local function finish_changes(job, changes, now, budget_total, tolerated_pct)
  local status = changes['status'] or job['status']
  if status ~= 'running' and status ~= 'paused' then return end
  local exhausted = (changes['exhausted'] or job['exhausted']) == '1'
  local blocked = changes['blocked'] or job['blocked']
  local open = tonumber(changes['n_open'] or job['n_open'])
  if exhausted and blocked == '' and open == 0 then
    local failed = tonumber(changes['n_failed'] or job['n_failed'])
    local merged = {next_seq = job['next_seq'], base_seq = job['base_seq'], n_failed = failed}
    if failed > 0 and over_budget(merged, budget_total, tolerated_pct) then
      changes['status'] = 'failed'
      changes['error'] = 'failure budget exceeded'
    else
      changes['status'] = 'succeeded'
    end
    changes['finished_ms'] = int(now)
  end
end

-- Job bookkeeping for a batch that failed for good (out of attempts, fatal, or corrupt). A batch whose
-- fetch stage was to yield the next cursor leaves the rest of the source unreachable: the job fails
-- (retry-failed re-opens the batch). Otherwise the failure budget decides.
local function failed_for_good(job, jchg, seq, now, budget_total, tolerated_pct)
  jchg['n_failed'] = int(tonumber(job['n_failed']) + 1)
  jchg['n_open'] = int(tonumber(job['n_open']) - 1)
  if job['status'] ~= 'running' and job['status'] ~= 'paused' then return end
  local merged = {next_seq = job['next_seq'], base_seq = job['base_seq'], n_failed = jchg['n_failed']}
  if job['blocked'] == seq then
    jchg['status'] = 'failed'
    jchg['error'] = 'batch ' .. seq .. ' failed before its fetch stage gave the next cursor'
    jchg['finished_ms'] = int(now)
  elseif over_budget(merged, budget_total, tolerated_pct) then
    jchg['status'] = 'failed'
    jchg['error'] = 'failure budget exceeded at batch ' .. seq
    jchg['finished_ms'] = int(now)
  else
    finish_changes(job, jchg, now, budget_total, tolerated_pct)
  end
end

-- A stage attempt failed (reported, or its lease expired). Retry with backoff while
-- attempts remain and the error is retryable; otherwise the batch fails for good and
-- the failure budget decides the job. Returns 'retry' or 'failed'.
local function fail_attempt(k, job, batch, seq, p)
  local stage = batch['stage']
  local now = p.now
  local attempt = tonumber(batch['attempt'])
  local bchg = {lease_token = '', deadline_ms = '', error = p.message}
  bchg['st:' .. stage] = 'failed'
  redis.call('ZREM', k.leases, seq)
  local jchg = {updated_ms = int(now)}
  local outcome
  if p.retryable and attempt < p.max_attempts then
    local ready_at = now + math.max(backoff_ms(attempt, p.initial_ms, p.coef, p.max_ms, p.jitter),
      p.min_delay_ms or 0)
    bchg['status'] = 'pending'
    bchg['ready_ms'] = int(ready_at)
    redis.call('ZADD', k.ready[tonumber(stage) + 1], ready_at, seq)
    outcome = 'retry'
  else
    bchg['status'] = 'failed'
    redis.call('ZADD', k.failed, seq, seq)
    failed_for_good(job, jchg, seq, now, p.budget_total, p.tolerated_pct)
    outcome = 'failed'
  end
  save(k.batch, batch, bchg)
  save(k.job, job, jchg)
  log(k.log, p.maxlen, {'event', outcome == 'retry' and 'retry_scheduled' or 'batch_failed',
    'seq', seq, 'stage', stage, 'attempt', int(attempt), 'error', p.message,
    'retryable', p.retryable and '1' or '0', 'actor', p.actor})
  return outcome
end
