"""Crashes on a Redis Cluster (3 masters, 3 replicas; tests/cluster.py), with two gateways, two
supervisors and two workers as real processes.

- The gateway SIGKILLed during completions (tests/test_crash.py's scenario, its body reused): two
  gunicorn gateways, two supervisors, pull workers over HTTP riding out the kills.
- A push job while a worker, a gateway and a supervisor are SIGKILLed in turn (each started again),
  and while the master of the job's slot is SIGKILLed with BATCHGATE_REDIS_WAIT_REPLICAS=1: every
  batch is stored once, no stage committed twice, the job finishes; after the failover no commit that
  a replica had acknowledged is redone.
- A creation cut between its slot groups (the job's keys written, the roster, index, active set and
  due index not): the next supervisor pass cancels it (its creator was told it failed) and lists it.
"""

from __future__ import annotations

import signal
import time

import pytest
import redis

from gateway.ledger.embedded import client_for
from gateway.ledger.ledger import Ledger
from tests.conftest import TOKEN
from tests.http import ApiClient

pytestmark = pytest.mark.slow


# -- a creation cut between its slot groups ---------------------------------------------------------

def test_a_creation_cut_between_its_slot_groups_is_cancelled_and_listed_by_the_next_supervisor_pass(
        cluster, cluster_settings, cluster_client, monkeypatch, caplog):
    """The process creating a job dies after the MULTI of the job's own slot (spec, state, log) and
    before the roster, index, active set and due index: the job answers by id but is not listed, and its
    creator got an error (a 503 problem), so it creates the job again, with the same Idempotency-Key:
    a new job (the key's claim was let go with the error). A supervisor started afterwards (its own
    client) settles the creation journal: the cut job is cancelled (never run: that would do the work
    twice) and listed as such, then retired; the job created again runs to the end."""
    from gateway.api.app import create_app
    from gateway.ledger import creations
    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.joblist import ListQuery
    from gateway.ledger.jobs import JobRequest, JobService
    from gateway.ledger.multi import SlotMulti
    from gateway.push.supervisor import Supervisor
    from tests.conftest import drain
    from tests.http import serve_app

    ledger = Ledger(cluster_client, cluster_settings)
    registry = FlowRegistry(cluster_client, ledger.keys)
    jobs = JobService(ledger, registry)
    registry.register("acme", parse_flow({"id": "f", "version": "1", "stages": [{"name": "s"}],
                                          "batching": {"max_items": 2},
                                          "source": {"type": "sequence", "count": 6}}))
    executed = SlotMulti.execute

    def killed_after_the_job_slot(self, raise_on_error=True):
        first = self.client.keyslot(self._queued[0][1][0])  # a creation queues the job's keys first
        if ":{job_" not in self._queued[0][1][0]:
            return executed(self, raise_on_error)  # another MULTI (the Idempotency-Key's record)
        self._queued = [q for q in self._queued if self.client.keyslot(q[1][0]) == first]
        executed(self, raise_on_error)
        raise redis.ConnectionError("the creating process died here")

    base, stop = serve_app(create_app(cluster_settings, cluster_client))
    api = ApiClient(base, TOKEN)
    try:
        monkeypatch.setattr(SlotMulti, "execute", killed_after_the_job_slot)
        failed = api.post("/v1/jobs", json={"flow_id": "f"}, headers={"Idempotency-Key": "k1"})
        monkeypatch.undo()
        assert failed.status_code == 503, failed.text
        assert failed.headers["Content-Type"] == "application/problem+json"
        (cut,) = cluster_client.zrange(ledger.keys.creating, 0, -1)
        assert ledger.job_fields(cut)["status"] == "running"  # the job's own keys are there
        assert api.get("/v1/jobs").json()["jobs"] == []
        assert not cluster_client.sismember(ledger.keys.active, cut)
        retried = api.post("/v1/jobs", json={"flow_id": "f"}, headers={"Idempotency-Key": "k1"})
        assert retried.status_code == 201, retried.text
        again = retried.json()["job_id"]
        assert again != cut and [j["job_id"] for j in api.get("/v1/jobs").json()["jobs"]] == [again]
    finally:
        stop()

    fresh = client_for(cluster.url, cluster_settings)  # another process, in effect
    try:
        sup = Supervisor(Ledger(fresh, cluster_settings), name="after-the-crash")
        sup.tick()  # within the grace: a creation may still be going on
        assert ledger.job_fields(cut)["status"] == "running"
        monkeypatch.setattr(creations, "GRACE_MS", 0)
        sup.tick()
        listed = {j["job_id"]: j for j in jobs.list("acme", ListQuery()).jobs}
        assert {k: v["status"] for k, v in listed.items()} == {cut: "cancelled", again: "running"}
        assert ledger.lease(cut) is None  # never runs
        audit = [f for _, f in cluster_client.xrange(ledger.keys.job(cut).audit)]
        assert audit[-1]["actor"] == creations.ACTOR and "cut off" in audit[-1]["reason"], audit
        assert cluster_client.zrange(ledger.keys.creating, 0, -1) == []
        sup.tick()  # the cancelled job retired like any other
        assert not cluster_client.sismember(ledger.keys.active, cut)
        assert len(drain(ledger, again)) == 3
        assert ledger.job_fields(again)["status"] == "succeeded"
        cluster_client.zadd(ledger.keys.creating, {again: 1})  # an entry for a job already finished
        sup.tick()
        assert cluster_client.zrange(ledger.keys.creating, 0, -1) == []
        assert ledger.job_fields(again)["status"] == "succeeded"
        # a cut job whose record fails its checksum cannot be cancelled: the pass goes on without it
        broken = jobs.create("acme", JobRequest(flow_id="f"))["job_id"]
        cluster_client.hset(ledger.keys.job(broken).job, "items_done", "999")
        cluster_client.zadd(ledger.keys.creating, {broken: 1})
        sup.tick()
        assert cluster_client.zrange(ledger.keys.creating, 0, -1) == []
        assert f"job_id={broken} cut off in its creation, not settled" in caplog.text
    finally:
        fresh.close()


