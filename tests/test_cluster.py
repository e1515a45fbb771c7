"""batchgate on a Redis Cluster (3 masters, 3 replicas; tests/cluster.py): the pull path end to end
through the API, every ledger script within one slot, connect/read timeouts, WAIT after commits."""

from __future__ import annotations

import pytest

from gateway.ledger.embedded import client_for
from gateway.settings import Settings
from tests.cluster import LocalCluster
from tests.conftest import TOKEN

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster_api(cluster_settings, cluster_client):
    from gateway.api.app import create_app
    from tests.http import ApiClient, serve_app

    base, stop = serve_app(create_app(cluster_settings, cluster_client))
    yield ApiClient(base, TOKEN)
    stop()


def test_the_client_is_a_redis_cluster(cluster_client):
    from redis.cluster import RedisCluster

    assert isinstance(cluster_client, RedisCluster)
    assert len(cluster_client.get_primaries()) == 3 and len(cluster_client.get_replicas()) == 3


def test_a_url_may_name_several_startup_nodes_and_one_down_is_passed_over(cluster, cluster_settings):
    """A process starting while a node its URL names is down (a master killed in a failover) joins
    through the next one; a URL naming one dead node cannot."""
    import redis

    from gateway.ledger.embedded import free_port

    dead = f"127.0.0.1:{free_port()}"
    live = ",".join(f"127.0.0.1:{port}" for port in cluster.ports[1:3])
    client = client_for(f"redis+cluster://{dead},{live}/0", cluster_settings)
    try:
        assert client.ping() and len(client.get_primaries()) == 3
    finally:
        client.close()
    with pytest.raises(redis.exceptions.RedisClusterException):
        client_for(f"redis+cluster://{dead}/0", cluster_settings)


def test_a_pull_job_runs_to_the_end_through_the_api(cluster_api):
    from tests.test_api import create_job, drain, job, register

    register(cluster_api, count=12, max_items=2)
    created = create_job(cluster_api)
    seen = drain(cluster_api, created["job_id"])
    assert len(seen) == 12  # 6 batches x 2 stages
    view = job(cluster_api, created["job_id"])
    assert view["status"] == "succeeded", view
    listed = cluster_api.get("/v1/jobs").json()["jobs"]
    assert [j["job_id"] for j in listed] == [created["job_id"]]
    assert cluster_api.get("/metrics").status_code == 200  # scans every master for the tenants
    ready = cluster_api.get("/readyz").json()  # not ready (no supervisor here), but Redis and scripts are
    assert ready["checks"]["scripts"]["ok"] and ready["checks"]["redis"]["ok"], ready
    # idempotent creation: the record and its claim sit on two slots
    again = [cluster_api.post("/v1/jobs", json={"flow_id": "f"}, headers={"Idempotency-Key": "k1"})
             for _ in range(2)]
    assert [r.status_code for r in again] == [201, 201] and again[0].json() == again[1].json()
    # a subscription: its record and the tenant's set of them sit on two slots
    sub = cluster_api.post("/v1/subscriptions", json={"url": "https://hooks.example.com/bg",
                                                      "events": ["job.succeeded"]})
    assert sub.status_code == 201, sub.text
    listed = cluster_api.get("/v1/subscriptions").json()["subscriptions"]
    assert [s["id"] for s in listed] == [sub.json()["id"]]
    assert cluster_api.delete(f"/v1/subscriptions/{sub.json()['id']}").status_code == 204


# -- every script within one slot -----------------------------------------------------------------

