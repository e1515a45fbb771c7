"""Redis memory per finished batch, outputs aside.

Run: .venv/bin/python benchmarks/bench_memory.py [BATCHES]
Runs a 2-stage job of BATCHES batches with null outputs to the end, then reads Redis used_memory
(delta from before the job) and MEMORY USAGE of the job's capped log stream, and reports bytes per
finished batch with and without the log (the log is capped per job, so it does not grow with batches
past log_maxlen entries). Target: at most 1 KB per batch.
"""

from __future__ import annotations

import sys

from _common import ledger_on_private_redis, start_job


def main() -> None:
    batches = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    with ledger_on_private_redis() as (ledger, service):
        r = ledger.r
        r.config_set("activedefrag", "no")
        before = r.info("memory")["used_memory"]
        job_id = start_job(service, "memory-bench", count=batches * 10, max_items=10,
                           stages=("process", "store"))
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


if __name__ == "__main__":
    main()
