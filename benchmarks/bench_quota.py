"""What the per-tenant quotas cost a pull step: lease + complete through the API, quotas on against off.

Run: .venv/bin/python benchmarks/bench_quota.py [PAIRS]   (default 2,000 per side, in 10 interleaved rounds)
Both apps run in this process (Flask's test client: no socket, so the difference is not hidden in HTTP
time) on one private redis-server. "on" counts every lease request (quota.lua, with a limit this run never
reaches, so only the counting is measured); "off" sets every quota to 0 (nothing counted). Prints pairs/s of each and on/off.
"""

from __future__ import annotations

import sys
import time

from _common import ledger_on_private_redis

from gateway.api.app import create_app

TOKEN = "t-bench-0123456789"


def app_for(ledger, **quotas):
    settings = ledger.settings.model_copy(update={"tokens": {TOKEN: "bench"}, **quotas})
    return create_app(settings, ledger.r).test_client()


def pairs(client, job_id: str, n: int) -> float:
    """Lease and complete ``n`` batches; returns the seconds it took."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    start = time.perf_counter()
    for _ in range(n):
        env = client.post(f"/v1/jobs/{job_id}/lease", headers=auth).get_json()
        client.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete", headers=auth,
                    json={"lease_token": env["lease_token"], "output": {}})
    return time.perf_counter() - start


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    rounds = 10
    per_round = total // rounds
    with ledger_on_private_redis() as (ledger, service):
        from _common import start_job

        on = app_for(ledger, quota_leases_per_second=1_000_000)  # counted, never refused here
        off = app_for(ledger, quota_active_jobs=0, quota_job_creations_per_minute=0,
                      quota_leases_per_second=0)
        jobs = {name: start_job(service, f"q-{name}", total * 2, max_items=1) for name in ("on", "off")}
        spent = {"on": 0.0, "off": 0.0}
        for _ in range(rounds):
            for name, client in (("off", off), ("on", on)):
                spent[name] += pairs(client, jobs[name], per_round)
    rate = {name: rounds * per_round / s for name, s in spent.items()}
    print(f"pull steps (lease + complete, in-process) quotas off: {rate['off']:,.0f}/s  "
          f"on: {rate['on']:,.0f}/s  on/off: {rate['on'] / rate['off']:.2f}x")


if __name__ == "__main__":
    main()