@pytest.fixture
def recorded(monkeypatch):
    """Every ledger script run, as (operation, keys): through the observer (job scripts) or not."""
    from redis.commands.core import Script

    from gateway.ledger import scripts

    calls: list[tuple[str, list[str]]] = []
    observed, traced, bare = scripts.Observed.__call__, scripts.Traced.__call__, Script.__call__

    def on_observed(self, keys=(), args=(), client=None):
        calls.append((self.script.name.removeprefix("ledger."), list(keys)))
        return observed(self, keys, args, client)

    def on_traced(self, keys=(), args=(), client=None):
        calls.append((self.name.removeprefix("ledger."), list(keys)))
        return traced(self, keys, args, client)

    def on_bare(self, keys=[], args=[], client=None):  # noqa: B006 - redis-py's signature
        calls.append((self.script.split("\n", 1)[0][:40], list(keys)))
        return bare(self, keys, args, client)

    monkeypatch.setattr(scripts.Observed, "__call__", on_observed)
    monkeypatch.setattr(scripts.Traced, "__call__", on_traced)
    monkeypatch.setattr(Script, "__call__", on_bare)
    return calls


def one_slot(keys: list[str]) -> bool:
    from redis.crc import key_slot

    return len({key_slot(key.encode()) for key in keys}) <= 1


def test_every_ledger_script_run_on_a_job_touches_one_slot(cluster_client, cluster_settings, recorded):
    """The ledger's operations on a job run on the cluster (which refuses a cross-slot script), and each
    script's keys hash to one slot; scripts only push, approvals or repairs run are checked on the keys
    their call sites build for a sample job (gateway/push/dispatch.py, ledger/approvals.py, control.py)."""
    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.jobs import JobRequest, JobService
    from gateway.ledger.ledger import Ledger
    from gateway.ledger.scripts import OPERATIONS

    ledger = Ledger(cluster_client, cluster_settings)
    registry = FlowRegistry(cluster_client, ledger.keys)
    jobs = JobService(ledger, registry)
    flow = parse_flow({"id": "f", "version": "1", "stages": [{"name": "score"}, {"name": "store"}],
                       "batching": {"max_items": 2}, "source": {"type": "sequence", "count": 8}})
    registry.register("acme", flow)
    job_id = jobs.create("acme", JobRequest(flow_id="f"))["job_id"]
    first = ledger.lease(job_id)
    ledger.heartbeat(job_id, first.seq, first.lease_token)
    ledger.complete(job_id, first.seq, first.lease_token, {"ok": 1})
    second = ledger.lease(job_id)
    ledger.fail(job_id, second.seq, second.lease_token, "boom", retryable=True)
    third = ledger.lease(job_id)
    cluster_client.zadd(ledger.keys.job(job_id).leases, {str(third.seq): 1})  # its deadline passed
    assert ledger.expire_due(job_id)
    ledger.pause(job_id, "tenant:acme")
    ledger.reopen(job_id, "tenant:acme")
    other = jobs.create("acme", JobRequest(flow_id="f"))["job_id"]
    ledger.cancel(other, "tenant:acme")
    ran = {name for name, _ in recorded}
    assert {"plan", "lease", "heartbeat", "complete", "fail", "expire", "set_status", "reopen",
            "cancel"} <= ran, ran
    crossing = [(name, keys) for name, keys in recorded if not one_slot(keys)]
    assert crossing == []

    k, keys, tid = ledger.keys.job(job_id), ledger.keys, "0123456789abcdef"
    static = {  # as the call sites build them
        "slot": [keys.target_slots(tid), keys.target_breaker(tid)],
        "breaker": [keys.target_breaker(tid), keys.target_waiting(tid)],
        "outage": [k.job, k.batch(0), k.leases, k.ready(0), k.log, k.audit, k.events],
        "begin": [k.job, k.batch(0), k.leases, k.ready(0), k.log],
        "handle": [k.batch(0), k.job],
        "unwait": [k.job, k.log],
        "source_fail": [k.job, k.log, k.audit, k.events],
        "replan": [k.job, k.leases, k.failed, k.done, k.log, k.audit, k.ready(0), k.ready(1), k.batch(0),
                   k.items(0)],
        "decide": [k.job, k.batch(0), k.approval(0, 1, 1), k.approvals, k.approvals_due, k.items(0),
                   k.leases, k.done, k.failed, k.log, k.ready(0), k.ready(1), k.approval(0, 1, 1), k.events],
        "open_approval": [k.job, k.batch(0), k.approval(0, 1, 1), k.approvals, k.approvals_due, k.leases,
                          k.ready(1), k.log, k.events],
        "selfcheck": [],
        "qretry": [k.job, k.batch(0), k.quarantine, k.log, k.audit, k.ready(0), k.ready(1), k.sink,
                   k.sink_late, k.events],
        # result sinks (push/sinks.py; run on the cluster by tests/test_sinks.py)
        "compact": [k.job, k.sink, k.batch(0), k.batch(1), k.items(0), k.items(1)],
        "amend": [k.job, k.sink, k.sink_late, k.batch(0), k.items(0)],
        "rest": [k.job, k.log, k.audit, k.events, k.sink],
        "archive": [k.job, k.spec, k.log, k.audit, k.events, k.past],
    }
    assert set(OPERATIONS) <= ran | set(static)
    assert [name for name, ks in static.items() if not one_slot(ks)] == []
    # the global scripts: one key, or keys tagged by the tenant
    assert one_slot([keys.quota_creations("acme"), keys.quota_active("acme")])


