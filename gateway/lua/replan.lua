-- replan.lua: restart a job's planning from a cursor the caller names (rewind, or skip a bad range).
-- KEYS[1] job   KEYS[2] leases   KEYS[3] failed   KEYS[4] done   KEYS[5] log
-- KEYS[6..5+S] ready:0..ready:S-1   KEYS[6+S..] batch:<seq>, items:<seq> pairs for the seqs in ARGV[6..]
-- ARGV[1] number of stages S   ARGV[2] cursor (JSON)   ARGV[3] log maxlen   ARGV[4] actor   ARGV[5] reason
-- ARGV[6..] seqs of the uncommitted window (watermark .. next_seq-1)
-- Returns {'ok', superseded count, new first seq} | {'corrupt'}
-- Invariant: every uncommitted batch is superseded (its holders' tokens go stale), new batches start
-- from the named cursor with fresh seqs, and the log records who moved the cursor, from where, to where.
local job = load(KEYS[1])
if job == false then return {'corrupt'} end
local now = now_ms()
local nstages = tonumber(ARGV[1])
local first_batch = 6 + nstages
local superseded = 0
for i = 6, #ARGV do
  local key = KEYS[first_batch + 2 * (i - 6)]
  local seq = ARGV[i]
  local batch = load(key)
  if batch and batch['status'] ~= 'completed' and batch['status'] ~= 'superseded' then
    save(key, batch, {status = 'superseded', lease_token = '', deadline_ms = ''})
    redis.call('DEL', KEYS[first_batch + 2 * (i - 6) + 1])
    superseded = superseded + 1
  end
  redis.call('ZREM', KEYS[2], seq)
  redis.call('ZREM', KEYS[3], seq)
  for s = 0, nstages - 1 do redis.call('ZREM', KEYS[6 + s], seq) end
end
redis.call('DEL', KEYS[4])
local from = job['committed_cursor']
local base = job['next_seq']
save(KEYS[1], job, {status = 'running', base_seq = base, wm = base, committed_cursor = ARGV[2],
  frontier = ARGV[2], exhausted = '0', blocked = '', n_open = '0', n_failed = '0',
  updated_ms = int(now), finished_ms = '', error = ''})
log(KEYS[5], ARGV[3], {'event', 'cursor_moved', 'from', from, 'to', ARGV[2], 'actor', ARGV[4],
  'reason', ARGV[5], 'superseded', int(superseded)})
return {'ok', int(superseded), base}
