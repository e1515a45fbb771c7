"""Per-tenant quotas over real HTTP: active jobs, job creations per minute, pull leases per second.

Each refusal is a 429 problem naming the quota, its limit and when to retry (and Retry-After), writes
nothing, and leaves other tenants alone. The active-jobs count follows the jobs' own status, so it
frees a place whatever ends a job; the counts hold across gunicorn's worker processes.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import requests

from gateway.api.app import create_app
from gateway.ledger.keys import Keys
from gateway.ledger.jobs import new_job_id
from gateway.ledger import quotas as quotas_module
from gateway.ledger.quotas import Quotas
from gateway.ledger.scripts import source
from gateway.settings import TenantQuota
from tests.conftest import OTHER_TOKEN, TOKEN
from tests.http import ApiClient, gunicorn_api, serve_app

FLOW = {"id": "f", "version": "1", "stages": [{"name": "score"}], "batching": {"max_items": 5},
        "source": {"type": "sequence", "count": 1000}}
SHORT = {**FLOW, "version": "short", "source": {"type": "sequence", "count": 2}, "retention": 1}
PROBLEM = "application/problem+json"


@pytest.fixture
def serve(settings, redis_client):
    """serve(**acme's quota) -> (acme's client, globex's client), the app on a real socket."""
    stops = []

    def start(**quota):
        app = create_app(settings.model_copy(update={"quota_overrides": {"acme": TenantQuota(**quota)}}),
                         redis_client)
        base, stop = serve_app(app)
        stops.append(stop)
        acme, globex = ApiClient(base, TOKEN), ApiClient(base, OTHER_TOKEN)
        for client in (acme, globex):
            for flow in (FLOW, SHORT):
                assert client.post("/v1/flows", json=flow).status_code == 201
        return acme, globex

    yield start
    for stop in stops:
        stop()


def create(client, version="1", **headers):
    return client.post("/v1/jobs", json={"flow_id": "f", "flow_version": version}, headers=headers)


def job_keys(redis_client) -> set[str]:
    return {k for k in redis_client.scan_iter("bg:*") if ":quota:" not in k}


def assert_quota_problem(resp, quota: str, limit: int, retry_after: str) -> dict:
    assert resp.status_code == 429, resp.text
    assert resp.headers["Content-Type"] == PROBLEM and resp.headers["Retry-After"] == retry_after
    body = resp.json()
    assert body["quota"] == quota and body["limit"] == limit, body
    assert body["type"].endswith("/quota-exceeded") and body["status"] == 429
    assert quota in body["detail"] and str(limit) in body["detail"] and "retry in" in body["detail"]
    return body


def test_active_jobs_quota_refuses_the_creation_writes_nothing_and_spares_other_tenants(
        serve, redis_client, monkeypatch):
    monkeypatch.setattr(quotas_module, "PRUNE_EVERY", timedelta(milliseconds=100))
    acme, globex = serve(active_jobs=2)
    first = [create(acme).json()["job_id"] for _ in range(2)]
    before = job_keys(redis_client)

    refused = create(acme, **{"Idempotency-Key": "k1"})
    body = assert_quota_problem(refused, "active_jobs", 2, "5")
    assert body["retry_after_s"] == 5 and "2 jobs not finished" in body["detail"]
    assert job_keys(redis_client) == before  # no half-written job: no key, no index entry
    assert [j["job_id"] for j in acme.get("/v1/jobs").json()["jobs"]] == first[::-1]

    assert create(globex).status_code == 201  # another tenant keeps the default quota
    assert acme.post(f"/v1/jobs/{first[0]}/cancel").status_code == 200
    time.sleep(0.1)  # the active set is re-read at most once per PRUNE_EVERY
    again = create(acme, **{"Idempotency-Key": "k1"})  # the 429 was not stored against the key
    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers


def test_every_end_of_a_job_frees_its_place_and_a_failed_job_holds_it(serve, redis_client,
                                                                      monkeypatch):
    monkeypatch.setattr(quotas_module, "PRUNE_EVERY", timedelta(milliseconds=100))
    acme, _ = serve(active_jobs=1)
    held = [create(acme, "short").json()["job_id"]]

    def place_is_free() -> bool:
        time.sleep(0.1)  # the active set is re-read at most once per PRUNE_EVERY
        resp = create(acme, "short")
        if resp.status_code == 201:
            held.append(resp.json()["job_id"])
        return resp.status_code == 201

    def lease_and(job_id: str, verdict: str, **body) -> None:
        token = acme.post(f"/v1/jobs/{job_id}/lease").json()["lease_token"]
        acme.post(f"/v1/jobs/{job_id}/batches/0/{verdict}", json={"lease_token": token, **body})

    assert not place_is_free()
    acme.post(f"/v1/jobs/{held[-1]}/cancel")  # cancelled
    assert place_is_free()
    lease_and(held[-1], "complete")  # succeeded: its one batch leased and completed
    assert acme.get(f"/v1/jobs/{held[-1]}").json()["status"] == "succeeded"
    assert place_is_free()
    # failed (budget 0): still counts, it may be resumed; cancelling it frees the place
    lease_and(held[-1], "fail", error={"message": "no", "retryable": False})
    assert acme.get(f"/v1/jobs/{held[-1]}").json()["status"] == "failed"
    assert not place_is_free()
    acme.post(f"/v1/jobs/{held[-1]}/cancel")
    assert place_is_free()
    # gone while running (retention or a person deleted its keys; the tenant's index still names it,
    # as for every job that was written): dropped at once, however young
    redis_client.delete(*redis_client.keys(f"bg:{{{held[-1]}}}:*"))
    assert place_is_free()
    # an id with no record and no index entry is a creation still probing its source: it holds its
    # place until the grace for creations in progress has passed
    acme.post(f"/v1/jobs/{held[-1]}/cancel")
    redis_client.sadd(Keys("bg").quota_active("acme"), new_job_id())
    assert not place_is_free()
    monkeypatch.setattr(quotas_module, "CREATION_GRACE", timedelta(0))
    assert place_is_free()
    # resumed from a cursor after it succeeded: counted again, so the next creation waits
    done = held[-1]
    lease_and(done, "complete")
    assert place_is_free()
    acme.post(f"/v1/jobs/{held[-1]}/cancel")
    assert acme.post(f"/v1/jobs/{done}/resume", json={"cursor": {"type": "offset", "offset": 0}}).status_code == 200
    assert acme.get(f"/v1/jobs/{done}").json()["status"] == "running"
    assert not place_is_free()
    assert redis_client.smembers(Keys("bg").quota_active("acme")) == {done}


def test_creation_rate_quota_answers_when_to_retry(serve, redis_client):
    acme, globex = serve(job_creations_per_minute=3)
    assert [create(acme).status_code for _ in range(3)] == [201] * 3
    before = job_keys(redis_client)
    body = assert_quota_problem(create(acme), "job_creations_per_minute", 3, "20")
    assert 19 < body["retry_after_s"] <= 20  # 3 a minute: the next one 20 s after the first
    assert job_keys(redis_client) == before
    assert [create(globex).status_code for _ in range(4)] == [201] * 4


def test_a_creation_that_fails_after_admission_gives_its_place_back(serve, redis_client):
    acme, _ = serve(active_jobs=1)
    bad = acme.post("/v1/jobs", json={"flow_id": "f", "source": {"type": "sequence", "count": -1}})
    assert bad.status_code == 422
    assert create(acme).status_code == 201  # the refused source did not keep the place
    assert create(acme).status_code == 429


def test_lease_rate_quota_counts_pull_leases_per_tenant(serve):
    acme, globex = serve(leases_per_second=5)
    job = create(acme).json()["job_id"]
    other = create(globex).json()["job_id"]
    started, statuses = time.monotonic(), []
    while len(statuses) < 30 and (resp := acme.post(f"/v1/jobs/{job}/lease")).status_code != 429:
        statuses.append(resp.status_code)
    elapsed = time.monotonic() - started
    assert 5 <= len(statuses) <= 5 + elapsed * 5 + 1  # a burst of 5, then one every 0.2 s
    assert statuses[:5] == [200] * 4 + [204]  # concurrency 4: the fifth finds nothing it may lease
    assert_quota_problem(resp, "leases_per_second", 5, "1")
    assert globex.post(f"/v1/jobs/{other}/lease").status_code == 200
    time.sleep(0.25)
    assert acme.post(f"/v1/jobs/{job}/lease").status_code == 204


def test_on_one_redis_a_lease_counts_its_quota_in_its_own_round_trip(serve, redis_client, monkeypatch):
    """The lease quota is counted by the lease's own script (no script call of its own): a lease of a
    ready batch runs one script on the server, and a request refused before it reaches the ledger (a job
    the tenant does not have) is counted all the same, by quota.lua. (Scripts are counted on the server,
    not round trips: a process re-checks a cached spec's generation at most once a second, a read of its
    own.)"""
    asked: list[str] = []
    admit = Quotas.admit_lease
    monkeypatch.setattr(Quotas, "admit_lease",
                        lambda self, tenant: (asked.append(tenant), admit(self, tenant)))

    def scripts_run() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    acme, _ = serve(leases_per_second=1000)
    job = create(acme).json()["job_id"]
    assert acme.post(f"/v1/jobs/{job}/lease").status_code == 200  # plans ahead; the scripts are loaded
    before = scripts_run()
    assert acme.post(f"/v1/jobs/{job}/lease").status_code == 200
    assert scripts_run() - before == 1 and asked == []  # counted by lease.lua
    assert acme.post("/v1/jobs/job_nope/lease").status_code == 404
    assert asked == ["acme"]  # the 404 counted, by quota.lua


def test_a_next_lease_the_quota_refuses_leaves_the_commit_standing(serve, redis_client):
    """complete with lease_next past the lease quota: committed, next null, Retry-After; the refused
    lease changed nothing (no batch leased, the quota's count unchanged)."""
    acme, _ = serve(leases_per_second=2)
    job = create(acme).json()["job_id"]
    first = acme.post(f"/v1/jobs/{job}/lease").json()
    second = acme.post(f"/v1/jobs/{job}/lease").json()  # the burst of 2 is spent
    rate_key = Keys("bg").quota_leases("acme")
    count = redis_client.get(rate_key)
    resp = acme.post(f"/v1/jobs/{job}/batches/{first['seq']}/complete",
                     json={"lease_token": first["lease_token"], "output": {}, "lease_next": True})
    assert resp.status_code == 200 and resp.json()["status"] == "committed" and resp.json()["next"] is None
    assert int(resp.headers["Retry-After"]) >= 1
    assert redis_client.get(rate_key) == count
    view = acme.get(f"/v1/jobs/{job}").json()
    assert view["batches"]["completed"] == 1 and view["batches"]["leased"] == 1  # only the second's
    assert second["seq"] != first["seq"]


def test_quota_script_checks_both_quotas_before_writing(redis_client, settings):
    """quota.lua directly: a burst of <limit>, then a wait; the active set's size; a refusal writes
    nothing; a creation in progress (no job yet, fresh id) survives a prune, a dead one does not."""
    keys = Keys("bg")
    script = redis_client.register_script(source("quota"))
    rate, active = keys.quota_creations("t"), keys.quota_active("t")
    assert [script(keys=[rate], args=[2, 1000])[0] for _ in range(2)] == ["ok", "ok"]
    refused = script(keys=[rate], args=[2, 1000])
    assert refused[0] == "rate" and 400 <= refused[1] <= 500
    stored = redis_client.get(rate)
    assert script(keys=[keys.quota_creations("u"), keys.quota_active("u")], args=[0, 1, 1, "a"]) == ["ok"]
    snapshot = {k: redis_client.dump(k) for k in redis_client.keys("bg:quota:*")}
    assert script(keys=[keys.quota_creations("u"), keys.quota_active("u")], args=[0, 1, 1, "b"]) == [
        "active", 1]
    assert {k: redis_client.dump(k) for k in redis_client.keys("bg:quota:*")} == snapshot
    assert redis_client.get(rate) == stored

    quotas = Quotas(redis_client, keys, settings)
    old = f"job_{int(time.time() * 1000) - 600_000:011x}000000000000"
    fresh = f"job_{int(time.time() * 1000):011x}000000000000"
    redis_client.sadd(active, old, fresh)
    assert quotas.prune("t") == 1 and redis_client.smembers(active) == {fresh}


def test_active_jobs_quota_holds_across_gunicorn_workers(redis_server, redis_client, tmp_path):
    """20 concurrent creations, each on its own connection, against 2 gunicorn workers: exactly the
    quota's 5 are created."""
    overrides = '{"acme": {"active_jobs": 5}}'
    with gunicorn_api(redis_server.url, tmp_path, {TOKEN: "acme"}, flow=FLOW,
                      BATCHGATE_QUOTA_OVERRIDES=overrides) as base:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        statuses: list[int] = []
        go = threading.Barrier(20)

        def one() -> None:
            go.wait()
            statuses.append(requests.post(f"{base}/v1/jobs", json={"flow_id": "f"}, headers=auth,
                                          timeout=30).status_code)

        threads = [threading.Thread(target=one) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(statuses) == [201] * 5 + [429] * 15
        assert redis_client.zcard("bg:jobs:acme") == 5


def test_zero_means_no_limit_and_nothing_is_counted(serve, redis_client):
    acme, _ = serve(active_jobs=0, job_creations_per_minute=0, leases_per_second=0)
    jobs = [create(acme) for _ in range(4)]
    assert [r.status_code for r in jobs] == [201] * 4
    assert [acme.post(f"/v1/jobs/{jobs[0].json()['job_id']}/lease").status_code for _ in range(6)] == [
        200] * 4 + [204] * 2
    assert not redis_client.keys("bg:quota:*{acme}")


def test_the_supervisor_retiring_finished_jobs_keeps_the_active_set_small(serve, redis_client, settings,
                                                                          monkeypatch):
    """The soak's finding: 20,000 short jobs retired by the supervisor left their ids in the active set
    until a prune, which only runs once the set is full and in one process at a time; creations racing
    it were refused at the default limit of 10,000. Retiring a succeeded or cancelled job drops its id
    then; a failed job keeps its place (it may be resumed)."""
    from gateway.ledger.ledger import Ledger
    from gateway.push.supervisor import Supervisor

    monkeypatch.setattr(quotas_module, "PRUNE_EVERY", timedelta(hours=1))  # no prune helps here
    acme, _ = serve(active_jobs=3)
    ids = [create(acme, "short").json()["job_id"] for _ in range(3)]
    assert create(acme, "short").status_code == 429
    for job_id, verdict in zip(ids, ("complete", "fail")):
        token = acme.post(f"/v1/jobs/{job_id}/lease").json()["lease_token"]
        body = {"output": {}} if verdict == "complete" else {"error": {"message": "no", "retryable": False}}
        acme.post(f"/v1/jobs/{job_id}/batches/0/{verdict}", json={"lease_token": token, **body})
    acme.post(f"/v1/jobs/{ids[2]}/cancel")
    assert [acme.get(f"/v1/jobs/{j}").json()["status"] for j in ids] == ["succeeded", "failed", "cancelled"]
    Supervisor(Ledger(redis_client, settings), name="sup").tick()
    assert redis_client.smembers(Keys("bg").quota_active("acme")) == {ids[1]}
    assert create(acme, "short").status_code == 201
