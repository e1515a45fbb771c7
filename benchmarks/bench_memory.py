"""Redis memory per finished batch, outputs aside; and what result sinks and compaction save.

Run: .venv/bin/python benchmarks/bench_memory.py [BATCHES]
1. Runs a 2-stage job of BATCHES batches with null outputs to the end, then reads Redis used_memory
   (delta from before the job) and MEMORY USAGE of the job's capped log stream, and reports bytes per
   finished batch with and without the log (the log is capped per job, so it does not grow with batches
   past log_maxlen entries). Target: at most 1 KB per batch.
2. Result sinks (docs/design.md "Result sinks and compaction"): the same job without a sink and with a
   jsonl sink whose deliverer ran (records compacted), at rest (succeeded) and running (BATCHES committed,
   16 batches open): MEMORY USAGE summed over the job's keys, by kind of key (not the call journal, whose
   entries expire 120 s after their call). Target: a running job's
   memory follows its open batches, not its history; a job at rest at most 2 KB.
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from datetime import timedelta

import redis
from _common import ledger_on_private_redis, start_job

from gateway.ledger.flows import FlowRegistry, parse_flow
from gateway.ledger.jobs import JobRequest, JobService
from gateway.ledger.ledger import Ledger
from gateway.push.sinks import SinkDeliverer

OPEN = 16


def per_batch(ledger: Ledger, service: JobService, batches: int) -> None:
    r = ledger.r
    try:
        r.config_set("activedefrag", "no")
    except redis.ResponseError:
        pass  # the embedded Redis disables CONFIG (embedded.py); it starts without active defrag
    before = r.info("memory")["used_memory"]
    job_id = start_job(service, "memory-bench", count=batches * 10, max_items=10, stages=("process", "store"))
    while (lease := ledger.lease(job_id)) is not None:
        ledger.complete(job_id, lease.seq, lease.lease_token, None)
    assert r.hget(ledger.keys.job(job_id).job, "status") == "succeeded"
    total = r.info("memory")["used_memory"] - before
    log_bytes = r.memory_usage(ledger.keys.job(job_id).log, samples=0) or 0
    one_batch = r.memory_usage(ledger.keys.job(job_id).batch(batches // 2), samples=0)
    print(f"{batches} finished batches (2 stages, null outputs):")
    print(f"  used_memory delta:            {total / batches:7.0f} B per batch")
    print(f"  without the capped log:       {(total - log_bytes) / batches:7.0f} B per batch")
    print(f"  MEMORY USAGE of one batch key: {one_batch} B")
    print("  target: <= 1024 B per batch")


def by_kind(ledger: Ledger, job_id: str) -> Counter:
    """MEMORY USAGE of every key of the job, summed by kind (batch and items keys together)."""
    out: Counter = Counter()
    for key in ledger.r.scan_iter(f"{ledger.keys.prefix}:{{{job_id}}}:*", count=1000):
        kind = key.rsplit("}:", 1)[1].split(":", 1)[0]
        if kind == "call":
            continue  # the call journal: each entry expires 120 s after its call (scripts.JOURNAL_MS)
        kind = "batch+items" if kind in ("batch", "items") else kind
        out[kind] += ledger.r.memory_usage(key, samples=0) or 0
    return out


def sink_run(ledger: Ledger, jobs: JobService, batches: int, sink: dict | None, finish: bool) -> Counter:
    name = f"sink-{'on' if sink else 'off'}-{'rest' if finish else 'run'}"
    flow = parse_flow({"id": name, "version": "1", "concurrency": 1000, "batching": {"max_items": 10},
                       "stages": [{"name": "process", "lease": 3600}, {"name": "store", "lease": 3600}],
                       "source": {"type": "sequence", "count": batches * 10 + (0 if finish else OPEN * 10)}})
    jobs.flows.register("bench", flow)
    job_id = jobs.create("bench", JobRequest(flow_id=name, sink=sink))["job_id"]
    done = 0
    while done < batches * 2 and (lease := ledger.lease(job_id)) is not None:
        ledger.complete(job_id, lease.seq, lease.lease_token, {"ok": True, "seq": lease.seq})
        done += 1
    if not finish:
        for _ in range(OPEN):  # open batches: leased, not answered
            assert ledger.lease(job_id) is not None
    SinkDeliverer(ledger).run_once()
    status = ledger.r.hget(ledger.keys.job(job_id).job, "status")
    assert status == ("succeeded" if finish else "running"), status
    return by_kind(ledger, job_id)


def sinks(ledger: Ledger, batches: int) -> None:
    out = tempfile.mkdtemp(prefix="bg-bench-sink-")
    settings = ledger.settings.model_copy(update={"sink_roots": {"*": [out]}, "sink_grace": timedelta(0)})
    ledger = Ledger(ledger.r, settings)
    jobs = JobService(ledger, FlowRegistry(ledger.r, ledger.keys))
    sink = {"type": "jsonl", "path": out + "/{job_id}.jsonl"}  # a file per job
    print(f"\nResult sinks: MEMORY USAGE of one job's keys, {batches} batches committed (2 stages, small "
          "outputs)")
    for finish, label in ((True, "at rest (succeeded)"), (False, f"running, {OPEN} batches open")):
        off, on = sink_run(ledger, jobs, batches, None, finish), sink_run(ledger, jobs, batches, sink, finish)
        print(f"  {label}:")
        print(f"    without a sink:                  {sum(off.values()):9,} B  "
              f"({', '.join(f'{k} {v:,}' for k, v in off.most_common())})")
        print(f"    with a jsonl sink, delivered:    {sum(on.values()):9,} B  "
              f"({', '.join(f'{k} {v:,}' for k, v in on.most_common())})")


def main() -> None:
    batches = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    with ledger_on_private_redis() as (ledger, service):
        per_batch(ledger, service, batches)
        sinks(ledger, batches)


if __name__ == "__main__":
    main()