# -- durable commits: WAIT after each commit script ------------------------------------------------

def test_the_due_index_shards_spread_over_the_masters_and_leases_expire_on_time(cluster_client,
                                                                               cluster_settings):
    """BATCHGATE_DUE_SHARDS on a cluster: the due index's sets hash to slots on every master, so the
    index write each lease makes spreads over them; a supervisor still expires every due lease once."""
    import time

    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.jobs import JobRequest, JobService
    from gateway.ledger.ledger import Ledger
    from gateway.push.supervisor import Supervisor

    ledger = Ledger(cluster_client, cluster_settings.model_copy(update={"due_shards": 6}))
    masters = {cluster_client.get_node_from_key(key).name for key in ledger.keys.due_keys()}
    assert len(masters) == 3, masters
    registry = FlowRegistry(cluster_client, ledger.keys)
    jobs = JobService(ledger, registry)
    registry.register("acme", parse_flow({"id": "d", "version": "1", "batching": {"max_items": 1},
                                          "stages": [{"name": "s", "lease": 0.3}],
                                          "source": {"type": "sequence", "count": 4}}))
    made = [jobs.create("acme", JobRequest(flow_id="d"))["job_id"] for _ in range(12)]
    for job_id in made:
        assert ledger.lease(job_id) is not None
    assert len({ledger.keys.due_for(j) for j in made}) > 1
    time.sleep(0.4)
    sup = Supervisor(ledger, name="due-shards", sweep_visits=0)
    sup.tick()
    sup.tick()
    for job_id in made:
        expired = [f for _, f in cluster_client.xrange(ledger.keys.job(job_id).log)
                   if f["event"] == "retry_scheduled"]
        assert len(expired) == 1, job_id


def test_commits_wait_for_a_replica_and_a_short_acknowledgement_is_counted(cluster, cluster_settings,
                                                                           cluster_client, caplog):
    from gateway import metrics
    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.jobs import JobRequest, JobService
    from gateway.ledger.ledger import Ledger

    def short() -> float:
        return metrics.REDIS_WAIT_SHORT.labels("complete")._value.get()

    settings = cluster_settings.model_copy(update={"redis_wait_replicas": 1})
    ledger = Ledger(cluster_client, settings)
    registry = FlowRegistry(cluster_client, ledger.keys)
    registry.register("acme", parse_flow({"id": "f", "version": "1", "stages": [{"name": "s"}],
                                          "batching": {"max_items": 2},
                                          "source": {"type": "sequence", "count": 4}}))
    job_id = JobService(ledger, registry).create("acme", JobRequest(flow_id="f"))["job_id"]
    before = short()
    lease = ledger.lease(job_id)
    ledger.complete(job_id, lease.seq, lease.lease_token, {"ok": 1})
    assert short() == before  # the replica acknowledged
    # two replicas asked, one exists: the commit stands, a warning is logged and counted
    ledger.index.wait = (2, 50)
    lease = ledger.lease(job_id)
    ledger.complete(job_id, lease.seq, lease.lease_token, {"ok": 2})
    assert short() == before + 1
    assert "acknowledged by 1 of 2 replicas" in caplog.text
    assert ledger.job_fields(job_id)["status"] == "succeeded"


