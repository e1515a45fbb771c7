"""Listing jobs (GET /v1/jobs) at 100,000 jobs of one tenant, per filter, against the old walk.

Run: .venv/bin/python benchmarks/bench_list.py [--jobs 100000] [--real 2000] [--skip-old-100k]

Set-up (honest about what is synthetic): ``--real`` jobs are created through the real create path
(JobService.create: spec, record, roster, index), over 6 flow versions; some of them are paused and
cancelled through the real control scripts, and the 5 oldest running jobs (clones) are held through them. The rest are clones of those records: a real job's
spec hash with a new job id and its job hash with a new id, creation time (spread over 30 days), status
(45% running, 40% succeeded, 8% failed, 4% paused, 3% cancelled) and checksum, filed in the index by
the same ``JobIndex.file`` the ledger uses. Clones have no log, audit or batches: the list path reads
only the job hash, the lease count and the spec, which they have.

Each filter is timed through JobService.list (the ledger and index, no HTTP), median and worst of
RUNS, with the first (cold: spec cache empty) timed apart; two rows go through the Flask app (test
client: routing, auth, JSON) as well. Baselines measured in the same run: a raw ZREVRANGEBYLEX of 50
ids (the floor), and the old implementation (walk the roster newest first, one view per job) for
``status=held&limit=1`` at 1,500 jobs and at the full count.
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import time

from _common import ledger_on_private_redis

from gateway.ledger.flows import parse_flow
from gateway.ledger.jobindex import Filed, member
from gateway.ledger.joblist import ListQuery, encode_cursor
from gateway.ledger.jobs import JobRequest, JobService
from gateway.ledger.records import seal
from gateway.errors import CorruptRecord, NotFound

RUNS = 30
DAY_MS = 86_400_000
FLOWS = [("flow-a", "1"), ("flow-a", "2"), ("flow-b", "1"), ("flow-c", "1"), ("flow-d", "1"), ("flow-e", "1")]
MIX = [("running", 45), ("succeeded", 40), ("failed", 8), ("paused", 4), ("cancelled", 3)]


def register(service: JobService, tenant: str) -> None:
    for flow_id, version in FLOWS:
        service.flows.register(tenant, parse_flow({
            "id": flow_id, "version": version, "stages": [{"name": "score"}, {"name": "store"}],
            "batching": {"max_items": 10}, "source": {"type": "sequence", "count": 1000}}))


def create_real(service: JobService, tenant: str, n: int) -> list[str]:
    ids = [service.create(tenant, JobRequest(flow_id=f, flow_version=v))["job_id"]
           for i in range(n) for f, v in [FLOWS[i % len(FLOWS)]]]
    for job_id in ids[5:40]:
        service.ledger.pause(job_id, "bench")
    for job_id in ids[40:60]:
        service.ledger.cancel(job_id, "bench")
    return ids


def clone(service: JobService, tenant: str, templates: list[str], n: int, rng: random.Random) -> None:
    """``n`` jobs cloned from the real ``templates`` (one per flow version), spread over 30 days."""
    ledger, r = service.ledger, service.ledger.r
    now = int(time.time() * 1000)
    tpl = [(r.hgetall(ledger.keys.job(t).spec), r.hgetall(ledger.keys.job(t).job), ledger.spec(t))
           for t in templates]
    statuses = [s for s, weight in MIX for _ in range(weight)]
    for start in range(0, n, 1000):
        pipe = r.pipeline(transaction=False)
        for _ in range(min(1000, n - start)):
            spec_fields, job_fields, spec = rng.choice(tpl)
            created = now - rng.randrange(30 * DAY_MS)
            job_id = f"job_{created:011x}{secrets.token_hex(6)}"
            status = rng.choice(statuses)
            k = ledger.keys.job(job_id)
            spec_copy = {f: v for f, v in spec_fields.items() if f != "checksum"} | {"job_id": job_id}
            job_copy = {f: v for f, v in job_fields.items() if f != "checksum"} | {
                "status": status, "created_ms": str(created), "updated_ms": str(created + 60_000),
                "finished_ms": str(created + 60_000) if status in ("succeeded", "failed", "cancelled") else ""}
            pipe.hset(k.spec, mapping=seal(spec_copy))
            pipe.hset(k.job, mapping=seal(job_copy))
            pipe.zadd(ledger.keys.jobs(tenant), {job_id: created})
            ledger.index.file(pipe, tenant, job_id, Filed(status, spec.flow.id, spec.flow.version, created))
        pipe.execute()


def hold_oldest(service: JobService, tenant: str, n: int) -> None:
    """Hold the ``n`` oldest running jobs through the real control script (a rare, old status)."""
    ledger = service.ledger
    oldest = ledger.r.zrangebylex(ledger.keys.job_index(tenant, "running"), "-", "+", start=0, num=n)
    for entry in oldest:
        ledger.hold(entry.partition(":")[2], "bench", "rare status")


def old_list(service: JobService, tenant: str, status: str | None, limit: int) -> list[dict]:
    """The implementation this replaces (walk the roster newest first, one view per job)."""
    index, out, start, previous = service.ledger.keys.jobs(tenant), [], 0, set()
    while len(out) < limit:
        ids = service.ledger.r.zrevrange(index, start, start + 199)
        if not ids:
            break
        for job_id in ids:
            if job_id in previous:
                continue
            try:
                view = service.view(tenant, job_id)
            except (NotFound, CorruptRecord):
                continue
            if status is None or view["status"] == status:
                out.append(view)
                if len(out) >= limit:
                    break
        start += len(ids)
        previous = set(ids)
    return out


def timed(fn, runs: int = RUNS) -> tuple[float, float, float]:
    """(cold ms, median ms, worst ms) of ``fn``; the first run is the cold one."""
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    rest = times[1:] or times
    return times[0], statistics.median(rest), max(rest)


def fresh(service: JobService) -> JobService:
    """A service whose ledger has an empty spec cache (a process that just started)."""
    from gateway.ledger.ledger import Ledger

    return JobService(Ledger(service.ledger.r, service.ledger.settings), service.flows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--real", type=int, default=2_000)
    ap.add_argument("--skip-old-100k", action="store_true")
    args = ap.parse_args()
    rng = random.Random(16)
    with ledger_on_private_redis() as (ledger, service):
        t0 = time.perf_counter()
        register(service, "bench")
        real = create_real(service, "bench", args.real)
        t_real = time.perf_counter() - t0
        clone(service, "bench", real[60:60 + len(FLOWS)], args.jobs - args.real, rng)
        hold_oldest(service, "bench", 5)
        t_all = time.perf_counter() - t0
        register(service, "small")
        small = create_real(service, "small", len(FLOWS) * 2)
        clone(service, "small", small[-len(FLOWS):], 1_500 - len(small), rng)
        hold_oldest(service, "small", 1)
        total = ledger.r.zcard(ledger.keys.jobs("bench"))
        mem = ledger.r.info("memory")["used_memory"]
        index_bytes = sum(ledger.r.memory_usage(key) or 0
                          for key in ledger.r.scan_iter(ledger.keys.job_index_pattern("bench"), count=1000))
        print(f"index memory: {index_bytes / 2**20:,.1f} MiB, {index_bytes / total:,.0f} B per job "
              "(MEMORY USAGE of the tenant's index keys)")
        print(f"set-up: {args.real:,} real jobs in {t_real:.1f} s, {total:,} in all in {t_all:.1f} s; "
              f"Redis used_memory {mem / 2**20:,.0f} MiB (index included)")

        now = int(time.time() * 1000)
        window = {"created_after": now - 15 * DAY_MS, "created_before": now - 14 * DAY_MS}
        deep_entry = ledger.r.zrevrange(ledger.keys.job_index("bench"), 90_000, 90_000)
        deep = ListQuery(limit=50)
        deep_cursor = encode_cursor(deep_entry[0], deep) if deep_entry else None
        cases = [
            ("no filter, limit 50", {"limit": 50}),
            ("no filter, limit 100 (the default)", {}),
            ("status=running (common), limit 50", {"status": "running", "limit": 50}),
            ("status=held (5 oldest jobs), limit 1", {"status": "held", "limit": 1}),
            ("status=held, limit 50", {"status": "held", "limit": 50}),
            ("flow_id=flow-c, limit 50", {"flow_id": "flow-c", "limit": 50}),
            ("flow_id=flow-a&flow_version=2, limit 50", {"flow_id": "flow-a", "flow_version": "2",
                                                         "limit": 50}),
            ("1-day window (15 days ago), limit 50", {**window, "limit": 50}),
            ("status=failed + flow-b + 1-day window, limit 50", {"status": "failed", "flow_id": "flow-b",
                                                                  **window, "limit": 50}),
            ("oldest first, status=paused, limit 50", {"status": "paused", "order": "oldest", "limit": 50}),
            ("deep page: cursor at job 90,000, limit 50", {"limit": 50, "cursor": deep_cursor}),
        ]
        floor = timed(lambda: ledger.r.zrevrangebylex(ledger.keys.job_index("bench"), "+", "-",
                                                      start=0, num=50))
        print(f"\nbaseline: raw ZREVRANGEBYLEX of 50 ids: {floor[1]:.3f} ms median\n")
        print(f"{'listing at ' + format(total, ',') + ' jobs (JobService.list)':52} {'cold':>8} "
              f"{'median':>8} {'worst':>8} {'jobs':>5}  vs floor")
        for name, query in cases:
            q = ListQuery.model_validate(query)
            cold_service = fresh(service)
            cold = timed(lambda: cold_service.list("bench", q), runs=0)[0]
            _, median, worst = timed(lambda: service.list("bench", q))
            n = len(service.list("bench", q).jobs)
            print(f"{name:52} {cold:8.2f} {median:8.2f} {worst:8.2f} {n:5}  x{median / floor[1]:,.0f}")

        from gateway.api.app import create_app

        settings = ledger.settings.model_copy(update={"tokens": {"t-bench-0123456789": "bench"}})
        client = create_app(settings, ledger.r).test_client()
        headers = {"Authorization": "Bearer t-bench-0123456789"}
        for path in ("/v1/jobs?status=held&limit=1", "/v1/jobs?limit=50",
                     "/v1/jobs?status=failed&flow_id=flow-b&limit=50"
                     f"&created_after={window['created_after']}&created_before={window['created_before']}"):
            assert client.get(path, headers=headers).status_code == 200
            _, median, worst = timed(lambda: client.get(path, headers=headers))
            print(f"HTTP (Flask test client) GET {path[:60]:60} median {median:6.2f} ms, worst {worst:6.2f}")

        old_small = timed(lambda: old_list(fresh(service), "small", "held", 1), runs=3)
        new_small = timed(lambda: service.list("small", ListQuery(status="held", limit=1)))
        print(f"\nold walk, status=held&limit=1 at 1,500 jobs: {old_small[1]:8.1f} ms median "
              f"(new: {new_small[1]:.2f} ms, x{old_small[1] / new_small[1]:,.0f} faster)")
        if not args.skip_old_100k:
            old_big = timed(lambda: old_list(fresh(service), "bench", "held", 1), runs=0)[0]
            new_big = timed(lambda: service.list("bench", ListQuery(status="held", limit=1)))[1]
            print(f"old walk, status=held&limit=1 at {total:,} jobs: {old_big:8.1f} ms once "
                  f"(new: {new_big:.2f} ms, x{old_big / new_big:,.0f} faster)")


if __name__ == "__main__":
    main()
