"""Commit rate on a Redis Cluster of 1 master against one of 3 masters, in the same run.

Run: .venv/bin/python benchmarks/bench_cluster.py [--clients 6] [--seconds 5] [--rounds 4] [--replicas 0]
Starts a local cluster of 1 master and one of 3 masters (tests/cluster.py: the tests' redis-server, AOF
on), ``--replicas`` replicas per master. In each of ``--rounds`` rounds, on one cluster then the other,
``--clients`` processes (each its own RedisCluster client and its own job of one-stage, one-item
batches, the jobs spread evenly over the masters) lease and complete batches through the Python ledger
for ``--seconds``. Prints commits/s per cluster (and per round), their ratio, and CPU per commit: Redis
(user + sys, from INFO of every node) and the clients'.

On a machine with fewer cores than masters plus clients the ratio says how much the client side and the
masters' shared cores cap the scaling, not what 3 masters on 3 machines give (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import tempfile
import time

import _common  # noqa: F401 - puts the repository on sys.path

from gateway.ledger.embedded import client_for
from gateway.ledger.flows import FlowRegistry, parse_flow
from gateway.ledger.jobs import JobRequest, JobService, new_job_id
from gateway.ledger.ledger import Ledger
from gateway.settings import Settings
from tests.cluster import LocalCluster

QUEUE_URL = "redis://127.0.0.1:1/0"  # required in cluster mode, never used here


def settings_for(url: str) -> Settings:
    return Settings(redis_url=url, queue_redis_url=QUEUE_URL, key_prefix="bench")


def client_loop(url: str, job_id: str, seconds: float, start_at: float, out) -> None:
    """Lease and complete batches of ``job_id`` from ``start_at`` for ``seconds``; put the count."""
    settings = settings_for(url)
    ledger = Ledger(client_for(url, settings), settings)
    for _ in range(20):  # warm up: scripts, the spec cache, the cluster's slot map
        lease = ledger.lease(job_id)
        ledger.complete(job_id, lease.seq, lease.lease_token, {"ok": 1})
    while time.time() < start_at:
        time.sleep(0.001)
    done, stop = 0, start_at + seconds
    while time.time() < stop:
        lease = ledger.lease(job_id)
        ledger.complete(job_id, lease.seq, lease.lease_token, {"ok": 1})
        done += 1
    out.put(done)


def spread_jobs(service: JobService, client, masters: int, count: int, items: int) -> list[str]:
    """``count`` jobs over ``items`` one-item batches each, as many on each master as can be (job ids
    drawn until each master has its share)."""
    per = {node.port: 0 for node in client.get_primaries()}
    share = -(-count // masters)
    service.flows.register("bench", parse_flow({
        "id": "cluster-bench", "version": "1", "concurrency": 1000, "batching": {"max_items": 1},
        "stages": [{"name": "process", "lease": 3600}], "source": {"type": "sequence", "count": items}}))
    jobs: list[str] = []
    while len(jobs) < count:
        job_id = new_job_id()
        port = client.get_node_from_key(service.ledger.keys.job(job_id).job).port
        if per[port] < share:
            per[port] += 1
            jobs.append(service.create("bench", JobRequest(flow_id="cluster-bench"), job_id=job_id)["job_id"])
    return jobs


def _children_cpu_s() -> float:
    """CPU seconds of this process's ended and waited-for children (the clients, not the servers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def redis_cpu_s(cluster: LocalCluster) -> float:
    total = 0.0
    for port in cluster.ports:
        with cluster.node(port) as node:
            info = node.info("cpu")
            total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


def setup(masters: int, replicas: int, clients: int) -> tuple[LocalCluster, list[str]]:
    """A fresh cluster of ``masters`` masters and one job per client, spread over the masters."""
    cluster = LocalCluster(tempfile.mkdtemp(prefix="bg-bench-cluster-"), masters=masters,
                           replicas=replicas).start()
    settings = settings_for(cluster.url)
    client = client_for(cluster.url, settings)
    ledger = Ledger(client, settings)
    jobs = spread_jobs(JobService(ledger, FlowRegistry(client, ledger.keys)), client, masters, clients,
                       items=1_000_000)  # more than any client completes
    client.close()
    return cluster, jobs


def run_round(cluster: LocalCluster, jobs: list[str], seconds: float) -> tuple[int, float, float]:
    """(commits, Redis CPU s, client CPU s) of one timed round, one client process per job; client CPU
    also counts each client's start (its cluster client, the slot map) and warm-up (20 steps), a few
    per cent of a 5 s round."""
    out = multiprocessing.Queue()
    clients_before = _children_cpu_s()
    start_at = time.time() + 2.0  # every client warmed up and waiting
    procs = [multiprocessing.Process(target=client_loop, args=(cluster.url, job_id, seconds, start_at, out))
             for job_id in jobs]
    for proc in procs:
        proc.start()
    while time.time() < start_at:
        time.sleep(0.01)
    cpu_before = redis_cpu_s(cluster)
    counts = [out.get(timeout=seconds + 60) for _ in procs]
    cpu = redis_cpu_s(cluster) - cpu_before
    for proc in procs:
        proc.join()
    return sum(counts), cpu, _children_cpu_s() - clients_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=5.0, help="per round and cluster")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=0)
    args = parser.parse_args()
    clusters = {n: setup(n, args.replicas, args.clients) for n in (1, 3)}
    totals = {n: [0, 0.0, 0.0] for n in clusters}
    rates: dict[int, list[float]] = {n: [] for n in clusters}
    try:
        for _ in range(args.rounds):  # interleaved: load from elsewhere on the machine hits both alike
            for n, (cluster, jobs) in clusters.items():
                got = run_round(cluster, jobs, args.seconds)
                totals[n] = [t + g for t, g in zip(totals[n], got, strict=True)]
                rates[n].append(got[0] / args.seconds)
    finally:
        for cluster, _ in clusters.values():
            cluster.stop()
    print(f"{args.clients} client processes, {args.rounds} interleaved rounds of {args.seconds:.0f} s, "
          f"{args.replicas} replica(s) per master, {multiprocessing.cpu_count()} cores")
    for n, (commits, redis_s, client_s) in totals.items():
        rate = commits / (args.seconds * args.rounds)
        print(f"{n} master{'s' if n > 1 else ' '}: {rate:,.0f} commits/s (rounds: "
              f"{', '.join(f'{r:,.0f}' for r in rates[n])})   "
              f"CPU per commit: Redis {redis_s / commits * 1e6:,.0f} us, "
              f"clients {client_s / commits * 1e6:,.0f} us")
    print(f"ratio 3/1: {totals[3][0] / totals[1][0]:.2f}x")


if __name__ == "__main__":
    main()
