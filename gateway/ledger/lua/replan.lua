-- replan.lua: restart a job's planning from a cursor the caller names (rewind, or skip a bad range).
-- KEYS[1] job   KEYS[2] leases   KEYS[3] failed   KEYS[4] done   KEYS[5] log   KEYS[6] audit
-- KEYS[7..6+S] ready:0..ready:S-1   KEYS[7+S..] batch:<seq>, items:<seq> pairs for the seqs in ARGV[7..]
-- ARGV[1] number of stages S   ARGV[2] cursor (JSON)   ARGV[3] log maxlen   ARGV[4] actor   ARGV[5] reason
-- ARGV[6] the caller's bound: it passed every seq from the watermark it read up to ARGV[6]-1
-- ARGV[7..] those seqs
-- Returns {'ok', superseded count, new first seq} | {'raced'} | {'refused', status} | {'corrupt'}
--       | {'missing'}
-- Invariant: every batch of the old plan that is not committed is superseded (its holders' tokens go
-- stale, its items are dropped), and the new plan starts empty at seq next_seq from the named cursor,
-- one generation on (gen + 1: its batches carry it beside their idempotency keys, which stay the same for
-- the same item range, so a store flow sees a re-stored range under the key it stored it by).
-- The script reads next_seq itself: if a batch was planned beyond the caller's bound it answers
-- 'raced' and changes nothing (the caller reads again). Counters are not reset blindly: they are the
-- recount of the new, empty plan (all zero) because every old batch is now completed or superseded.
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
if job == nil then return {'missing'} end
if job['status'] == 'cancelled' then return {'refused', job['status']} end
if tonumber(job['next_seq']) > tonumber(ARGV[6]) then return {'raced'} end
local now = now_ms()
local nstages = tonumber(ARGV[1])
local first_batch = 7 + nstages
local superseded = 0
for i = 7, #ARGV do
  local key = KEYS[first_batch + 2 * (i - 7)]
  local seq = ARGV[i]
  local batch = load(key)
  if batch and batch['status'] ~= 'completed' and batch['status'] ~= 'superseded' then
    local chg = {status = 'superseded', lease_token = '', deadline_ms = ''}
    if batch['status'] == 'leased' then chg['st:' .. batch['stage']] = 'pending' end  -- lease void
    save(key, batch, chg)
    redis.call('DEL', KEYS[first_batch + 2 * (i - 7) + 1])
    superseded = superseded + 1
  end
  redis.call('ZREM', KEYS[2], seq)
  redis.call('ZREM', KEYS[3], seq)
  for s = 0, nstages - 1 do redis.call('ZREM', KEYS[7 + s], seq) end
end
redis.call('DEL', KEYS[4])
local from = job['committed_cursor']
local old = job['status']
local base = job['next_seq']
save(KEYS[1], job, {status = 'running', base_seq = base, wm = base, committed_cursor = ARGV[2],
  frontier = ARGV[2], plan_cursor = ARGV[2], exhausted = '0', blocked = '', n_open = '0', n_done = '0',
  n_failed = '0', items_done = '0', items_planned = '0', n_waiting = '0', src_failures = '0', src_error = '',
  n_quar = '0',  -- the old plan's quarantined items leave the view and the budget (Bisection)
  src_retry_ms = '0',
  updated_ms = int(now), finished_ms = '', error = '', held_reason = '',
  gen = int(tonumber(job['gen'] or '0') + 1)})
local entry = {'event', 'cursor_moved', 'from', from, 'to', ARGV[2], 'actor', ARGV[4],
  'reason', ARGV[5], 'superseded', int(superseded), 'status_was', old}
log(KEYS[5], ARGV[3], entry)
audit(KEYS[6], entry)
return {'ok', int(superseded), base}
