-- migrate.lua: move a paused or failed job to another version of its flow, in one step: the new spec,
-- the job's spec generation and the audit entry are written together or not at all.
-- KEYS[1] job   KEYS[2] spec   KEYS[3] leases   KEYS[4] log   KEYS[5] audit
-- KEYS[6..] batch:<seq> for the seqs watermark .. next_seq-1 as the caller read them
-- ARGV[1] spec generation the caller read the old spec at   ARGV[2] old number of stages S
-- ARGV[3] how many leading stages the new version keeps by name (position and name unchanged)
-- ARGV[4] watermark the caller read   ARGV[5] next_seq the caller read   ARGV[6] log maxlen
-- ARGV[7] actor   ARGV[8] reason   ARGV[9] from (flow@version)   ARGV[10] to (flow@version)
-- ARGV[11] old flow hash   ARGV[12] new flow hash   ARGV[13..] the new spec's fields, name value
--          pairs, sealed by the caller (records.seal)
-- Returns {'ok', new generation} | {'refused', status} | {'in_flight', leased count}
--       | {'incompatible', stages in use} | {'raced'} | {'corrupt', 'job' | 'spec'} | {'missing'}
-- Invariant: a job's spec changes only while nothing is leased and the job is paused or failed, only
-- to a version keeping the names of every stage a batch is in or has committed (stages 0 .. used-1,
-- all S once any batch committed), and the job's spec_gen rises with it (migrated_ms says when), so
-- every process's cached spec is seen to be old (Ledger.spec). Batches, cursors and counters are
-- untouched.
local job = load(KEYS[1])
if job == false then return {'corrupt', 'job'} end
if job == nil then return {'missing'} end
local status = job['status']
if status ~= 'paused' and status ~= 'failed' then return {'refused', status} end
if (job['spec_gen'] or '0') ~= ARGV[1] then return {'raced'} end
if job['wm'] ~= ARGV[4] or job['next_seq'] ~= ARGV[5] then return {'raced'} end
local spec = load(KEYS[2])
if spec == false then return {'corrupt', 'spec'} end
if spec == nil then return {'missing'} end
local leased = redis.call('ZCARD', KEYS[3])
if leased > 0 then return {'in_flight', leased} end
local nstages = tonumber(ARGV[2])
local used = 0
if tonumber(job['wm']) > 0 then used = nstages end
for i = 6, #KEYS do
  local batch = load(KEYS[i])
  if batch == false then return {'corrupt', 'batch'} end
  if batch ~= nil and batch['status'] ~= 'superseded' then
    local in_use = tonumber(batch['stage'] or '0') + 1
    if batch['status'] == 'completed' then in_use = nstages end
    if in_use > used then used = in_use end
  end
end
if used > tonumber(ARGV[3]) then return {'incompatible', used} end
local gen = tonumber(ARGV[1]) + 1
local fields = {}
for i = 13, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(fields))
local now = now_ms()
save(KEYS[1], job, {spec_gen = int(gen), migrated_ms = int(now), updated_ms = int(now)})
local entry = {'event', 'flow_migrated', 'from', ARGV[9], 'to', ARGV[10], 'from_hash', ARGV[11],
  'to_hash', ARGV[12], 'actor', ARGV[7], 'reason', ARGV[8]}
log(KEYS[4], ARGV[6], entry)
audit(KEYS[5], entry)
return {'ok', gen}
