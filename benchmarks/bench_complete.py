"""Stage completion rate against a plain redis-py SET round-trip loop on the same server.

Run: .venv/bin/python benchmarks/bench_complete.py [N]   (default 10,000, in 20 interleaved rounds)
Prints both rates, their ratio (target >= 0.5), and the Redis round trips per completion (target 1).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis.connection
from _common import ledger_on_private_redis, start_job


class RoundTrips:
    """Counts commands sent on any connection (a pipeline counts once)."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = redis.connection.AbstractConnection.send_packed_command

    def __enter__(self) -> RoundTrips:
        counter = self

        def counting(conn, command, check_health=True):
            counter.count += 1
            return counter._orig(conn, command, check_health)

        redis.connection.AbstractConnection.send_packed_command = counting
        return self

    def __exit__(self, *exc) -> None:
        redis.connection.AbstractConnection.send_packed_command = self._orig

    @contextmanager
    def paused(self) -> Iterator[None]:
        counted = self.count
        yield
        self.count = counted


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    rounds = 20
    per_round = n // rounds
    with ledger_on_private_redis() as (ledger, service):
        job_id = start_job(service, "complete-bench", count=n * 10 + 10, max_items=10)
        output = {"score": 87, "label": "shortlist"}
        first = ledger.lease(job_id)
        ledger.complete(job_id, first.seq, first.lease_token, output)  # load the script
        r = ledger.r
        t_complete = t_set = 0.0
        with RoundTrips() as trips:
            # interleaved rounds, so both loops see the same machine; only the loops are timed
            for rnd in range(rounds):
                with trips.paused():
                    leases = [ledger.lease(job_id) for _ in range(per_round)]
                t0 = time.perf_counter()
                for lease in leases:
                    ledger.complete(job_id, lease.seq, lease.lease_token, output)
                t_complete += time.perf_counter() - t0
                with trips.paused():
                    t0 = time.perf_counter()
                    for i in range(per_round):
                        r.set(f"bench:set:{rnd}:{i}", "x")
                    t_set += time.perf_counter() - t0
    done = per_round * rounds
    complete_rate, set_rate = done / t_complete, done / t_set
    print(f"completions: {done} in {t_complete:.3f}s = {complete_rate:,.0f}/s")
    print(f"plain SET:   {done} in {t_set:.3f}s = {set_rate:,.0f}/s")
    print(f"ratio completion/SET = {complete_rate / set_rate:.2f} (target >= 0.50)")
    print(f"redis round trips per completion = {trips.count / done:.2f} (target 1)")


if __name__ == "__main__":
    main()