# -- the gateway SIGKILLed during completions (tests/test_crash.py) ----------------------------------

def test_gateway_sigkill_during_completions_on_two_gateways_and_supervisors(cluster, cluster_settings,
                                                                             cluster_client):
    from tests.test_crash import gateway_kills

    gateway_kills(cluster.url, cluster_client, cluster_settings, gateways=2, supervisors=2)


# -- push mode: SIGKILLed workers, gateways, supervisors, and a master --------------------------------

class PushStack:
    """Two gunicorn gateways, two `batchgate supervisor` and two `batchgate worker` processes on the
    cluster (RQ's queue on the plain test Redis); worker i's callbacks go to gateway i + 1."""

    def __init__(self, tmp_path, url: str, settings, **env: str) -> None:
        from tests.test_crash import GatewayProcess

        self.tmp_path, self.starts = tmp_path, 0
        self.gateways = [GatewayProcess(url, settings) for _ in range(2)]
        self.envs = []
        for i in range(2):
            public = self.gateways[(i + 1) % 2].base
            self.envs.append({**self.gateways[i].env, "BATCHGATE_PUBLIC_URL": public,
                              "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]',
                              "BATCHGATE_LOG_LEVEL": "WARNING",
                              "BATCHGATE_SUPERVISOR_INTERVAL": "0.1", **env})
        for gw, own in zip(self.gateways, self.envs, strict=True):
            gw.env = {**own, "BATCHGATE_PUBLIC_URL": gw.base}
        self.supervisors: list = [None, None]
        self.workers: list = [None, None]

    def start(self) -> PushStack:
        from tests.test_push_e2e import Workers

        for i in range(2):
            self.gateways[i].start()
            self.workers[i] = Workers(self.envs[i], count=1)
            self.workers[i].start()
            self.start_supervisor(i)
        return self

    def wait_supervising(self, client, keys, timeout_s: float = 60) -> None:
        """Until both supervisors beat (started processes take a while to import on a busy machine)."""
        deadline = time.monotonic() + timeout_s
        while len(client.hkeys(keys.alive("supervisor"))) < 2:
            for sup in self.supervisors:
                assert sup.proc.poll() is None, f"a supervisor exited:\n{sup.output()}"
            assert time.monotonic() < deadline, "the supervisors did not start"
            time.sleep(0.1)

    def start_supervisor(self, i: int) -> None:
        from tests.test_restart import Proc

        self.starts += 1
        self.supervisors[i] = Proc(self.tmp_path, f"supervisor-{i}-{self.starts}", ["supervisor"],
                                   self.envs[i])

    def crash(self, role: str) -> None:
        """SIGKILL the first process of ``role`` (its whole process group) and start it again."""
        if role == "worker":
            self.workers[0].kill()
            time.sleep(0.5)
            self.workers[0].start()
        elif role == "gateway":
            self.gateways[0].kill()
            time.sleep(0.5)
            self.gateways[0].start()
        else:
            self.supervisors[0].kill_group()
            time.sleep(0.5)
            self.start_supervisor(0)

    def check_alive(self) -> None:
        """Every supervisor and gateway still running, no supervisor with a traceback in its output."""
        for sup in self.supervisors:
            assert sup.proc.poll() is None, f"a supervisor exited:\n{sup.output()}"
            assert "Traceback" not in sup.output(), sup.output()
        for gw in self.gateways:
            assert gw.proc.poll() is None, "a gateway exited"

    def stop(self) -> None:
        for pool in self.workers:
            if pool is not None:
                pool.kill()
        for sup in self.supervisors:
            if sup is not None:
                sup.kill_group()
        for gw in self.gateways:
            if gw.proc is not None:
                gw.stop()