# -- push mode on the cluster -----------------------------------------------------------------------

def test_a_push_job_runs_to_the_end_on_two_gateways_supervisors_and_workers(cluster_settings, cluster_client,
                                                                            tmp_path):
    """Two API processes' worth of apps (each its own RedisCluster client), two supervisors and two
    `batchgate worker` processes on the cluster (RQ's queue on a plain Redis), each worker's callbacks
    going to another gateway; a flaky platform: every batch stored exactly once, no stage committed twice."""
    import os
    import sys
    import threading
    from datetime import timedelta

    from gateway.api.app import create_app
    from gateway.ledger.ledger import Ledger
    from gateway.push.dispatch import Dispatcher
    from gateway.push.supervisor import Supervisor
    from tests.http import ApiClient, serve_app
    from tests.test_push_e2e import Workers, push_flow, wait_done

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "resume_screening"))
    from standin_platform import StandInPlatform

    batches = 30
    data = tmp_path / "data"
    base_settings = cluster_settings.model_copy(update={
        "outbound_allow": ["127.0.0.1/32"], "data_dir": data, "due_shards": 6,  # over the 3 masters
        "supervisor_interval": timedelta(milliseconds=100)})
    stops, sups, pools, bases = [], [], [], []
    try:
        for i in range(2):
            holder: dict = {}
            base, stop_api = serve_app(lambda environ, start, h=holder: h["app"](environ, start))
            stops.append(stop_api)
            bases.append(base)
            own = base_settings.model_copy(update={"public_url": base})
            client = client_for(own.redis_url.get_secret_value(), own)  # a process of its own, in effect
            holder["app"] = create_app(own, client)
            ledger = Ledger(client, own)
            sup = Supervisor(ledger, name=f"cluster-e2e-{i}", dispatcher=Dispatcher.build(own, ledger))
            threading.Thread(target=sup.run, daemon=True).start()
            sups.append(sup)
            env = {**os.environ, "BATCHGATE_REDIS_URL": own.redis_url.get_secret_value(),
                   "BATCHGATE_QUEUE_REDIS_URL": own.queue_redis_url.get_secret_value(),
                   "BATCHGATE_SIGNING_KEY": own.signing_secret().decode(), "BATCHGATE_PUBLIC_URL": base,
                   "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]', "BATCHGATE_LOG_LEVEL": "WARNING",
                   "BATCHGATE_DATA_DIR": str(data), "BATCHGATE_SECRETS": "{}", "BATCHGATE_DUE_SHARDS": "6"}
            pools.append(Workers(env, count=1))
        with StandInPlatform(fail_rate=0.1, drop_rate=0.05, duplicate_rate=0.05, seed=3) as platform:
            for pool in pools:
                pool.start()
            first, second = (ApiClient(base, TOKEN) for base in bases)
            assert first.post("/v1/flows", json=push_flow(platform.url, batches)).status_code == 201
            job_id = second.post("/v1/jobs", json={"flow_id": "push-e2e"}).json()["job_id"]
            job = wait_done(first, job_id, 120)
            stats = platform.stats()
    finally:
        for pool in pools:
            pool.kill()
        for sup in sups:
            sup.stop.set()
        for stop in stops:
            stop()
    assert job["status"] == "succeeded", job
    assert job["items_done"] == batches * 2
    assert stats["stored_keys"] == batches
    log = cluster_client.xrange(Ledger(cluster_client, cluster_settings).keys.job(job_id).log)
    commits = [(f["seq"], f["stage"]) for _, f in log if f["event"] == "stage_completed"]
    assert len(commits) == len(set(commits)) == batches * 2


# -- failover ---------------------------------------------------------------------------------------

def _retrying(call, deadline_s: float = 30.0):
    """``call()`` until Redis answers again (a master killed: its replica takes over in a few seconds)."""
    import time

    import redis

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
                redis.exceptions.TryAgainError, redis.exceptions.MovedError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"the cluster did not come back: {exc!r}") from exc
            time.sleep(0.2)


