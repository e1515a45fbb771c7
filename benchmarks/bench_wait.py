"""What WAIT 1 after each commit costs (BATCHGATE_REDIS_WAIT_REPLICAS=1), on a local Redis Cluster.

Run: .venv/bin/python benchmarks/bench_wait.py [N]   (default 3,000 commits per mode, 10 interleaved rounds)
Starts a cluster of 3 masters and 3 replicas (tests/cluster.py, the tests' redis-server, AOF on), then
leases and completes one-stage batches through the Python ledger on a RedisCluster client, with and without
WAIT 1 (timeout 500 ms) after each commit script; only the complete calls are timed. Prints commits/s for
both, their ratio, the added time per commit, and how many WAITs came back short.
"""

from __future__ import annotations

import sys
import tempfile
import time

from _common import start_job

from gateway import metrics
from gateway.ledger.embedded import client_for
from gateway.ledger.flows import FlowRegistry
from gateway.ledger.jobs import JobService
from gateway.ledger.ledger import Ledger
from gateway.settings import Settings
from tests.cluster import LocalCluster


def commits(ledger: Ledger, job_id: str, n: int) -> float:
    """Seconds spent in ``n`` complete calls (leases taken outside the timed part)."""
    spent = 0.0
    for _ in range(n):
        lease = ledger.lease(job_id)
        start = time.perf_counter()
        ledger.complete(job_id, lease.seq, lease.lease_token, {"ok": 1})
        spent += time.perf_counter() - start
    return spent


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rounds = 10
    per_round = total // rounds
    cluster = LocalCluster(tempfile.mkdtemp(prefix="bg-bench-cluster-")).start()
    try:
        settings = Settings(redis_url=cluster.url, queue_redis_url="redis://127.0.0.1:1/0",
                            key_prefix="bench")
        client = client_for(cluster.url, settings)
        plain = Ledger(client, settings)
        waiting = Ledger(client, settings.model_copy(update={"redis_wait_replicas": 1}))
        service = JobService(plain, FlowRegistry(client, plain.keys))
        jobs = {name: start_job(service, f"wait-{name}", total * 2, max_items=1) for name in ("off", "on")}
        for name, ledger in (("off", plain), ("on", waiting)):  # warm up: scripts loaded, specs cached
            commits(ledger, jobs[name], 50)
        spent = {"off": 0.0, "on": 0.0}
        short = metrics.REDIS_WAIT_SHORT.labels("complete")
        before = short._value.get()
        for _ in range(rounds):
            spent["off"] += commits(plain, jobs["off"], per_round)
            spent["on"] += commits(waiting, jobs["on"], per_round)
        n = per_round * rounds
        off, on = n / spent["off"], n / spent["on"]
        print(f"commits/s without WAIT: {off:,.0f}   with WAIT 1: {on:,.0f}   ratio {on / off:.2f}x   "
              f"added per commit: {(spent['on'] - spent['off']) / n * 1e6:,.0f} us   "
              f"short WAITs: {int(short._value.get() - before)} of {n}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
