"""One `batchgate worker` process against a slow platform: calls in flight, time against the ideal, RSS.

Run: .venv/bin/python benchmarks/bench_worker_concurrency.py [BATCHES] [CONCURRENCY] [DELAY_S]
     (defaults 400, 200, 2.0: the issue's case)
A local sync platform (tests/platforms.py SlowSyncPlatform) answers each call after DELAY_S seconds
and counts the calls in flight and the calls per batch. A one-stage push flow (concurrency and
max_in_flight CONCURRENCY) over BATCHES one-item batches runs with one `batchgate worker --concurrency
CONCURRENCY` process, timed from job creation to 'succeeded'. The baseline is the ideal:
ceil(BATCHES / CONCURRENCY) x DELAY_S (every call as soon as it may start). Targets: peak calls in
flight >= 90 % of CONCURRENCY, time <= 2x the ideal, paid calls == batches, the worker's peak RSS
(process and children, VmRSS) < 300 MB.

Then the plan (issue 19): the first run left the target's call times in its latency list, so a dry run
(``"dry_run": true``: JobService.plan, nothing written) of the same job now estimates its duration from
them; the job runs a second time for real and the estimate is compared with that run (target: within
25 %), together with the plan's batch and call counts against the run's.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

from _common import ledger_on_private_redis, loopback_push

from gateway.push.dispatch import Dispatcher, target_id
from gateway.ledger.flows import parse_flow
from gateway.ledger.jobs import JobRequest
from tests.platforms import SlowSyncPlatform


def rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` and its children (MB)."""
    total = 0
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def run(service, env, platform: SlowSyncPlatform, batches: int, concurrency: int) -> tuple[float, float, str]:
    flow = parse_flow({"id": "slow", "version": "1", "concurrency": concurrency, "batching": {"max_items": 1},
                       "source": {"type": "sequence", "count": batches},
                       "stages": [{"name": "score", "lease": 30, "timeout": 10,
                                   "target": {"type": "http", "url": platform.url, "mode": "sync",
                                              "max_in_flight": concurrency}}]})
    service.flows.register("bench", flow)
    ledger = service.ledger
    proc = subprocess.Popen([sys.executable, "-m", "gateway.runtime.cli", "worker",
                             "--concurrency", str(concurrency)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(3)  # let the worker boot
    with platform.lock:  # count this run only
        platform.arrivals.clear()
        platform.peak = 0
    peak_rss = 0.0
    try:
        t0 = time.perf_counter()
        job_id = service.create("bench", JobRequest(flow_id="slow"))["job_id"]
        Dispatcher.build(ledger.settings, ledger).kick(job_id)  # as the API does on creation
        while ledger.r.hget(ledger.keys.job(job_id).job, "status") == "running":
            peak_rss = max(peak_rss, rss_mb(proc.pid))
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        assert ledger.r.hget(ledger.keys.job(job_id).job, "status") == "succeeded"
    finally:
        proc.terminate()
        proc.wait()
    return elapsed, peak_rss, job_id


def main() -> None:
    batches = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    concurrency = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
    platform = SlowSyncPlatform(delay)
    with ledger_on_private_redis() as (ledger, service):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))  # the worker may use every core
        env = loopback_push(ledger)
        elapsed, rss, _ = run(service, env, platform, batches, concurrency)
        seqs = platform.seqs()  # the first run's calls
        plan = service.plan("bench", JobRequest(flow_id="slow", dry_run=True), target_id)
        again, _, job_id = run(service, env, platform, batches, concurrency)
        planned = int(ledger.r.hget(ledger.keys.job(job_id).job, "next_seq"))
        calls = int(ledger.r.hget(ledger.keys.job(job_id).cost, "calls:0"))
    platform.close()
    ideal = math.ceil(batches / concurrency) * delay
    paid = len(seqs)
    duplicates = paid - len(set(seqs))
    print(f"{batches} batches, platform {delay:g} s per call, one worker process --concurrency {concurrency}")
    print(f"time {elapsed:.2f} s vs ideal {ideal:.2f} s: {elapsed / ideal:.2f}x the ideal (target <= 2x)")
    print(f"peak calls in flight {platform.peak} of {concurrency} (target >= {int(0.9 * concurrency)})")
    print(f"paid calls {paid} for {batches} batches, {duplicates} duplicates (target: equal, 0)")
    print(f"worker peak RSS {rss:.0f} MB (target < 300 MB)")
    print(f"plan of the same job from the first run's call times: batches {plan['batches']} "
          f"({plan['batches_confidence']}) vs {planned} run, calls {plan['calls']['score']} vs {calls}; "
          f"duration estimate {plan['duration_s']:.2f} s vs {again:.2f} s actual (second run): "
          f"ratio {plan['duration_s'] / again:.2f} (target 0.75-1.25)")


if __name__ == "__main__":
    main()