def _recording_platform(**knobs):
    """The stand-in platform, also noting when each scoring run began and when a callback of each
    batch stage (by idempotency key) was first answered 200 (committed; a spooled one answers 202)."""
    import threading

    from tests.test_push_e2e import StandInPlatform

    class Recording(StandInPlatform):
        def __init__(self) -> None:
            super().__init__(**knobs)
            self.began: dict[str, list[float]] = {}
            self.acked: dict[str, float] = {}
            self.current = threading.local()
            post = self.http.post

            def recorded(url, **kwargs):
                resp = post(url, **kwargs)
                if resp.status_code == 200:
                    with self.lock:
                        self.acked.setdefault(self.current.key, time.monotonic())
                return resp

            self.http.post = recorded

        def begin_run(self, env: dict) -> int:
            with self.lock:
                self.began.setdefault(str(env.get("idempotency_key", "")), []).append(time.monotonic())
            return super().begin_run(env)

        def _score_and_call_back(self, env: dict, drop: bool, duplicate: bool) -> None:
            self.current.key = str(env.get("idempotency_key", ""))
            super()._score_and_call_back(env, drop, duplicate)

        def redone_after_ack(self) -> list[str]:
            """Batch stages run again after a commit of theirs was acknowledged."""
            with self.lock:
                return sorted(k for k, at in self.acked.items() if any(t > at for t in self.began.get(k, ())))

    return Recording()


@pytest.mark.parametrize("crashes", [("worker", "gateway", "supervisor"), ("master",)],
                         ids=["worker-gateway-supervisor", "master-failover-wait-1"])
