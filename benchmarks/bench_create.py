"""Job creation time and Redis memory over 1,000,000 items against 1,000 items.

Run: .venv/bin/python benchmarks/bench_create.py
Planning is lazy, so both should cost the same: time per create (median of 50, target < 50 ms) and
Redis memory per job (used_memory delta, averaged over 50 jobs).
"""

from __future__ import annotations

import statistics
import time

from _common import ledger_on_private_redis

from gateway.ledger.flows import parse_flow
from gateway.ledger.jobs import JobRequest

RUNS = 50


def measure(service, count: int) -> tuple[float, float]:
    flow = parse_flow({"id": f"create-{count}", "version": "1", "stages": [{"name": "process"}],
                       "batching": {"max_items": 100}, "source": {"type": "sequence", "count": count}})
    service.flows.register("bench", flow)
    r = service.ledger.r
    times = []
    before = r.info("memory")["used_memory"]
    for _ in range(RUNS):
        t0 = time.perf_counter()
        service.create("bench", JobRequest(flow_id=flow.id))
        times.append(time.perf_counter() - t0)
    per_job = (r.info("memory")["used_memory"] - before) / RUNS
    return statistics.median(times) * 1000, per_job


def main() -> None:
    with ledger_on_private_redis() as (ledger, service):
        measure(service, 10)  # warm up
        small_ms, small_mem = measure(service, 1_000)
        big_ms, big_mem = measure(service, 1_000_000)
    print(f"create over 1,000 items:     {small_ms:6.2f} ms median, {small_mem:8,.0f} B Redis memory per job")
    print(f"create over 1,000,000 items: {big_ms:6.2f} ms median, {big_mem:8,.0f} B Redis memory per job")
    print(f"time ratio 1M/1k = {big_ms / small_ms:.2f}, memory ratio 1M/1k = {big_mem / small_mem:.2f} "
          f"(target: 1M under 50 ms, ratios ~1)")


if __name__ == "__main__":
    main()
