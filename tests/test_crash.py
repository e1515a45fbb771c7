"""Crashes: SIGKILL of the gateway during completions, and of Redis (restart from its AOF).

Invariants checked after each run: every acknowledged commit is still there, no stage of any batch
was committed twice, and the job finishes with every item done exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
import redis
import requests

from gateway.runtime import procs
from gateway.ledger.embedded import EmbeddedRedis, client_for, free_port
from gateway.errors import StaleLease
from gateway.ledger.ledger import Ledger
from gateway.settings import Settings
from gateway.push.supervisor import Supervisor
from tests.conftest import TOKEN

pytestmark = pytest.mark.slow

FLOW = {"id": "crashy", "version": "1", "batching": {"max_items": 2}, "concurrency": 8,
        "stages": [{"name": "a", "lease": 1, "retry": {"initial_interval": 0.05, "maximum_attempts": 50}},
                   {"name": "b", "lease": 1, "retry": {"initial_interval": 0.05, "maximum_attempts": 50}}]}


def committed_stages(client: redis.Redis, ledger: Ledger, job_id: str) -> Counter:
    """How many times each (seq, stage) was committed, from the job's execution log."""
    log = client.xrange(ledger.keys.job(job_id).log)
    return Counter((f["seq"], f["stage"]) for _, f in log if f["event"] == "stage_completed")


def assert_exactly_once(client, ledger, job_id, acked, total_items, batches):
    counts = committed_stages(client, ledger, job_id)
    assert set(counts.values()) == {1}, "a stage was committed twice"
    assert len(counts) == batches * 2
    for seq, stage in acked:
        out = client.hget(ledger.keys.job(job_id).batch(seq), f"out:{stage}")
        assert json.loads(out) == {"seq": seq, "stage": stage}, "an acknowledged commit was lost"
    job = client.hgetall(ledger.keys.job(job_id).job)
    assert job["status"] == "succeeded"
    assert int(job["items_done"]) == total_items


class GatewayProcess:
    """gunicorn serving the app, as in production, restartable on the same port."""

    def __init__(self, redis_url: str, settings: Settings | None = None) -> None:
        self.port = free_port()
        self.env = procs.child_env(settings or Settings(), redis_url, {TOKEN: "acme"})
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        self.proc = procs.start_api(self.env, "127.0.0.1", self.port, workers=2)
        procs.wait_healthy(self.base)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        procs.stop(self.proc)


def http_worker(base: str, job_id: str, acked: list, done: threading.Event) -> None:
    """Lease/complete over HTTP, riding out a dead gateway; records acknowledged commits."""
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {TOKEN}"
    while not done.is_set():
        try:
            r = s.post(f"{base}/v1/jobs/{job_id}/lease", json={}, timeout=5)
            if r.status_code == 204:
                time.sleep(0.05)
                continue
            env = r.json()
            body = {"lease_token": env["lease_token"], "output": {"seq": env["seq"], "stage": env["stage_index"]}}
            while True:  # a lost answer is retried with the same token: duplicate or commit
                try:
                    c = s.post(f"{base}/v1/jobs/{job_id}/batches/{env['seq']}/complete", json=body, timeout=5)
                    break
                except requests.RequestException:  # refused, or cut off mid-answer by the kill
                    time.sleep(0.05)
            if c.status_code == 200:
                acked.append((env["seq"], env["stage_index"]))
        except requests.RequestException:
            time.sleep(0.05)


def test_gateway_sigkill_during_completions_loses_and_doubles_nothing(redis_server, redis_client, settings):
    gateway_kills(redis_server.url, redis_client, settings, gateways=1, supervisors=1)


def gateway_kills(redis_url: str, client, settings: Settings, gateways: int, supervisors: int) -> None:
    """Pull workers over HTTP (four, spread over ``gateways`` gunicorn gateways) complete a 300-item
    job while ``supervisors`` supervisors watch it; a gateway is SIGKILLed and started again after 60
    and after 180 acknowledged commits (the first, then the next one). Reused on a Redis Cluster
    (tests/test_cluster_crash.py)."""
    ledger = Ledger(client, settings)
    gws = [GatewayProcess(redis_url, settings) for _ in range(gateways)]
    for gw in gws:
        gw.start()
    sups = [Supervisor(Ledger(client_for(redis_url, settings), settings.model_copy(
        update={"supervisor_interval": timedelta(seconds=0.05)})), name=f"crash-{i}")
        for i in range(supervisors)]
    for sup in sups:
        threading.Thread(target=sup.run, daemon=True).start()
    acked: list = []
    done = threading.Event()
    try:
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {TOKEN}"
        s.post(f"{gws[0].base}/v1/flows", json=FLOW, timeout=5).raise_for_status()
        job = s.post(f"{gws[-1].base}/v1/jobs", json={"flow_id": "crashy",
                     "source": {"type": "sequence", "count": 300}}, timeout=5).json()
        workers = [threading.Thread(target=http_worker, args=(gws[i % gateways].base, job["job_id"], acked,
                                                              done)) for i in range(4)]
        for w in workers:
            w.start()
        for n, threshold in enumerate((60, 180)):
            while len(acked) < threshold:
                time.sleep(0.01)
            gw = gws[n % gateways]
            gw.kill()
            time.sleep(0.3)
            gw.start()
        deadline = time.monotonic() + 60
        while ledger.job_fields(job["job_id"])["status"] == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        for sup in sups:
            sup.stop.set()
        for gw in gws:
            gw.stop()
    assert_exactly_once(client, ledger, job["job_id"], acked, total_items=300, batches=150)


def test_redis_sigkill_and_restart_from_aof_loses_no_acknowledged_commit(tmp_path, settings, make_job):
    server = EmbeddedRedis(tmp_path / "aof", port=free_port())
    url = server.start()
    client = client_for(url)
    own = settings.model_copy(update={"redis_url": url})
    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.jobs import JobRequest, JobService

    ledger = Ledger(client, own)
    FlowRegistry(client, ledger.keys).register("acme", parse_flow(
        {**FLOW, "source": {"type": "sequence", "count": 400}}))
    job_id = JobService(ledger, FlowRegistry(client, ledger.keys)).create(
        "acme", JobRequest(flow_id="crashy"))["job_id"]
    acked: list = []
    done = threading.Event()

    def worker():
        while not done.is_set():
            try:
                lease = ledger.lease(job_id)
                if lease is None:
                    ledger.expire_due(job_id)
                    time.sleep(0.02)
                    continue
                output = {"seq": lease.seq, "stage": lease.stage_index}
                while True:
                    try:
                        ledger.complete(job_id, lease.seq, lease.lease_token, output)
                        acked.append((lease.seq, lease.stage_index))
                        break
                    except redis.ConnectionError:
                        time.sleep(0.05)
                    except StaleLease:  # expired while Redis was down; another attempt owns it
                        break
            except redis.ConnectionError:
                time.sleep(0.05)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for threshold in (100, 250):
            while len(acked) < threshold:
                time.sleep(0.005)
            server.kill()
            server = EmbeddedRedis(tmp_path / "aof", port=server.port)
            server.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if ledger.job_fields(job_id)["status"] != "running":
                    break
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
    finally:
        done.set()
        for t in threads:
            t.join()
    try:
        assert_exactly_once(client, ledger, job_id, acked, total_items=400, batches=200)
    finally:
        server.stop()
