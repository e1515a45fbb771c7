"""Redis CPU per pull step (lease + complete), measured inside Redis, against a SET+GET pair.

Run: .venv/bin/python benchmarks/bench_step_cost.py [STEPS [ROUNDS]]   (default 1,000 x 5)

Redis counts the microseconds it spends in each command (INFO commandstats, usec): the CPU one
Redis core gives each call, whatever the network and the client cost. A step is one lease and one
complete of a one-stage job (EVALSHA each, plus what the ledger sends around them: the job index
read-back, spec reads). Reset the stats, run the steps, read them; the same for SET+GET pairs in the
same run as the baseline (what a trivial endpoint pair costs Redis). Prints the cost per step by
command, the total, and the ratio to the pair (issue 18's goal: <= 150 us per step).
"""

from __future__ import annotations

import statistics
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


def separate(ledger, job_id: str, steps: int) -> None:
    """A pull loop that leases, then completes: two scripts, two round trips per step."""
    for _ in range(steps):
        lease = ledger.lease(job_id)
        ledger.complete(job_id, lease.seq, lease.lease_token, {"n": len(lease.items or [])})


def combined(ledger, job_id: str, steps: int) -> None:
    """A pull loop that completes and leases the next batch in one call (POST .../complete with
    lease_next): one script, one round trip per step."""
    lease = ledger.lease(job_id)
    for _ in range(steps):
        _, lease = ledger.complete_and_lease(job_id, lease.seq, lease.lease_token,
                                             {"n": len(lease.items or [])})
    ledger.complete(job_id, lease.seq, lease.lease_token, {"n": 0})


def pairs(r, steps: int) -> None:
    for i in range(steps):
        r.set(f"bench:pair:{i % 100}", "x" * 64)
        r.get(f"bench:pair:{i % 100}")


def main(steps: int, rounds: int = 5) -> None:
    """``rounds`` interleaved rounds of ``steps`` steps each way and ``steps`` SET+GET pairs: on a shared
    machine the least-disturbed round (the minimum) is the cost, the median says how noisy the run was."""
    kinds = {"lease, then complete": separate, "complete with lease_next": combined}
    cpu: dict[str, list[float]] = {name: [] for name in [*kinds, "pair"]}
    scripts: dict[str, list[float]] = {name: [] for name in kinds}
    stats: dict[str, dict] = {}
    with ledger_on_private_redis() as (ledger, service):
        r = ledger.r
        job_id = start_job(service, "cost", ((steps + 2) * rounds * 2 + 20) * 10, max_items=10)
        separate(ledger, job_id, 10)  # warm
        started = time.perf_counter()
        for _ in range(rounds):
            for name, run in kinds.items():
                before, cpu0 = commandstats(r), cpu_s(r)
                run(ledger, job_id, steps)
                cpu[name].append((cpu_s(r) - cpu0) / steps * 1e6)
                got = delta(commandstats(r), before)
                scripts[name].append(got.get("evalsha", (0, 0.0))[1] / steps)
                if name not in stats or scripts[name][-1] == min(scripts[name]):
                    stats[name] = got
            cpu0 = cpu_s(r)
            pairs(r, steps)
            cpu["pair"].append((cpu_s(r) - cpu0) / steps * 1e6)
        wall = time.perf_counter() - started
    pair = min(cpu["pair"])
    print(f"{rounds} rounds of {steps} pull steps each way and {steps} SET+GET pairs in {wall:.1f} s; "
          f"least-disturbed round (median in brackets)")
    print(f"SET+GET pair, Redis process CPU: {pair:6.1f} us ({statistics.median(cpu['pair']):.1f})")
    for name in kinds:
        step = min(cpu[name])
        calls = stats[name].get("evalsha", (0, 0))[0] / steps
        print(f"{name:<26} Redis process CPU per step (INFO cpu, user+sys): {step:6.1f} us "
              f"({statistics.median(cpu[name]):.1f})  {step / pair:.1f}x a pair;  in scripts (EVALSHA "
              f"usec): {min(scripts[name]):6.1f} us ({calls:.2f} scripts per step)")
    for name in kinds:
        print(f"commands per step, {name} (INFO commandstats; those the scripts call are counted here and "
              f"inside EVALSHA):")
        for cmd, (calls, usec) in sorted(stats[name].items(), key=lambda kv: -kv[1][1]):
            if cmd not in ("evalsha", "info"):
                print(f"  {cmd:<14} {usec / steps:7.1f} us  {calls / steps:5.2f} calls")
    print("goal (issue 18): <= 150 us of Redis CPU per step")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
