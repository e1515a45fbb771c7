"""Shared fixtures: a real redis-server on a free port, private to this test session."""

from __future__ import annotations

import pytest

from gateway.ledger.embedded import EmbeddedRedis, client_for
from gateway.ledger.ledger import Ledger
from gateway.settings import Settings

TOKEN = "t-acme-0123456789"
OTHER_TOKEN = "t-globex-0123456789"


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A test that runs a server command in process (cli.main: it sets the root logger up, as the
    process it stands for should) leaves the root logger as it found it, so later tests in the same
    worker do not get every INFO line on their captured stderr."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    client = client_for(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def settings(redis_server, tmp_path):
    return Settings(redis_url=redis_server.url, data_dir=tmp_path / "data",
                    tokens={TOKEN: "acme", OTHER_TOKEN: "globex"},
                    source_roots={"*": [str(tmp_path)]})  # file sources under tmp_path (not data/)


@pytest.fixture
def ledger(redis_client, settings):
    return Ledger(redis_client, settings)


@pytest.fixture
def registry(ledger, redis_client):
    from gateway.ledger.flows import FlowRegistry

    return FlowRegistry(redis_client, ledger.keys)


@pytest.fixture
def jobs(ledger, registry):
    from gateway.ledger.jobs import JobService

    return JobService(ledger, registry)


@pytest.fixture
def make_job(registry, jobs):
    """Register a flow and start a job over ``items`` (a list, or an int for a sequence)."""
    from gateway.ledger.flows import parse_flow
    from gateway.ledger.jobs import JobRequest

    counter = iter(range(1_000_000))

    def make(items=10, max_items=3, stages=("score", "store"), tenant="acme", **flow_extra):
        stage_defs = flow_extra.pop("stage_defs", None) or [{"name": s} for s in stages]
        source = ({"type": "sequence", "count": items} if isinstance(items, int)
                  else {"type": "inline", "items": items})
        flow = parse_flow({"id": f"flow{next(counter)}", "version": "1", "stages": stage_defs,
                           "batching": {"max_items": max_items}, "source": source, **flow_extra})
        registry.register(tenant, flow)
        return jobs.create(tenant, JobRequest(flow_id=flow.id))["job_id"]

    return make


def ready_all_now(r, k, stages: int) -> list[list[str]]:
    """Every retry's backoff is over: the job's ready scores (stages 0..stages-1) set to 0, so which
    ready batch a lease takes depends on nothing timed (Hypothesis machines replay exactly). Answers the
    members of each stage's ready set."""
    pipe = r.pipeline(transaction=False)
    for i in range(stages):
        pipe.zrange(k.ready(i), 0, -1)
    found = pipe.execute()
    for i, members in enumerate(found):
        if members:
            pipe.zadd(k.ready(i), dict.fromkeys(members, 0), xx=True)
    pipe.execute()
    return found


def drain(ledger, job_id, output=lambda lease: {"n": len(lease.items or [])}):
    """Lease and complete every stage of every batch in order; returns the leases seen."""
    seen = []
    while (lease := ledger.lease(job_id)) is not None:
        seen.append(lease)
        ledger.complete(job_id, lease.seq, lease.lease_token, output(lease))
    return seen


@pytest.fixture
def api(settings, redis_client):
    """The gateway app on a real socket (werkzeug, threaded); yields an ApiClient."""
    from gateway.api.app import create_app
    from tests.http import ApiClient, serve_app

    base, stop = serve_app(create_app(settings, redis_client))
    yield ApiClient(base, TOKEN)
    stop()


# -- a local Redis Cluster (tests/cluster.py) ------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Redis Cluster of 3 masters and 3 replicas, started once for the module that asks."""
    from tests.cluster import LocalCluster

    found = LocalCluster(tmp_path_factory.mktemp("cluster")).start()
    yield found
    found.stop()


@pytest.fixture
def cluster_settings(cluster, redis_server, tmp_path):
    # RQ cannot run on a cluster: the push queue lives on the plain test Redis
    return Settings(redis_url=cluster.url, queue_redis_url=redis_server.url, data_dir=tmp_path / "data",
                    tokens={TOKEN: "acme", OTHER_TOKEN: "globex"}, source_roots={"*": [str(tmp_path)]})


@pytest.fixture
def cluster_client(cluster, cluster_settings):
    """A RedisCluster client on an emptied cluster."""
    cluster.flushall()
    client = client_for(cluster.url, cluster_settings)
    yield client
    client.close()


#: Test files that take minutes, started first, longest first (measured: pytest --durations): the suite
#: runs files in parallel worker processes (scripts/test, pytest-xdist --dist loadfile
#: --no-loadscope-reorder, files handed out in collection order), and one of these collected last left a
#: single worker running it alone for minutes at the end. (xdist's default order, by tests per file, put
#: test_chaos, one 4-minute test, last of all.)
LONGEST_FIRST = ("test_chaos.py", "test_soak.py", "test_repeat_calls.py", "test_ledger_model.py",
                 "test_stale_connections.py", "test_approvals_e2e.py", "test_cluster_crash.py",
                 "test_push_e2e.py", "test_cluster.py", "test_openapi.py", "test_cost.py",
                 "test_worker_concurrency.py", "test_callback_spool.py", "test_schemathesis.py",
                 "test_deploy.py")


def pytest_collection_modifyitems(session, config, items):
    """Longest files first (a stable sort: every other test keeps its place; the order is the same in
    every worker, as xdist requires)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
