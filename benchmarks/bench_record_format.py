"""What a ledger record costs a script to load and save, as a hash (today) and as one serialized value.

Run: .venv/bin/python benchmarks/bench_record_format.py [N]   (default 2,000 repetitions)

A step's scripts load three checksummed records and save three (docs/benchmarks.md "A step's cost after
issue 18 item 0": about half of a step's Redis CPU). This times, inside one script on the embedded
redis-server (TIME around N repetitions of each), for a real batch record and a real job record:

- hash, as lib.lua does: HGETALL into a table, then the seal (sorted names, SHA-1 of the entries);
- hash, HGETALL into a table alone (the seal left out: what the checksum costs);
- one JSON value: GET, SHA-1 of it, cjson.decode;
- saving: HSET of every field (the seal's re-seal left out) against cjson.encode, SHA-1 and SET.

It prints microseconds per operation and the ratios to the hash load, measured in the same run.
"""

from __future__ import annotations

import json
import sys

from _common import ledger_on_private_redis

from gateway.ledger.flows import parse_flow
from gateway.ledger.jobs import JobRequest
from gateway.ledger.scripts import helpers

TIMING = """
local N = tonumber(ARGV[1])
local function t() local x = redis.call('TIME'); return tonumber(x[1]) * 1e6 + tonumber(x[2]) end
local function map_of(key)
  local flat = redis.call('HGETALL', key)
  local m = {}
  for j = 1, #flat, 2 do m[flat[j]] = flat[j + 1] end
  return m
end
local out = {}
for _, key in ipairs(KEYS) do
  local t0 = t()
  for _ = 1, N do local m = map_of(key); local _s = seal(m) end
  local t1 = t()
  for _ = 1, N do local _m = map_of(key) end
  local t2 = t()
  for _ = 1, N do
    local s = redis.call('GET', key .. ':json')
    local _h = redis.sha1hex(s)
    local _m = cjson.decode(s)
  end
  local t3 = t()
  local m = map_of(key)
  for _ = 1, N do
    local args = {}
    for n, v in pairs(m) do args[#args + 1] = n; args[#args + 1] = v end
    redis.call('HSET', key .. ':copy', unpack(args))
  end
  local t4 = t()
  for _ = 1, N do
    local s = cjson.encode(m)
    local _h = redis.sha1hex(s)
    redis.call('SET', key .. ':w', s)
  end
  local t5 = t()
  out[#out + 1] = {tostring((t1 - t0) / N), tostring((t2 - t1) / N), tostring((t3 - t2) / N),
                   tostring((t4 - t3) / N), tostring((t5 - t4) / N)}
end
return out
"""


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    with ledger_on_private_redis() as (ledger, jobs):
        jobs.flows.register("bench", parse_flow({
            "id": "fmt", "version": "1", "stages": [{"name": "score"}, {"name": "store"}],
            "batching": {"max_items": 10}, "source": {"type": "sequence", "count": 1000}}))
        job_id = jobs.create("bench", JobRequest(flow_id="fmt"))["job_id"]
        lease = ledger.lease(job_id)
        ledger.complete(job_id, lease.seq, lease.lease_token, {"score": 0.93, "why": "x" * 80})
        ledger.lease(job_id)  # the batch at its second stage: leased, one output
        k, r = ledger.keys.job(job_id), ledger.r
        records = {"batch": k.batch(lease.seq), "job": k.job}
        for key in records.values():
            r.set(key + ":json", json.dumps(r.hgetall(key)))
        script = helpers(TIMING) + TIMING
        got = r.eval(script, len(records), *records.values(), n)
        print(f"per operation, {n} repetitions inside one script (us; x the hash load with its seal)")
        for (name, key), row in zip(records.items(), got, strict=True):
            load, bare, one, hset, put = (float(v) for v in row)
            print(f"  {name} record ({len(r.hgetall(key))} fields):")
            print(f"    load, hash + seal (today):         {load:6.2f} us  1.00x")
            print(f"    load, hash without the seal:       {bare:6.2f} us  {bare / load:.2f}x")
            print(f"    load, one JSON value + SHA-1:      {one:6.2f} us  {one / load:.2f}x")
            print(f"    save, HSET every field (no seal):  {hset:6.2f} us  {hset / load:.2f}x")
            print(f"    save, one JSON value + SHA-1:      {put:6.2f} us  {put / load:.2f}x")


if __name__ == "__main__":
    main()