def test_a_push_job_survives_sigkills_on_two_gateways_supervisors_and_workers(
        cluster, cluster_settings, cluster_client, tmp_path, crashes, capsys):
    """A push job through a platform on two gateways, two supervisors and two workers (processes):
    a worker, then a gateway, then a supervisor SIGKILLed and started again as the job runs (a flaky
    platform); or the master of the job's slot SIGKILLed with BATCHGATE_REDIS_WAIT_REPLICAS=1 (a
    reliable platform: every run again is a crash's doing). Every batch stored exactly once, no stage
    committed twice, the job finishes; after the failover no batch stage whose commit was acknowledged
    (its callback answered 200, after a replica had it) runs again."""
    from tests.test_cluster import _retrying
    from tests.test_push_e2e import push_flow

    batches = 60
    failover = crashes == ("master",)
    knobs = {} if failover else {"fail_rate": 0.1, "drop_rate": 0.05, "duplicate_rate": 0.05, "seed": 5}
    env = {"BATCHGATE_REDIS_WAIT_REPLICAS": "1", "BATCHGATE_REDIS_WAIT_TIMEOUT": "1",
           "BATCHGATE_REDIS_READ_TIMEOUT": "2", "BATCHGATE_REDIS_CONNECT_TIMEOUT": "1"} if failover else {}
    ledger = Ledger(cluster_client, cluster_settings)
    stack = PushStack(tmp_path, cluster.url, cluster_settings, **env)
    platform = _recording_platform(**knobs)
    killed = None
    try:
        with platform:
            stack.start()
            stack.wait_supervising(cluster_client, ledger.keys)
            first, second = (ApiClient(gw.base, TOKEN) for gw in stack.gateways)
            assert first.post("/v1/flows", json=push_flow(platform.url, batches)).status_code == 201
            job_id = second.post("/v1/jobs", json={"flow_id": "push-e2e"}).json()["job_id"]
            for n, role in enumerate(crashes, start=1):
                _wait_completed(ledger, job_id, n * batches // (len(crashes) + 1))
                if role == "master":
                    killed = cluster_client.get_node_from_key(ledger.keys.job(job_id).job).port
                    cluster.kill(killed)
                    killed_at = time.monotonic()
                    answers = _answers_until_ok(first, f"/v1/jobs/{job_id}")  # the replica took over
                    took_over = time.monotonic() - killed_at
                    cluster.restart(killed)  # and the old master comes back as its replica
                else:
                    stack.crash(role)
            deadline = time.monotonic() + 120
            while (job := _retrying(lambda: ledger.job_fields(job_id)))["status"] == "running":
                assert time.monotonic() < deadline, f"push job did not finish: {job}"
                time.sleep(0.1)
            stats = platform.stats()
            stack.check_alive()
    finally:
        stack.stop()
        if killed is not None:
            cluster.wait_replicated()
    assert job["status"] == "succeeded", job
    assert int(job["items_done"]) == batches * 2
    assert stats["stored_keys"] == batches  # one stored result per batch
    log = cluster_client.xrange(ledger.keys.job(job_id).log)
    commits = [(f["seq"], f["stage"]) for _, f in log if f["event"] == "stage_completed"]
    assert len(commits) == len(set(commits)) == batches * 2  # no stage committed twice
    if failover:
        promoted = cluster_client.get_node_from_key(ledger.keys.job(job_id).job).port
        acked_before = sum(at < killed_at for at in platform.acked.values())
        runs = sum(len(v) for v in platform.began.values())
        with capsys.disabled():
            print(f"\npush failover (WAIT 1): the API answering 200 again {took_over:.1f} s after the kill "
                  f"({sum(a[0] == 503 for a in answers)} 503 answers before); "
                  f"{acked_before} scoring commits acknowledged before it; {runs - batches} scoring runs "
                  f"repeated (calls cut by the failover); {len(platform.redone_after_ack())} after an "
                  "acknowledged commit")
        assert promoted != killed and 0 < acked_before < len(platform.acked)
        # while the slot had no master the API said so (503 problem, Retry-After), never a 500
        assert {status for status, _ in answers} <= {200, 503}, answers
        assert all(kind == "application/problem+json" for status, kind in answers if status == 503), answers
        assert platform.redone_after_ack() == []


def _answers_until_ok(api: ApiClient, path: str, timeout_s: float = 60) -> list[tuple[int, str]]:
    """GET ``path`` until it answers 200; every (status, content type) seen on the way."""
    answers: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout_s
    while not answers or answers[-1][0] != 200:
        assert time.monotonic() < deadline, f"the API did not answer again: {answers}"
        resp = api.get(path)
        answers.append((resp.status_code, resp.headers.get("Content-Type", "")))
        time.sleep(0.1)
    return answers


def _wait_completed(ledger: Ledger, job_id: str, count: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while int(ledger.job_fields(job_id)["n_done"]) < count:
        assert time.monotonic() < deadline, f"push job stalled below {count} batches"
        time.sleep(0.05)


# -- a supervisor started while the cluster is down (tests/test_restart.py) ---------------------------

def test_a_supervisor_started_while_every_node_is_down_waits_then_expires_the_dead_lease(
        cluster, cluster_settings, cluster_client, tmp_path):
    """`batchgate supervisor` as a process, started while every node of the cluster is down (SIGKILLed):
    it waits (no exit, no traceback); once the nodes are back from their AOF it supervises: the lease a
    dead worker held runs out and is expired."""
    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.jobs import JobRequest, JobService
    from gateway.runtime import procs
    from tests.test_restart import FLOW, Proc, _events, _wait_for

    ledger = Ledger(cluster_client, cluster_settings)
    registry = FlowRegistry(cluster_client, ledger.keys)
    registry.register("acme", parse_flow(FLOW))
    job_id = JobService(ledger, registry).create("acme", JobRequest(flow_id="restart"))["job_id"]
    dead = ledger.lease(job_id)  # its worker dies: the lease (0.5 s) is left to run out
    env = {**procs.child_env(cluster_settings, cluster.url, {TOKEN: "acme"}),
           "BATCHGATE_SUPERVISOR_INTERVAL": "0.2", "BATCHGATE_REDIS_CONNECT_TIMEOUT": "1"}
    for port in cluster.ports:
        cluster.kill(port)
    sup = None
    try:
        sup = Proc(tmp_path, "supervisor", ["supervisor"], env)
        time.sleep(2.0)
        assert sup.proc.poll() is None, f"the supervisor exited with the cluster down:\n{sup.output()}"
        assert "waiting for a startup node" in sup.output(), sup.output()
    finally:
        for port in cluster.ports:
            if cluster.procs[port].poll() is not None:
                cluster.restart(port)
        cluster.wait_replicated()
    fresh = client_for(cluster.url, cluster_settings)  # the test's own client, after the restart
    try:
        watcher = Ledger(fresh, cluster_settings)
        _wait_for("the dead lease expired", lambda: [
            e for e in _events(fresh, watcher, job_id, "retry_scheduled") if e["seq"] == str(dead.seq)], sup,
            timeout_s=30)
        assert "Traceback" not in sup.output(), sup.output()
        sup.proc.send_signal(signal.SIGTERM)
        assert sup.proc.wait(15) == 0
    finally:
        sup.kill_group()
        fresh.close()