@pytest.mark.parametrize("replicas", [1, 0], ids=["wait-1", "no-wait"])
def test_a_master_killed_during_commits_fails_over_and_the_job_finishes(tmp_path, redis_server, replicas,
                                                                         capsys):
    """SIGKILL the master of the job's slot in the middle of a stream of commits, while its replica lags:
    the replica takes over, the job finishes. With WAIT 1 every acknowledged commit survives (no batch is
    acknowledged twice); without it, the commits acknowledged during the lag are lost and redone (the
    test prints how many)."""
    import threading
    import time

    from gateway import metrics
    from gateway.errors import Conflict
    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.jobs import JobRequest, JobService
    from gateway.ledger.ledger import Ledger

    cluster = LocalCluster(tmp_path / "cluster").start()
    try:
        settings = Settings(redis_url=cluster.url, queue_redis_url=redis_server.url,
                            data_dir=tmp_path / "data", redis_wait_replicas=replicas,
                            redis_read_timeout=2, redis_connect_timeout=1, redis_wait_timeout=0.2)
        client = client_for(cluster.url, settings)
        ledger = Ledger(client, settings)
        registry = FlowRegistry(client, ledger.keys)
        batches = 300
        registry.register("acme", parse_flow({"id": "f", "version": "1",
                                              "stages": [{"name": "s", "lease": 2}],
                                              "batching": {"max_items": 1},
                                              "source": {"type": "sequence", "count": batches}}))
        job_id = JobService(ledger, registry).create("acme", JobRequest(flow_id="f"))["job_id"]
        master = client.get_node_from_key(ledger.keys.job(job_id).job)
        acked: list[int] = []  # batches whose commit came back (with WAIT 1: acknowledged by a replica)
        short = metrics.REDIS_WAIT_SHORT.labels("complete")
        killed_at = restarted = lagging = lag_until = lag_from = None
        replica = next(p for p in cluster.ports[cluster.masters:]
                       if cluster.node(p).info("replication").get("master_port") == master.port)
        committed_after_kill = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if lagging is None and len(acked) == batches // 3:
                # the replica stops for 2 s and loses its link (as a partitioned one would); the master
                # commits on for up to 1 s or 50 commits, then dies: what the replica never had is lost
                lagging = threading.Thread(target=lambda: cluster.node(replica).execute_command(
                    "DEBUG", "SLEEP", "2"), daemon=True)
                lagging.start()
                time.sleep(0.1)
                # and the master drops its link, so nothing more even waits in the replica's socket
                with cluster.node(master.port) as node:
                    node.client_kill_filter(_type="replica")
                lag_until, lag_from = time.monotonic() + 1.0, len(acked)
            if killed_at is None and lagging is not None and (time.monotonic() > lag_until
                                                               or len(acked) >= lag_from + 50):
                cluster.kill(master.port)  # SIGKILL, mid-stream
                killed_at = time.monotonic()
            if restarted is None and committed_after_kill:
                cluster.restart(master.port)  # failed over: the old master comes back as a replica
                restarted = time.monotonic()
            lease = _retrying(lambda: ledger.lease(job_id))
            if lease is None:
                if _retrying(lambda: ledger.job_fields(job_id))["status"] != "running":
                    break
                _retrying(lambda: ledger.expire_due(job_id))  # a lease lost with the master, or a late one
                time.sleep(0.1)
                continue
            before = short._value.get()
            try:
                _retrying(lambda: ledger.complete(job_id, lease.seq, lease.lease_token, {"seq": lease.seq}))
            except Conflict:
                continue  # the lease ran out in the failover, or the first try committed: not acknowledged
            committed_after_kill += killed_at is not None
            if short._value.get() == before:
                acked.append(lease.seq)
        job = _retrying(lambda: ledger.job_fields(job_id))
        assert killed_at is not None
        assert job["status"] == "succeeded", job
        twice = sorted({seq for seq in acked if acked.count(seq) > 1})
        with capsys.disabled():
            print(f"\nfailover (WAIT {replicas}): {len(acked)} acknowledged commits, failover and first "
                  f"commit after {restarted - killed_at:.1f} s, "
                  f"{len(twice)} acknowledged twice (lost in the failover and redone): {twice[:10]}")
        if replicas:
            assert twice == []
        else:  # what WAIT prevents: commits acknowledged while the replica lagged were lost and redone
            assert twice
    finally:
        cluster.stop()


