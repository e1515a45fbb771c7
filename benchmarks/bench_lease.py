"""The lease path: round trips per lease, leases per second, and a durable step against LangGraph's.

Run: .venv/bin/python benchmarks/bench_lease.py [STEPS]   (default 5,000)
Needs the optional extra: .venv/bin/pip install -e '.[bench]'  (langgraph, langgraph-checkpoint-sqlite)

Prints, on one client against a private redis-server (AOF on, appendfsync everysec):
  - Redis round trips per lease (commands on the wire, counted in redis-py as bench_complete.py does),
    for a lease that finds a planned batch ready (target 1) and one that must plan first (target <= 2);
  - leases per second: with planning ahead (the default), and planning one batch per lease;
  - the durable step rate: lease + complete through the Python ledger, one batch per step;
  - LangGraph's checkpointed step rate in the same run: a StateGraph with one trivial node compiled with
    a SqliteSaver on a file DB (next to nothing else: same disk as the Redis AOF), one ``invoke`` per step
    on one thread_id per round. The baseline is durability "sync" (LangGraph: "changes are persisted
    synchronously before the next step starts": a step is durable when invoke returns, as a committed
    batch is) with SQLite in WAL mode (SqliteSaver.setup sets it) and ``synchronous=NORMAL``, which, like
    Redis's ``appendfsync everysec``, survives a killed process and may lose the last moments to a
    machine crash. Also shown: SQLite's default ``synchronous=FULL`` (an fsync per commit), and the
    "async" (LangGraph's default) and "exit" durability modes (for a one-node graph "exit" writes one
    checkpoint per invoke instead of two);
  - the ratio durable step / each SqliteSaver step (target >= 3x against the baseline).
Rounds interleave the sides, so all see the same machine; only the loops are timed.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from _common import ledger_on_private_redis, start_job
from bench_complete import RoundTrips

ROUNDS = 20

try:
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph
    from typing_extensions import TypedDict
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("bench_lease.py needs LangGraph for its baseline: .venv/bin/pip install -e '.[bench]' "
             "(or: .venv/bin/pip install langgraph langgraph-checkpoint-sqlite)")


class State(TypedDict):
    n: int


def _step(state: State) -> State:
    return {"n": state["n"] + 1}


BASELINES = (("sync", "NORMAL"), ("sync", "FULL"), ("async", "NORMAL"), ("exit", "NORMAL"))


def langgraph_app(db: Path, synchronous: str):
    conn = sqlite3.connect(db, check_same_thread=False)
    saver = SqliteSaver(conn)
    saver.setup()  # journal_mode=WAL
    conn.execute(f"PRAGMA synchronous={synchronous}")
    graph = StateGraph(State)
    graph.add_node("step", _step)
    graph.add_edge(START, "step")
    graph.add_edge("step", END)
    return graph.compile(checkpointer=saver), conn


def langgraph_steps(app, thread: str, steps: int, durability: str) -> float:
    """Seconds for ``steps`` invokes of the one-node graph on one thread (each invoke checkpoints)."""
    config = {"configurable": {"thread_id": thread}}
    t0 = time.perf_counter()
    for i in range(steps):
        app.invoke({"n": i}, config, durability=durability)
    return time.perf_counter() - t0


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5_000
    per_round = steps // ROUNDS
    output = {"score": 87, "label": "shortlist"}
    tmp = Path(tempfile.mkdtemp(prefix="bg-bench-lease-"))
    apps = {base: langgraph_app(tmp / f"{base[0]}-{base[1]}.sqlite", base[1]) for base in BASELINES}
    with ledger_on_private_redis() as (ledger, service):
        r = ledger.r
        ledger.lease(start_job(service, "warm", count=10))  # scripts loaded, code paths warm

        # -- round trips and leases/s: planning ahead (default) vs one batch per plan --------------------
        results = {}
        default_ahead = ledger.plan_ahead
        for label, ahead in (("ahead", default_ahead), ("lazy", 1)):
            ledger.plan_ahead = ahead
            job_id = start_job(service, f"lease-{label}", count=steps * 10 + 10, max_items=10)
            ledger.spec(job_id)  # cached, as in any long-running worker
            k = ledger.keys.job(job_id)
            trips_ready = trips_plan = n_ready = n_plan = 0
            elapsed = 0.0
            with RoundTrips() as trips:
                for _ in range(steps):
                    with trips.paused():
                        before = int(r.hget(k.job, "next_seq"))
                    counted = trips.count
                    t0 = time.perf_counter()
                    lease = ledger.lease(job_id)
                    elapsed += time.perf_counter() - t0
                    used = trips.count - counted
                    with trips.paused():
                        ledger.complete(job_id, lease.seq, lease.lease_token, output)  # not timed
                        if int(r.hget(k.job, "next_seq")) > before:
                            n_plan, trips_plan = n_plan + 1, trips_plan + used
                        else:
                            n_ready, trips_ready = n_ready + 1, trips_ready + used
            results[label] = (steps / elapsed, n_ready, trips_ready, n_plan, trips_plan)
        ledger.plan_ahead = default_ahead

        # -- durable step vs LangGraph, interleaved rounds ---------------------------------------------
        job_id = start_job(service, "step", count=steps * 10 + 10, max_items=10)
        ledger.spec(job_id)
        for (mode, _), (app, _) in apps.items():
            langgraph_steps(app, "warm", 50, mode)  # table set-up, first compile paths
        t_ours = 0.0
        t_base = dict.fromkeys(BASELINES, 0.0)
        for rnd in range(ROUNDS):
            t0 = time.perf_counter()
            for _ in range(per_round):
                lease = ledger.lease(job_id)
                ledger.complete(job_id, lease.seq, lease.lease_token, output)
            t_ours += time.perf_counter() - t0
            for base, (app, _) in apps.items():
                t_base[base] += langgraph_steps(app, f"round-{rnd}", per_round, base[0])
    for _, conn in apps.values():
        conn.close()

    done = per_round * ROUNDS
    ours = done / t_ours
    for label, (rate, n_ready, trips_ready, n_plan, trips_plan) in results.items():
        name = f"plan_ahead={ledger.plan_ahead}" if label == "ahead" else "plan_ahead=1"
        print(f"leases ({name}): {rate:,.0f}/s; round trips per lease: "
              f"ready {trips_ready / max(n_ready, 1):.2f} ({n_ready} leases), "
              f"planning {trips_plan / max(n_plan, 1):.2f} ({n_plan} leases), "
              f"all {(trips_ready + trips_plan) / steps:.2f}")
    print(f"durable step (lease + complete, one client): {done} in {t_ours:.3f}s = {ours:,.0f}/s")
    for (mode, synchronous), seconds in t_base.items():
        rate = done / seconds
        label = " (baseline, target >= 3x)" if (mode, synchronous) == BASELINES[0] else ""
        print(f"LangGraph SqliteSaver step, durability={mode}, synchronous={synchronous}: {done} in "
              f"{seconds:.3f}s = {rate:,.0f}/s; durable step / this = {ours / rate:.2f}x{label}")


if __name__ == "__main__":
    main()
