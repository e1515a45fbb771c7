"""Redis CPU per pull step (lease + complete), measured inside Redis, against a SET+GET pair.

Run: .venv/bin/python benchmarks/bench_step_cost.py [STEPS]   (default 5,000)

Redis counts the microseconds it spends in each command (INFO commandstats, usec): the CPU one
Redis core gives each call, whatever the network and the client cost. A step is one lease and one
complete of a one-stage job (EVALSHA each, plus what the ledger sends around them: the job index
read-back, spec reads). Reset the stats, run the steps, read them; the same for SET+GET pairs in the
same run as the baseline (what a trivial endpoint pair costs Redis). Prints the cost per step by
command, the total, and the ratio to the pair (issue 18's goal: <= 150 us per step).
"""

from __future__ import annotations

import sys
import time

from _common import ledger_on_private_redis, start_job


def commandstats(r) -> dict[str, tuple[int, float]]:
    """command -> (calls, usec) so far (the embedded Redis refuses CONFIG RESETSTAT: deltas are taken)."""
    out = {}
    for name, stats in r.info("commandstats").items():
        out[name.removeprefix("cmdstat_")] = (int(stats["calls"]), float(stats["usec"]))
    return out


def cpu_s(r) -> float:
    """The Redis process's CPU seconds so far (user + system: command execution, I/O, everything)."""
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def delta(after: dict, before: dict) -> dict[str, tuple[int, float]]:
    return {name: (calls - before.get(name, (0, 0.0))[0], usec - before.get(name, (0, 0.0))[1])
            for name, (calls, usec) in after.items() if calls != before.get(name, (0, 0.0))[0]}


def main(steps: int) -> None:
    with ledger_on_private_redis() as (ledger, service):
        r = ledger.r
        job_id = start_job(service, "cost", (steps + 1) * 10, max_items=10)
        ledger.complete(job_id, (lease := ledger.lease(job_id)).seq, lease.lease_token, {"n": 1})  # warm
        before, cpu0 = commandstats(r), cpu_s(r)
        started = time.perf_counter()
        for _ in range(steps):
            lease = ledger.lease(job_id)
            ledger.complete(job_id, lease.seq, lease.lease_token, {"n": len(lease.items or [])})
        wall = time.perf_counter() - started
        step_cpu = (cpu_s(r) - cpu0) / steps * 1e6
        steps_stats = delta(commandstats(r), before)
        before, cpu0 = commandstats(r), cpu_s(r)
        for i in range(steps):
            r.set(f"bench:pair:{i % 100}", "x" * 64)
            r.get(f"bench:pair:{i % 100}")
        pair_cpu = (cpu_s(r) - cpu0) / steps * 1e6
        pair_stats = delta(commandstats(r), before)
    per_step = {name: usec / steps for name, (calls, usec) in steps_stats.items() if name != "info"}
    scripts = per_step.get("evalsha", 0.0)
    pair = sum(usec for name, (_, usec) in pair_stats.items() if name in ("set", "get")) / steps
    print(f"{steps} pull steps (lease + complete) in {wall:.2f} s: {steps / wall:.0f} steps/s from one client")
    print(f"Redis process CPU per step (INFO cpu, user+sys): {step_cpu:7.1f} us   "
          f"SET+GET pair: {pair_cpu:5.1f} us   ratio {step_cpu / pair_cpu:.1f}x")
    print(f"  of which the ledger's scripts (EVALSHA usec): {scripts:7.1f} us "
          f"({steps_stats.get('evalsha', (0, 0))[0] / steps:.2f} scripts per step)")
    print("commands per step (INFO commandstats; those the scripts call are counted here and inside EVALSHA):")
    for name, usec in sorted(per_step.items(), key=lambda kv: -kv[1]):
        if name == "evalsha":
            continue
        print(f"  {name:<14} {usec:7.1f} us  {steps_stats[name][0] / steps:5.2f} calls")
    print(f"SET+GET pair by commandstats: {pair:.1f} us.   goal (issue 18): <= 150 us of Redis CPU per step")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5000)
