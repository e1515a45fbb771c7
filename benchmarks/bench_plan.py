"""A dry run's duration estimate against the real run, on a slow platform.

Run: .venv/bin/python benchmarks/bench_plan.py [BATCHES] [PARALLEL] [DELAY_S]
     (defaults 80, 4, 0.5)
A local sync platform (tests/platforms.py SlowSyncPlatform) answers each call after DELAY_S seconds. A
one-stage push flow (flow concurrency and the target's max_in_flight PARALLEL, one-item batches) runs a
first job of 4 x PARALLEL batches with one `batchgate worker` process: the dispatcher keeps each call's
time in the target's latency list. Then a dry run plans a job of BATCHES batches (``"dry_run": true``:
JobService.plan, nothing written), and the same job runs for real, timed from creation to 'succeeded'.
Prints the plan's batches and calls against the run's, the estimate against the actual duration and
their ratio (target: within 25 %).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from _common import ledger_on_private_redis, loopback_push

from gateway.ledger.flows import parse_flow
from gateway.ledger.jobs import JobRequest
from gateway.push.dispatch import Dispatcher, target_id
from tests.platforms import SlowSyncPlatform


def run_job(service, count: int) -> tuple[str, float]:
    """Create a job over ``count`` items and wait for it; its id and seconds from creation to the end."""
    ledger = service.ledger
    t0 = time.perf_counter()
    job_id = service.create("bench", JobRequest(flow_id="slow-plan", source={"type": "sequence",
                                                                            "count": count}))["job_id"]
    Dispatcher.build(ledger.settings, ledger).kick(job_id)  # as the API does on creation
    while ledger.r.hget(ledger.keys.job(job_id).job, "status") == "running":
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    assert ledger.r.hget(ledger.keys.job(job_id).job, "status") == "succeeded"
    return job_id, elapsed


def main() -> None:
    batches = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    parallel = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    platform = SlowSyncPlatform(delay)
    with ledger_on_private_redis() as (ledger, service):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        env = loopback_push(ledger)
        flow = parse_flow({"id": "slow-plan", "version": "1", "concurrency": parallel,
                           "batching": {"max_items": 1}, "source": {"type": "sequence", "count": 1},
                           "stages": [{"name": "score", "lease": 30, "timeout": 10,
                                       "target": {"type": "http", "url": platform.url, "mode": "sync",
                                                  "max_in_flight": parallel}}]})
        service.flows.register("bench", flow)
        proc = subprocess.Popen([sys.executable, "-m", "gateway.runtime.cli", "worker", "--concurrency",
                                 str(max(parallel, 8))], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            time.sleep(3)  # let the worker boot
            run_job(service, 4 * parallel)  # history: the target's latency list
            request = JobRequest(flow_id="slow-plan", source={"type": "sequence", "count": batches},
                                 dry_run=True)
            plan = service.plan("bench", request, target_id)
            job_id, actual = run_job(service, batches)
            planned = int(ledger.r.hget(ledger.keys.job(job_id).job, "next_seq"))
            calls = int(ledger.r.hget(ledger.keys.job(job_id).cost, "calls:0"))  # the one stage's
        finally:
            proc.terminate()
            proc.wait()
    platform.close()
    estimate = plan["duration_s"]
    stage = plan["stages"][0]
    print(f"{batches} one-item batches, platform {delay:g} s per call, {parallel} at once")
    print(f"batches: plan {plan['batches']} ({plan['batches_confidence']}), run {planned}")
    print(f"calls: plan {plan['calls']['score']}, run {calls}")
    print(f"call time: {stage['call_seconds']} s from {stage['call_seconds_samples']} samples "
          f"({stage['call_seconds_confidence']})")
    print(f"duration: estimate {estimate:.2f} s, actual {actual:.2f} s, ratio {estimate / actual:.2f} "
          f"(target 0.75-1.25)")


if __name__ == "__main__":
    main()
