-- open_approval.lua: open an approval for a batch that is not reaching it through a commit: a batch found in an
-- approval stage's ready set (re-opened there by retry-failed or resume; the supervisor), or a leased
-- batch whose platform answered that a person must decide (Ledger.open_platform_approval).
-- KEYS[1] job   KEYS[2] batch:<seq>   KEYS[3] approval:<seq>.<stage>.<round>   KEYS[4] approvals
-- KEYS[5] approvals:due   KEYS[6] leases   KEYS[7] ready:<stage>   KEYS[8] log
-- KEYS[#KEYS] events: the job's outbox, always the last key (lib.lua use_outbox)
-- ARGV[1] 'ready' | 'leased'   ARGV[2] lease token ('leased')   ARGV[3] round   ARGV[4] job id
-- ARGV[5] tenant   ARGV[6] stage index   ARGV[7] gate (JSON, lib.lua; k unused)
-- ARGV[8] prompt (JSON; '' = none)   ARGV[9] platform run to resume (JSON; '' = none)   ARGV[10] log maxlen
-- ARGV[11] seq
-- Returns {'ok', approval id, deadline_ms, job status, '0' | '1' (opened before by this very lease)}
--       | {'raced'} (another round opened meanwhile: read again) | {'gone', batch status}
--       | {'stale', status, attempt} | {'cancelled'} | {'missing'} | {'corrupt'}
-- Invariant: a batch waits on at most one approval; opening is idempotent per (batch, stage, round),
-- and a retry by the same lease gets the first answer. The lease is released here (no slot, no
-- concurrency while a person decides); the attempt the platform ran stays spent.
use_outbox(KEYS[#KEYS])
local token = ARGV[2]
local existing = load(KEYS[3])
if existing == false then return {'corrupt'} end
if existing then
  if ARGV[1] == 'leased' and existing['token'] == redis.sha1hex(token) then
    return {'ok', existing['id'], existing['deadline_ms'], redis.call('HGET', KEYS[1], 'status') or '', '1'}
  end
  return {'raced'}
end
local job = load(KEYS[1])
if not job then return {'corrupt'} end
local stage = tonumber(ARGV[6])
local round = tonumber(ARGV[3])
local batch
if ARGV[1] == 'leased' then
  local refused
  batch, refused = leased_batch(KEYS[2], KEYS[1], token)
  if refused then return refused end
else
  if job['status'] == 'cancelled' then return {'cancelled'} end
  batch = load(KEYS[2])
  if batch == false then return {'corrupt'} end
  if not batch or batch['status'] ~= 'pending' or tonumber(batch['stage']) ~= stage then
    redis.call('ZREM', KEYS[7], ARGV[11])
    return {'gone', batch and batch['status'] or 'missing'}
  end
end
if tonumber(batch['stage']) ~= stage then return {'stale', batch['status'], batch['attempt']} end
if tonumber(batch['ap_n:' .. stage] or '0') ~= round - 1 then return {'raced'} end
local now = now_ms()
local bchg = {lease_token = '', deadline_ms = ''}
local jchg = {}
local k = {approvals = KEYS[4], due = KEYS[5], log = KEYS[8]}
local extra = {kind = 'stage'}
if ARGV[1] == 'leased' then
  extra = {kind = 'platform', prompt = ARGV[8], platform = ARGV[9], token = redis.sha1hex(token)}
end
local write = open_approval(k, job, batch, bchg, jchg, {now = now, job_id = ARGV[4], tenant = ARGV[5],
  maxlen = ARGV[10]}, cjson.decode(ARGV[7]), stage, round, KEYS[3], extra)
settle_waiting(job, jchg)
redis.call('ZREM', KEYS[6], batch['seq'])
redis.call('ZREM', KEYS[7], batch['seq'])
write()
save(KEYS[2], batch, bchg)
save(KEYS[1], job, jchg)
return {'ok', bchg['approval'], int(now + tonumber(cjson.decode(ARGV[7]).t)), job['status'], '0'}
