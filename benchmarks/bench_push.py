"""End-to-end push-mode batches per second against bare RQ making the same HTTP call per job.

Run: .venv/bin/python benchmarks/bench_push.py [BATCHES] [WORKERS] [CONCURRENCY]   (defaults 2000, 1, 32)
Both sides run WORKERS worker processes on the same Redis and call the same no-op local platform (a
threaded HTTP server in this process). batchgate: `batchgate worker --concurrency CONCURRENCY`, a
one-stage push flow over BATCHES batches (flow concurrency 2 x CONCURRENCY), timed from job creation to
'succeeded'. Baseline: RQ's default forking worker (JSON serializer), BATCHES RQ jobs that POST an
envelope-sized body to the platform, timed from enqueue to the last one finished. Targets (issue 8):
batchgate >= 3x the baseline's rate and >= 300 batches/s on the project's 2-core machine.
Redis is pinned to one core; the workers and the platform share the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import redis
from _common import ledger_on_private_redis
from _noop_platform import start as start_platform
from rq import Queue
from rq.serializers import JSONSerializer

from gateway.push.dispatch import Dispatcher
from gateway.ledger.flows import parse_flow
from gateway.ledger.jobs import JobRequest

HERE = Path(__file__).resolve().parent


def workers(env: dict[str, str], count: int, bare: bool) -> list[subprocess.Popen]:
    if bare:
        code = ("import sys; sys.path.insert(0, %r); import redis, _bare_job; from rq import Worker, Queue; "
                "from rq.serializers import JSONSerializer; c = redis.Redis.from_url(%r); "
                "Worker([Queue('bare', connection=c, serializer=JSONSerializer)], connection=c, "
                "serializer=JSONSerializer).work(burst=False, logging_level='WARNING')"
                % (str(HERE), env["BATCHGATE_REDIS_URL"]))
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-m", "gateway.runtime.cli", "worker", "--concurrency", env["BENCH_CONCURRENCY"]]
    return [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(count)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait()


def run_batchgate(service, env, url: str, batches: int, n_workers: int) -> float:
    concurrency = int(env["BENCH_CONCURRENCY"])
    flow = parse_flow({"id": "push-bench", "version": "1", "concurrency": 2 * concurrency,
                       "batching": {"max_items": 10},
                       "source": {"type": "sequence", "count": batches * 10},
                       "stages": [{"name": "noop", "target": {"type": "http", "url": url, "mode": "sync",
                                                             "max_in_flight": 2 * concurrency}}]})
    service.flows.register("bench", flow)
    ledger = service.ledger
    procs = workers(env, n_workers, bare=False)
    time.sleep(1.5)  # let workers boot
    try:
        t0 = time.perf_counter()
        job_id = service.create("bench", JobRequest(flow_id="push-bench"))["job_id"]
        Dispatcher.build(ledger.settings, ledger).kick(job_id)  # as the API does on creation
        while ledger.r.hget(ledger.keys.job(job_id).job, "status") == "running":
            time.sleep(0.01)
        elapsed = time.perf_counter() - t0
        assert ledger.r.hget(ledger.keys.job(job_id).job, "status") == "succeeded"
    finally:
        stop(procs)
    return elapsed


def run_bare(env, url: str, batches: int, n_workers: int) -> float:
    conn = redis.Redis.from_url(env["BATCHGATE_REDIS_URL"])
    queue = Queue("bare", connection=conn, serializer=JSONSerializer)
    procs = workers(env, n_workers, bare=True)
    time.sleep(1.5)
    try:
        t0 = time.perf_counter()
        jobs = [queue.enqueue("_bare_job.call", url, {
            "job_id": "bare", "seq": i, "stage": "noop", "attempt": 1, "idempotency_key": f"bare:{i}:noop",
            "cursor": {"type": "offset", "offset": i * 10}, "items": list(range(i * 10, i * 10 + 10)),
            "input": None, "params": {}}, result_ttl=60) for i in range(batches)]
        last = jobs[-1]
        while queue.count or any(j.get_status(refresh=True) not in ("finished", "failed")
                                 for j in (last, jobs[len(jobs) // 2])):
            time.sleep(0.01)
        from rq.registry import StartedJobRegistry

        while StartedJobRegistry(queue=queue).count:
            time.sleep(0.01)
        elapsed = time.perf_counter() - t0
    finally:
        stop(procs)
    return elapsed


def main() -> None:
    batches = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    n_workers = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    concurrency = sys.argv[3] if len(sys.argv) > 3 else "32"
    url, server = start_platform()
    with ledger_on_private_redis() as (ledger, service):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))  # the workers may use every core
        settings = ledger.settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})
        ledger.settings = settings
        env = {**os.environ, "BATCHGATE_REDIS_URL": settings.redis_url.get_secret_value(),
               "BATCHGATE_KEY_PREFIX": settings.key_prefix, "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]',
               "BATCHGATE_SIGNING_KEY": "bench-signing-key", "BATCHGATE_LOG_LEVEL": "WARNING",
               "BENCH_CONCURRENCY": concurrency}
        ledger.settings = settings.model_copy(update={"signing_key": "bench-signing-key"})
        t_bare = run_bare(env, url, batches, n_workers)
        t_bg = run_batchgate(service, env, url, batches, n_workers)
    server.shutdown()
    bg_rate, bare_rate = batches / t_bg, batches / t_bare
    print(f"batchgate push: {batches} batches in {t_bg:.2f}s = {bg_rate:,.0f} batches/s "
          f"({n_workers} worker process(es), --concurrency {concurrency})")
    print(f"bare RQ:        {batches} jobs in {t_bare:.2f}s = {bare_rate:,.0f} jobs/s "
          f"({n_workers} forking worker process(es))")
    print(f"ratio batchgate/bare = {bg_rate / bare_rate:.2f} (target >= 3.0; batchgate >= 300 batches/s)")


if __name__ == "__main__":
    main()