def test_a_slot_with_no_master_is_an_outage_the_api_and_supervisor_wait_out(tmp_path, redis_server, caplog):
    """A master with no replica killed: the cluster answers CLUSTERDOWN for every key (the nodes agree
    its slots are uncovered). That is a ResponseError to redis-py, yet nothing ran: the API answers a 503
    problem with Retry-After (never a 500, never a 400), the supervisor logs that it waits rather than a
    traceback; the master back, both go on and the job finishes."""
    import logging
    import threading
    import time
    from datetime import timedelta

    from gateway.api.app import create_app
    from gateway.ledger.ledger import Ledger
    from gateway.push.supervisor import Supervisor
    from tests.http import ApiClient, serve_app

    cluster = LocalCluster(tmp_path / "cluster", masters=3, replicas=0).start()
    sup = stop_api = None
    try:
        settings = Settings(redis_url=cluster.url, queue_redis_url=redis_server.url,
                            data_dir=tmp_path / "data", redis_read_timeout=2, redis_connect_timeout=1, due_shards=3,
                            supervisor_interval=timedelta(milliseconds=100), tokens={TOKEN: "acme"})
        client = client_for(cluster.url, settings)
        base, stop_api = serve_app(create_app(settings, client))
        api = ApiClient(base, TOKEN)
        flow = {"id": "f", "version": "1", "stages": [{"name": "s", "lease": 30}],
                "batching": {"max_items": 1}, "source": {"type": "sequence", "count": 2}}
        assert api.post("/v1/flows", json=flow).status_code == 201
        job_id = api.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
        ledger = Ledger(client, settings)
        sup = Supervisor(ledger, name="clusterdown")
        caplog.set_level(logging.WARNING)
        threading.Thread(target=sup.run, daemon=True).start()
        deadline = time.monotonic() + 30
        while sup._first_round:  # recovery decided and the first sweep done: it is ticking
            assert time.monotonic() < deadline, "the supervisor did not start ticking"
            time.sleep(0.1)
        killed = client.get_node_from_key(ledger.keys.job(job_id).job).port
        cluster.kill(killed)
        survivor = cluster.node(next(p for p in cluster.ports if p != killed))
        deadline = time.monotonic() + 30
        while survivor.cluster("info")["cluster_state"] != "fail":
            assert time.monotonic() < deadline, "the cluster never agreed the slots were uncovered"
            time.sleep(0.2)
        resp = api.get(f"/v1/jobs/{job_id}")
        assert resp.status_code == 503, resp.text
        assert resp.headers["Content-Type"] == "application/problem+json" and "Retry-After" in resp.headers
        time.sleep(1.0)  # several supervisor passes over the down cluster (due shards on every master)
        cluster.restart(killed)
        deadline = time.monotonic() + 30
        while (resp := api.get(f"/v1/jobs/{job_id}")).status_code != 200:
            assert time.monotonic() < deadline, resp.text
            time.sleep(0.2)
        for _ in range(2):
            lease = ledger.lease(job_id)
            ledger.complete(job_id, lease.seq, lease.lease_token, {"seq": lease.seq})
        assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
        deadline = time.monotonic() + 30  # the supervisor's next pass that reaches every shard says so
        while not any("supervisor: ledger redis reachable again" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.1)
    finally:
        if sup is not None:
            sup.stop.set()
        if stop_api is not None:
            stop_api()
        cluster.stop()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("gateway")]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR], said
    assert any(m.startswith("supervisor: ledger redis unavailable") and "during tick" in m for m in said), said
    assert any("supervisor: ledger redis reachable again" in m for m in said), said
