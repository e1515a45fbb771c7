"""Supervisor pass time at 100 and 100,000 idle running jobs: the due-index pass (``Supervisor.tick``)
against the old pass that looked at every active job (``Supervisor.tick_all``), in the same run.

    .venv/bin/python benchmarks/bench_supervisor.py                 # 100 and 100,000 jobs, old pass too
    .venv/bin/python benchmarks/bench_supervisor.py --sizes 100,20000 --no-old
    .venv/bin/python benchmarks/bench_supervisor.py --no-old --due-shards 4   # the due index in 4 sets

Idle jobs are cloned from one real job with a pipeline of records (as bench_list.py does): spec, record,
roster, job index, active set and due entry. At each size a pass is also timed with 10 due jobs (one
lease past its deadline each): the pass then expires 10 leases, whatever the number of idle jobs.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time

from _common import ledger_on_private_redis

from gateway.ledger.flows import FlowRegistry, parse_flow
from gateway.ledger.jobindex import Filed
from gateway.ledger.jobs import JobRequest, JobService
from gateway.ledger.ledger import Ledger
from gateway.ledger.records import seal
from gateway.push.supervisor import Supervisor

TENANT = "bench"
DUE_JOBS = 10


def register(service: JobService) -> None:
    for flow_id, lease in (("idle", 3600), ("due", 0.05)):
        service.flows.register(TENANT, parse_flow({
            "id": flow_id, "version": "1", "stages": [{"name": "score", "lease": lease}],
            "batching": {"max_items": 10}, "source": {"type": "sequence", "count": 1000}}))


def clone(service: JobService, template: str, n: int) -> None:
    """``n`` idle running jobs copied from ``template``'s records."""
    ledger, r = service.ledger, service.ledger.r
    k0 = ledger.keys.job(template)
    spec_fields, job_fields, spec = r.hgetall(k0.spec), r.hgetall(k0.job), ledger.spec(template)
    now = int(time.time() * 1000)
    for start in range(0, n, 1000):
        pipe = r.pipeline(transaction=False)
        for _ in range(min(1000, n - start)):
            job_id = f"job_{now:011x}{secrets.token_hex(6)}"
            k = ledger.keys.job(job_id)
            pipe.hset(k.spec, mapping=seal({f: v for f, v in spec_fields.items() if f != "checksum"}
                                           | {"job_id": job_id}))
            pipe.hset(k.job, mapping=seal({f: v for f, v in job_fields.items() if f != "checksum"}
                                          | {"created_ms": str(now)}))
            pipe.zadd(ledger.keys.jobs(TENANT), {job_id: now})
            ledger.index.file(pipe, TENANT, job_id, Filed("running", spec.flow.id, spec.flow.version, now))
            pipe.sadd(ledger.keys.active, job_id)
            pipe.zadd(ledger.keys.due_for(job_id), {job_id: float("inf")})
        pipe.execute()


def timed(fn, runs: int) -> float:
    """Median seconds of ``runs`` calls."""
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def due_pass(service: JobService, sup: Supervisor) -> float:
    """One pass with DUE_JOBS leases past their deadline; checks each was expired."""
    ledger = service.ledger
    ids = [service.create(TENANT, JobRequest(flow_id="due"))["job_id"] for _ in range(DUE_JOBS)]
    for job_id in ids:
        ledger.lease(job_id)
    time.sleep(0.1)
    t0 = time.perf_counter()
    sup.tick()
    took = time.perf_counter() - t0
    for job_id in ids:
        assert ledger.r.zcard(ledger.keys.job(job_id).leases) == 0, "a due lease was not expired"
        ledger.cancel(job_id, "bench")
    sup.tick()  # retires them
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100,100000")
    ap.add_argument("--no-old", action="store_true", help="skip the old every-job pass")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--due-shards", type=int, default=1, help="BATCHGATE_DUE_SHARDS")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with ledger_on_private_redis() as (ledger, service):
        if args.due_shards != 1:
            ledger = Ledger(ledger.r, ledger.settings.model_copy(update={"due_shards": args.due_shards}))
            service = JobService(ledger, FlowRegistry(ledger.r, ledger.keys))
        ledger.spec_cache = 1024  # the default: 100,000 specs do not fit, as in production
        register(service)
        template = service.create(TENANT, JobRequest(flow_id="idle"))["job_id"]
        have = 1
        for size in sizes:
            t0 = time.perf_counter()
            clone(service, template, size - have)
            have = size
            made = time.perf_counter() - t0
            sup = Supervisor(ledger, name="bench-sup")
            t0 = time.perf_counter()
            sup.tick()
            first = time.perf_counter() - t0  # includes the sweep's first whole round (ZMSCORE pages)
            new = timed(sup.tick, args.runs)
            bare = Supervisor(ledger, name="bench-bare", sweep_visits=0)
            bare.tick()
            only_due = timed(bare.tick, args.runs)
            with_due = due_pass(service, sup)
            old = None if args.no_old else timed(sup.tick_all, 1)
            rows.append((size, made, first, new, only_due, with_due, old))
            print(f"{size:>7} jobs (made in {made:.1f} s): first pass {first * 1000:.1f} ms, "
                  f"pass {new * 1000:.2f} ms (due index only: {only_due * 1000:.2f} ms), "
                  f"pass with {DUE_JOBS} due leases {with_due * 1000:.1f} ms"
                  + ("" if old is None else f", old every-job pass {old * 1000:.0f} ms"
                     f" ({old / new:.0f}x the new pass)"), flush=True)
    if len(rows) >= 2:
        (a, *_, new_a, _, due_a, _), (b, *_, new_b, _, due_b, _) = rows[0], rows[-1]
        print(f"pass at {b} / at {a} jobs: {new_b / new_a:.2f}x idle, {due_b / due_a:.2f}x with "
              f"{DUE_JOBS} due leases (goal: within 2x)")


if __name__ == "__main__":
    main()
