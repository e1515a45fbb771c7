"""batchgate on a Redis Cluster (3 masters, 3 replicas; tests/cluster.py): the pull path end to end
through the API, every ledger script within one slot, connect/read timeouts, WAIT after commits."""

from __future__ import annotations

import pytest

from gateway.ledger.embedded import client_for
from gateway.settings import Settings
from tests.cluster import LocalCluster
from tests.conftest import TOKEN, OTHER_TOKEN

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Redis Cluster of 3 masters and 3 replicas, started once for the module."""
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
    cluster.flushall()
    client = client_for(cluster.url, cluster_settings)
    yield client
    client.close()


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
