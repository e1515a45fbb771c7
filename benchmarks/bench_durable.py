"""Durable steps per second: batchgate's ledger against LangGraph's SqliteSaver, same machine, same run.

Run: .venv/bin/python benchmarks/bench_durable.py [STEPS [ROUNDS [CLIENTS]]]   (default 2,000 x 3, 4)
Needs `pip install langgraph langgraph-checkpoint-sqlite` (not a dependency of batchgate).

LangGraph: one graph whose single node loops on itself STEPS times in one invoke, checkpointed by
SqliteSaver on a file with synchronous=NORMAL (WAL: a commit is written, fsynced at checkpoints) and
durability "sync" (each step's checkpoint is written before the next step runs). batchgate: a pull loop
on a one-stage job through the ledger on the embedded Redis with AOF on (appendfsync everysec: the same
class of durability), one client, each step one commit that also leases the next batch
(complete_and_lease: what POST .../complete with lease_next does), and, for reference, a lease then a
complete (two calls). Rounds interleave; the best round of each is compared (issue 18's goal: >= 3x).
"""

from __future__ import annotations

import operator
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, TypedDict

from _common import ledger_on_private_redis, start_job


def langgraph_steps_per_s(steps: int, folder: Path) -> float:
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict):
        n: Annotated[int, operator.add]

    def step(state: State) -> dict:
        return {"n": 1}

    graph = StateGraph(State)
    graph.add_node("step", step)
    graph.add_edge(START, "step")
    graph.add_conditional_edges("step", lambda s: END if s["n"] >= steps else "step")
    conn = sqlite3.connect(folder / f"lg-{time.monotonic_ns()}.sqlite", check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    app = graph.compile(checkpointer=SqliteSaver(conn))
    started = time.perf_counter()
    out = app.invoke({"n": 0}, {"configurable": {"thread_id": "bench"}, "recursion_limit": steps + 10},
                     durability="sync")
    took = time.perf_counter() - started
    assert out["n"] == steps
    conn.close()
    return steps / took


def ledger_steps_per_s(ledger, job_id: str, steps: int, combined: bool) -> float:
    started = time.perf_counter()
    if combined:
        lease = ledger.lease(job_id)
        for _ in range(steps - 1):
            _, lease = ledger.complete_and_lease(job_id, lease.seq, lease.lease_token, {"n": 1})
        ledger.complete(job_id, lease.seq, lease.lease_token, {"n": 1})
    else:
        for _ in range(steps):
            lease = ledger.lease(job_id)
            ledger.complete(job_id, lease.seq, lease.lease_token, {"n": 1})
    return steps / (time.perf_counter() - started)


def _client(url: str, job_id: str, steps: int, start, out) -> None:
    """One pull client process: a ledger of its own on the same Redis, ``steps`` combined steps."""
    from gateway.ledger.embedded import client_for
    from gateway.ledger.ledger import Ledger
    from gateway.settings import Settings

    ledger = Ledger(client_for(url), Settings(redis_url=url, key_prefix="bench"))
    ledger.spec(job_id)
    start.wait()
    out.put(ledger_steps_per_s(ledger, job_id, steps, True))


def parallel_steps_per_s(url: str, job_id: str, steps: int, clients: int) -> float:
    """``clients`` processes stepping one job at once (its batches run in parallel, as a job's do):
    steps per second of them all, from the first start to the last end."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(url, job_id, steps, start, out)) for _ in range(clients)]
    for proc in procs:
        proc.start()
    time.sleep(0.5)  # every client connected and waiting
    began = time.perf_counter()
    start.set()
    for proc in procs:
        proc.join()
    took = time.perf_counter() - began
    return clients * steps / took


def main(steps: int, rounds: int, clients: int = 4) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bg-durable-"))
    got: dict[str, list[float]] = {"langgraph": [], "combined": [], "separate": [], "parallel": []}
    with ledger_on_private_redis() as (ledger, service):
        assert ledger.r.info("persistence")["aof_enabled"] == 1, "the embedded Redis runs AOF"
        job_id = start_job(service, "durable", (steps * rounds * (2 + clients) + 100) * 10, max_items=10)
        ledger_steps_per_s(ledger, job_id, 50, True)  # warm
        for _ in range(rounds):
            got["langgraph"].append(langgraph_steps_per_s(steps, folder))
            got["combined"].append(ledger_steps_per_s(ledger, job_id, steps, True))
            got["separate"].append(ledger_steps_per_s(ledger, job_id, steps, False))
            got["parallel"].append(parallel_steps_per_s(ledger.settings.redis_url.get_secret_value(), job_id,
                                                        steps, clients))
    best = {name: max(values) for name, values in got.items()}
    print(f"{rounds} rounds of {steps} durable steps, best round (steps/s):")
    print(f"  LangGraph SqliteSaver, durability sync, synchronous=NORMAL: {best['langgraph']:8.0f}")
    print(f"  batchgate ledger, complete with lease_next (1 call/step):  {best['combined']:8.0f}  "
          f"{best['combined'] / best['langgraph']:.2f}x")
    print(f"  batchgate ledger, lease then complete (2 calls/step):     {best['separate']:8.0f}  "
          f"{best['separate'] / best['langgraph']:.2f}x")
    print(f"  batchgate ledger, {clients} client processes on one job (1 call/step): {best['parallel']:8.0f}  "
          f"{best['parallel'] / best['langgraph']:.2f}x")
    print("goal (issue 18): >= 3x LangGraph")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    main(*(args + [2000, 3, 4][len(args):]))
