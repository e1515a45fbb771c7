"""The HTTP API over a real socket: auth, tenant isolation, flows, jobs, malformed input, pull mode, resume.

Every test talks to the app as a client would (tests/http.py) and checks what a client sees: status
codes, problem+json bodies, headers, and that a refused request left the job exactly as it was.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest

from gateway.api.idempotency import IdempotencyStore, fingerprint
from gateway.ledger.keys import Keys
from gateway.push.supervisor import Supervisor
from tests.conftest import OTHER_TOKEN, TOKEN
from tests.http import ApiClient, serve_app

PROBLEM = "application/problem+json"


# -- helpers ---------------------------------------------------------------------------------------

def flow_def(flow_id="f", version="1", count=4, max_items=2, stages=("score", "store"), **extra):
    """A flow over a sequence source of ``count`` integers, ``max_items`` per batch."""
    return {"id": flow_id, "version": version, "stages": [{"name": s} for s in stages],
            "batching": {"max_items": max_items}, "source": {"type": "sequence", "count": count},
            **extra}


def register(api, **kw) -> dict:
    resp = api.post("/v1/flows", json=flow_def(**kw))
    assert resp.status_code == 201, resp.text
    return resp.json()


def create_job(api, flow_id="f", **body) -> dict:
    resp = api.post("/v1/jobs", json={"flow_id": flow_id, **body})
    assert resp.status_code == 201, resp.text
    return resp.json()


def lease(api, job_id, **body) -> dict:
    resp = api.post(f"/v1/jobs/{job_id}/lease", json=body or None)
    assert resp.status_code == 200, resp.text
    return resp.json()


def complete(api, env, output=None):
    return api.post(f"/v1/jobs/{env['job_id']}/batches/{env['seq']}/complete",
                    json={"lease_token": env["lease_token"], "output": output or {"ok": True}})


def drain(api, job_id) -> list[dict]:
    """Lease and complete every stage of every batch; returns the envelopes seen."""
    seen = []
    while (resp := api.post(f"/v1/jobs/{job_id}/lease")).status_code == 200:
        env = resp.json()
        seen.append(env)
        assert complete(api, env).status_code == 200
    assert resp.status_code == 204, resp.text
    return seen


def job(api, job_id) -> dict:
    resp = api.get(f"/v1/jobs/{job_id}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def snapshot(api, job_id) -> tuple:
    """Everything a client can read about a job: its view, its batches, its log."""
    batches = api.get(f"/v1/jobs/{job_id}/batches").json()["batches"]
    full = [api.get(f"/v1/jobs/{job_id}/batches/{b['seq']}").json() for b in batches]
    return job(api, job_id), full, api.get(f"/v1/jobs/{job_id}/log").json()["entries"]


def assert_problem(resp, status, type_suffix=None) -> dict:
    """An RFC 9457 answer with ``status``; returns its body."""
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"].split(";")[0] == PROBLEM
    body = resp.json()
    assert {"type", "title", "status", "detail"} <= body.keys()
    assert body["status"] == status
    if type_suffix:
        assert body["type"].endswith(type_suffix), body["type"]
    return body


def serve(settings, redis_client):
    """The app with ``settings`` on a real socket; returns (base url, stop function)."""
    from gateway.api.app import create_app

    return serve_app(create_app(settings, redis_client))


@pytest.fixture
def globex(api):
    return api.as_token(OTHER_TOKEN)


@pytest.fixture
def small_api(redis_server, redis_client, tmp_path):
    """The app with a 1 KiB body limit."""
    from gateway.settings import Settings


    settings = Settings(redis_url=redis_server.url, data_dir=tmp_path / "small",
                        tokens={TOKEN: "acme", OTHER_TOKEN: "globex"}, max_body_bytes=1024)
    base, stop = serve(settings, redis_client)
    yield ApiClient(base, TOKEN)
    stop()


# -- auth ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("header", [
    None,
    f"Basic {TOKEN}",
    f"Token {TOKEN}",
    TOKEN,
    "Bearer",
    "Bearer t-unknown-secret-value",
    f"Bearer {TOKEN}x",
])
@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/jobs"), ("GET", "/v1/flows"), ("POST", "/v1/flows"), ("POST", "/v1/jobs"),
    ("POST", "/v1/jobs/job_whatever/lease"),
])
def test_requests_without_a_valid_bearer_token_get_401(api, header, method, path):
    client = api.as_token(None)
    headers = {} if header is None else {"Authorization": header}
    resp = client.request(method, path, headers=headers, json={"flow_id": "f"})
    body = assert_problem(resp, 401, "unauthorized")
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert TOKEN not in resp.text and "t-unknown-secret-value" not in resp.text
    assert body["detail"]


def test_a_refused_request_writes_nothing(api, redis_client):
    resp = api.as_token("nope").post("/v1/flows", json=flow_def())
    assert_problem(resp, 401)
    assert redis_client.keys("*") == []
    assert api.get("/v1/flows").json() == {"flows": []}


def test_healthz_needs_no_auth(api):
    resp = api.as_token(None).get("/healthz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}


def test_token_never_echoed_in_responses(api):
    register(api)
    job_id = create_job(api)["job_id"]
    responses = [api.get("/v1/jobs"), api.get(f"/v1/jobs/{job_id}"), api.get("/v1/flows"),
                 api.get(f"/v1/jobs/{job_id}/log"), api.post(f"/v1/jobs/{job_id}/lease"),
                 api.get("/v1/jobs/job_missing"), api.post("/v1/jobs", data="{bad")]
    for resp in responses:
        assert TOKEN not in resp.text


# -- tenant isolation ------------------------------------------------------------------------------

def test_other_tenant_cannot_see_or_touch_a_job(api, globex):
    register(api)
    job_id = create_job(api)["job_id"]
    env = lease(api, job_id)
    before = snapshot(api, job_id)
    token = {"lease_token": env["lease_token"]}
    attempts = [
        ("GET", f"/v1/jobs/{job_id}", None),
        ("GET", f"/v1/jobs/{job_id}/batches", None),
        ("GET", f"/v1/jobs/{job_id}/batches/0", None),
        ("GET", f"/v1/jobs/{job_id}/log", None),
        ("POST", f"/v1/jobs/{job_id}/lease", None),
        ("POST", f"/v1/jobs/{job_id}/pause", None),
        ("POST", f"/v1/jobs/{job_id}/resume", None),
        ("POST", f"/v1/jobs/{job_id}/cancel", None),
        ("POST", f"/v1/jobs/{job_id}/retry-failed", None),
        ("POST", f"/v1/jobs/{job_id}/batches/0/complete", {**token, "output": 1}),
        ("POST", f"/v1/jobs/{job_id}/batches/0/heartbeat", token),
        ("POST", f"/v1/jobs/{job_id}/batches/0/fail", {**token, "error": {"message": "x"}}),
    ]
    for method, path, body in attempts:
        resp = globex.request(method, path, json=body)
        problem = assert_problem(resp, 404, "not-found")
        assert "globex" not in problem["detail"] and "acme" not in problem["detail"]
    assert globex.get("/v1/jobs").json() == {"jobs": []}
    assert globex.get("/v1/flows").json() == {"flows": []}
    assert_problem(globex.get("/v1/flows/f"), 404)
    assert_problem(globex.get("/v1/flows/f/versions/1"), 404)
    assert_problem(globex.delete("/v1/flows/f/versions/1"), 404)
    assert api.get("/v1/flows/f/versions/1").status_code == 200
    assert snapshot(api, job_id) == before
    assert complete(api, env).status_code == 200  # acme's lease still holds


def test_other_tenant_cannot_start_a_job_on_a_foreign_flow(api, globex):
    register(api)
    assert_problem(globex.post("/v1/jobs", json={"flow_id": "f"}), 404)
    assert api.get("/v1/jobs").json() == {"jobs": []}


def test_tenants_register_the_same_flow_id_independently(api, globex):
    mine = register(api, count=4)
    resp = globex.post("/v1/flows", json=flow_def(count=9))
    assert resp.status_code == 201, resp.text
    theirs = resp.json()
    assert theirs["hash"] != mine["hash"]
    assert api.get("/v1/flows/f/versions/1").json()["flow"]["source"]["count"] == 4
    assert globex.get("/v1/flows/f/versions/1").json()["flow"]["source"]["count"] == 9
    assert create_job(globex)["items_total"] == 9
    assert create_job(api)["items_total"] == 4


# -- flows -----------------------------------------------------------------------------------------

def test_register_is_idempotent_for_identical_content(api):
    first = api.post("/v1/flows", json=flow_def())
    again = api.post("/v1/flows", json=flow_def())
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()
    assert len(api.get("/v1/flows").json()["flows"]) == 1


def test_same_version_with_other_content_is_a_conflict_naming_both_hashes(api):
    original = register(api, count=4)
    resp = api.post("/v1/flows", json=flow_def(count=5))
    body = assert_problem(resp, 409, "flow-conflict")
    assert body["registered_hash"] == original["hash"]
    assert body["submitted_hash"] and body["submitted_hash"] != original["hash"]
    stored = api.get("/v1/flows/f/versions/1").json()
    assert stored["flow"]["source"]["count"] == 4
    assert stored["hash"] == original["hash"]


def _stages(*names, fetch_at=None):
    return [{"name": n, **({"fetches": True} if i == fetch_at else {})} for i, n in enumerate(names)]


@pytest.mark.parametrize("patch,names", [
    ({"stages": None}, "stages"),
    ({"stages": []}, "stages"),
    ({"stages": _stages("a", "a")}, "stage"),
    ({"colour": "red"}, "colour"),
    ({"id": "bad id!"}, "id"),
    ({"id": "x" * 65}, "id"),
    ({"version": ""}, "version"),
    ({"batching": {"max_items": -1}}, "batching.max_items"),
    ({"batching": {"max_items": "lots"}}, "batching.max_items"),
    ({"source": {"type": "ftp"}}, "source"),
    ({"source": {"type": "sequence", "count": -3}}, "source"),
    ({"stages": _stages("a", "b", fetch_at=1)}, "fetch"),
    ({"stages": [{"name": "a", "lease": "forever"}]}, "stages.0.lease"),
    ({"tolerated_failure_percentage": 150}, "tolerated_failure_percentage"),
])
def test_invalid_flow_definitions_get_422_naming_the_field(api, patch, names):
    body = flow_def()
    body.update(patch)
    body = {k: v for k, v in body.items() if v is not None}
    problem = assert_problem(api.post("/v1/flows", json=body), 422, "invalid-request")
    errors = problem["errors"]
    assert errors and all({"field", "message"} <= e.keys() for e in errors)
    assert any(e["field"].startswith(names) or names in e["message"] for e in errors), errors
    assert api.get("/v1/flows").json() == {"flows": []}


def test_flow_show_gives_latest_and_versions_and_delete_retires_one(api):
    register(api, version="1")
    register(api, version="2", count=6)
    shown = api.get("/v1/flows/f").json()
    assert shown["flow"]["version"] == "2"
    assert shown["versions"] == ["1", "2"]

    assert api.delete("/v1/flows/f/versions/2").status_code == 204
    assert_problem(api.get("/v1/flows/f/versions/2"), 404)
    assert_problem(api.delete("/v1/flows/f/versions/2"), 404)
    shown = api.get("/v1/flows/f").json()
    assert (shown["flow"]["version"], shown["versions"]) == ("1", ["1"])

    assert api.delete("/v1/flows/f/versions/1").status_code == 204
    assert_problem(api.get("/v1/flows/f"), 404)
    assert_problem(api.post("/v1/jobs", json={"flow_id": "f"}), 404)


# -- jobs ------------------------------------------------------------------------------------------

def test_idempotency_key_replays_the_first_answer_and_creates_one_job(api):
    register(api)
    headers = {"Idempotency-Key": "create-1"}
    first = api.post("/v1/jobs", json={"flow_id": "f", "params": {"a": 1}}, headers=headers)
    again = api.post("/v1/jobs", json={"flow_id": "f", "params": {"a": 1}}, headers=headers)
    assert first.status_code == again.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    jobs = api.get("/v1/jobs").json()["jobs"]
    assert [j["job_id"] for j in jobs] == [first.json()["job_id"]]


def test_idempotency_key_with_another_body_is_422_and_creates_nothing(api):
    register(api)
    headers = {"Idempotency-Key": "create-2"}
    first = api.post("/v1/jobs", json={"flow_id": "f"}, headers=headers)
    assert first.status_code == 201
    other = api.post("/v1/jobs", json={"flow_id": "f", "params": {"b": 2}}, headers=headers)
    assert_problem(other, 422, "idempotency-mismatch")
    assert len(api.get("/v1/jobs").json()["jobs"]) == 1


def test_idempotency_key_in_flight_is_409_then_usable(api, ledger, settings, redis_client):
    register(api)
    raw = json.dumps({"flow_id": "f"})
    store = IdempotencyStore(redis_client, ledger.keys, settings.idempotency_ttl)
    assert store.begin("acme", "slow-1", fingerprint("POST", "/v1/jobs", raw.encode())) is None

    post = lambda: api.post("/v1/jobs", data=raw, headers={  # noqa: E731
        "Idempotency-Key": "slow-1", "Content-Type": "application/json"})
    assert_problem(post(), 409, "idempotency-in-flight")
    assert api.get("/v1/jobs").json() == {"jobs": []}

    store.abandon("acme", "slow-1")  # the first request died: the key is free again
    assert post().status_code == 201
    replay = post()
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert len(api.get("/v1/jobs").json()["jobs"]) == 1


def test_idempotency_keys_are_per_tenant(api, globex):
    register(api)
    register(globex)
    headers = {"Idempotency-Key": "shared"}
    mine = api.post("/v1/jobs", json={"flow_id": "f"}, headers=headers)
    theirs = globex.post("/v1/jobs", json={"flow_id": "f"}, headers=headers)
    assert mine.status_code == theirs.status_code == 201
    assert "Idempotent-Replayed" not in theirs.headers
    assert mine.json()["job_id"] != theirs.json()["job_id"]


def test_idempotent_replay_of_an_error_keeps_the_problem_content_type(api):
    headers = {"Idempotency-Key": "missing-flow"}
    first = api.post("/v1/jobs", json={"flow_id": "nope"}, headers=headers)
    body = assert_problem(first, 404)
    again = api.post("/v1/jobs", json={"flow_id": "nope"}, headers=headers)
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.json() == body
    assert_problem(again, 404)


def test_unknown_flow_or_version_is_404(api):
    register(api)
    assert_problem(api.post("/v1/jobs", json={"flow_id": "nope"}), 404, "not-found")
    assert_problem(api.post("/v1/jobs", json={"flow_id": "f", "flow_version": "9"}), 404)
    assert api.get("/v1/jobs").json() == {"jobs": []}


def test_job_list_filters_by_status(api):
    register(api)
    a = create_job(api)["job_id"]
    b = create_job(api)["job_id"]
    assert api.post(f"/v1/jobs/{a}/pause").json()["status"] == "paused"
    running = api.get("/v1/jobs", params={"status": "running"}).json()["jobs"]
    paused = api.get("/v1/jobs", params={"status": "paused"}).json()["jobs"]
    assert [j["job_id"] for j in running] == [b]
    assert [j["job_id"] for j in paused] == [a]
    assert [j["job_id"] for j in api.get("/v1/jobs").json()["jobs"]] == [b, a]  # newest first
    assert len(api.get("/v1/jobs", params={"limit": 1}).json()["jobs"]) == 1


def test_job_list_with_unknown_status_is_422(api):
    body = assert_problem(api.get("/v1/jobs", params={"status": "bogus"}), 422)
    assert "running" in body["detail"]


def test_job_create_takes_params_and_source_override(api):
    register(api)
    created = create_job(api, params={"lang": "en"}, source={"type": "sequence", "count": 3})
    assert created["status"] == "running" and created["items_total"] == 3
    env = lease(api, created["job_id"])
    assert env["params"] == {"lang": "en"}
    assert env["items"] == [0, 1]


# -- malformed input -------------------------------------------------------------------------------

@pytest.fixture
def leased(api):
    """A running job whose batch 0 is leased; returns (job_id, envelope)."""
    register(api)
    job_id = create_job(api)["job_id"]
    return job_id, lease(api, job_id)


def _bad_requests(job_id, tok):
    raw = {"headers": {"Content-Type": "application/json"}}
    b = f"/v1/jobs/{job_id}/batches"
    return [
        ("POST", "/v1/jobs", {"data": "{bad", **raw}, 400),
        ("POST", "/v1/jobs", {"data": "[1, 2]", **raw}, 400),
        ("POST", "/v1/jobs", {"data": '"flow"', **raw}, 400),
        ("POST", "/v1/jobs", {"data": "", **raw}, 400),
        ("POST", "/v1/jobs", {"data": b"\xff\xfe{", **raw}, 400),
        ("POST", "/v1/jobs", {"data": "{bad", "headers": {"Idempotency-Key": "k1", **raw["headers"]}}, 400),
        ("POST", "/v1/jobs", {"data": '{"flow_id": "f"}'}, 415),  # no Content-Type
        ("POST", "/v1/jobs", {"json": {"flow_id": 5}}, 422),
        ("POST", "/v1/jobs", {"json": {"flow_id": "f", "params": [1]}}, 422),
        ("POST", "/v1/jobs", {"json": {"flow_id": "f", "extra": 1}}, 422),
        ("POST", "/v1/jobs", {"json": {"flow_id": "f", "source": {"type": "nope"}}}, 422),
        ("POST", "/v1/flows", {"data": "{bad", **raw}, 400),
        ("POST", "/v1/flows", {"data": "[]", **raw}, 400),
        ("POST", f"/v1/jobs/{job_id}/lease", {"data": "{bad", **raw}, 400),
        ("POST", f"/v1/jobs/{job_id}/lease", {"json": [1]}, 400),
        ("POST", f"/v1/jobs/{job_id}/lease", {"json": {"stage": 5}}, 422),
        ("POST", f"/v1/jobs/{job_id}/lease", {"json": {"stage": "score", "x": 1}}, 422),
        ("POST", f"/v1/jobs/{job_id}/lease", {"json": {"stage": "nope"}}, 404),
        ("POST", f"{b}/0/complete", {"data": "{bad", **raw}, 400),
        ("POST", f"{b}/0/complete", {"json": [tok]}, 400),
        ("POST", f"{b}/0/complete", {"json": {"lease_token": 123}}, 422),
        ("POST", f"{b}/0/complete", {"json": {"lease_token": tok, "extra": 1}}, 422),
        ("POST", f"{b}/0/complete", {"json": {"lease_token": tok, "items": "abc"}}, 422),
        ("POST", f"{b}/0/complete", {"json": {"output": 1}}, 422),
        ("POST", f"{b}/0/complete", {}, 400),
        ("POST", f"{b}/0/heartbeat", {"json": {"lease_token": tok, "extend_s": -1}}, 422),
        ("POST", f"{b}/0/heartbeat", {"json": {"lease_token": tok, "extend_s": "soon"}}, 422),
        ("POST", f"{b}/0/fail", {"json": {"lease_token": tok,
                                          "error": {"message": "x", "retryable": "maybe"}}}, 422),
        ("POST", f"{b}/0/fail", {"json": {"lease_token": tok, "error": "boom"}}, 422),
        ("POST", f"{b}/0/fail", {"json": {"lease_token": tok, "error": {"message": ""}}}, 422),
        ("POST", f"{b}/0/fail", {"json": {"lease_token": tok}}, 422),
        ("POST", f"{b}/999/complete", {"json": {"lease_token": tok}}, 404),
        ("POST", f"{b}/999/heartbeat", {"json": {"lease_token": tok}}, 404),
        ("POST", f"{b}/999/fail", {"json": {"lease_token": tok, "error": {"message": "x"}}}, 404),
        ("POST", f"{b}/abc/complete", {"json": {"lease_token": tok}}, 404),
        ("POST", f"{b}/-1/complete", {"json": {"lease_token": tok}}, 404),
        ("POST", f"/v1/jobs/{job_id}/resume", {"data": "{bad", **raw}, 400),
        ("POST", f"/v1/jobs/{job_id}/resume", {"json": {"reason": 5}}, 422),
        ("POST", f"/v1/jobs/{job_id}/resume", {"json": {"cursor": {"type": "offset"}}}, 422),
        ("GET", "/v1/jobs/job_nope", {}, 404),
        ("GET", "/v1/jobs/nope", {}, 404),
        ("GET", f"/v1/jobs/job_{'x' * 80}", {}, 404),
        ("POST", "/v1/jobs/job_nope/lease", {}, 404),
        ("GET", f"{b}/abc", {}, 404),
        ("GET", f"{b}/1.5", {}, 404),
        ("GET", f"{b}/-1", {}, 404),
        ("GET", f"{b}/999", {}, 404),
        ("GET", f"{b}?after=x", {}, 422),
        ("GET", f"{b}?limit=0", {}, 422),
        ("GET", f"{b}?status=bogus", {}, 422),
        ("GET", "/v1/jobs?limit=abc", {}, 422),
        ("GET", "/v1/jobs?limit=100000", {}, 422),
        ("GET", f"/v1/jobs/{job_id}/log?after=garbage", {}, 422),
        ("GET", f"/v1/jobs/{job_id}/log?limit=abc", {}, 422),
        ("GET", "/v1/flows/nope", {}, 404),
        ("DELETE", "/v1/flows/f/versions/9", {}, 404),
    ]


def test_malformed_requests_are_refused_cleanly_and_change_nothing(api, leased):
    job_id, env = leased
    before = snapshot(api, job_id)
    flows_before = api.get("/v1/flows").json()
    for method, path, kwargs, status in _bad_requests(job_id, env["lease_token"]):
        resp = api.request(method, path, **kwargs)
        assert resp.status_code == status, (method, path, kwargs, resp.status_code, resp.text)
        assert_problem(resp, status)
        assert snapshot(api, job_id) == before, (method, path, kwargs)
    assert api.get("/v1/flows").json() == flows_before
    assert [j["job_id"] for j in api.get("/v1/jobs").json()["jobs"]] == [job_id]
    assert complete(api, env).status_code == 200  # the lease survived all of it


def test_422_errors_name_fields_without_echoing_input(api, leased):
    job_id, env = leased
    resp = api.post(f"/v1/jobs/{job_id}/batches/0/fail", json={
        "lease_token": env["lease_token"], "error": {"message": "x", "retryable": "maybe"}})
    body = assert_problem(resp, 422)
    assert [e["field"] for e in body["errors"]] == ["error.retryable"]
    assert "maybe" not in resp.text and env["lease_token"] not in resp.text


def test_bodies_over_the_limit_get_413_and_write_nothing(small_api):
    register(small_api)
    job_id = create_job(small_api)["job_id"]
    env = lease(small_api, job_id)
    before = snapshot(small_api, job_id)
    big = "x" * 2000

    assert_problem(small_api.post("/v1/flows", json=flow_def(flow_id="g", description=big)), 413)
    assert_problem(small_api.post(f"/v1/jobs/{job_id}/batches/0/complete",
                                  json={"lease_token": env["lease_token"], "output": big}), 413)
    huge_job = {"flow_id": "f", "params": {"blob": big}}
    assert_problem(small_api.post("/v1/jobs", json=huge_job, headers={"Idempotency-Key": "k"}), 413)

    assert snapshot(small_api, job_id) == before
    assert [f["flow"]["id"] for f in small_api.get("/v1/flows").json()["flows"]] == ["f"]
    assert len(small_api.get("/v1/jobs").json()["jobs"]) == 1
    # the refused request did not burn its Idempotency-Key
    resp = small_api.post("/v1/jobs", json={"flow_id": "f"}, headers={"Idempotency-Key": "k"})
    assert resp.status_code == 201 and "Idempotent-Replayed" not in resp.headers
    assert complete(small_api, env).status_code == 200


# -- pull mode -------------------------------------------------------------------------------------

def test_lease_envelope(api):
    register(api)
    job_id = create_job(api, params={"p": 1})["job_id"]
    env = lease(api, job_id)
    assert {"job_id", "seq", "stage", "attempt", "idempotency_key", "cursor", "items", "input",
            "params", "lease_token", "lease_deadline"} <= env.keys()
    assert (env["job_id"], env["seq"], env["stage"], env["attempt"]) == (job_id, 0, "score", 1)
    assert env["idempotency_key"].startswith(f"{job_id}:score:r") and env["generation"] == 0
    assert env["cursor"] == {"type": "offset", "offset": 0}
    assert env["items"] == [0, 1]
    assert env["input"] is None
    assert env["params"] == {"p": 1}
    assert isinstance(env["lease_token"], str) and len(env["lease_token"]) >= 16
    deadline = datetime.strptime(env["lease_deadline"], "%Y-%m-%dT%H:%M:%S.%fZ")
    assert deadline.replace(tzinfo=UTC) > datetime.now(UTC)

    # the next stage of the same batch gets the previous output as input
    assert complete(api, env, {"scores": [9, 8]}).status_code == 200
    nxt = lease(api, job_id)
    assert (nxt["seq"], nxt["stage"]) == (0, "store")
    assert nxt["idempotency_key"] == env["idempotency_key"].replace(":score:", ":store:")  # same range
    assert nxt["input"] == {"scores": [9, 8]}
    assert nxt["items"] == [0, 1]


def test_complete_stale_duplicate_and_finished(api):
    register(api)
    job_id = create_job(api)["job_id"]
    env = lease(api, job_id)
    batch_before = api.get(f"/v1/jobs/{job_id}/batches/0").json()

    stale = api.post(f"/v1/jobs/{job_id}/batches/0/complete", json={"lease_token": "not-it"})
    body = assert_problem(stale, 409, "stale-lease")
    assert body["batch_status"] == "leased"
    assert api.get(f"/v1/jobs/{job_id}/batches/0").json() == batch_before

    first = complete(api, env, {"v": 1})
    assert first.status_code == 200 and first.json()["duplicate"] is False
    dup = complete(api, env, {"v": 2})
    assert dup.status_code == 200
    assert dup.json() == {**first.json(), "duplicate": True}
    stages = api.get(f"/v1/jobs/{job_id}/batches/0").json()["stages"]
    assert stages["score"] == {"status": "completed", "output": {"v": 1}}

    leased = api.post(f"/v1/jobs/{job_id}/lease")
    assert leased.status_code == 200 and leased.headers["Batchgate-Job-Status"] == "running"
    api.post(f"/v1/jobs/{job_id}/batches/{leased.json()['seq']}/complete",
             json={"lease_token": leased.json()["lease_token"], "output": {}})
    seen = [leased.json(), *drain(api, job_id)]
    assert sorted((e["seq"], e["stage"]) for e in seen) == [(0, "store"), (1, "score"),
                                                             (1, "store")]
    done = api.post(f"/v1/jobs/{job_id}/lease")
    assert done.status_code == 204 and done.content == b""
    assert done.headers["Batchgate-Job-Status"] == "succeeded"
    view = job(api, job_id)
    assert (view["status"], view["items_done"], view["progress"]) == ("succeeded", 4, 1.0)
    # a late duplicate of the very first completion still gets its first answer
    assert complete(api, env).json() == {**first.json(), "duplicate": True}


def test_heartbeat_progress_shows_on_the_batch(api):
    register(api)
    job_id = create_job(api)["job_id"]
    env = lease(api, job_id)
    url = f"/v1/jobs/{job_id}/batches/0"
    resp = api.post(f"{url}/heartbeat", json={"lease_token": env["lease_token"],
                                               "progress": {"done": 1}, "extend_s": 120})
    assert resp.status_code == 200, resp.text
    assert resp.json()["job_status"] == "running"
    batch = api.get(url).json()
    assert batch["progress"] == {"done": 1}
    assert batch["status"] == "leased"
    assert resp.json()["lease_deadline"] > env["lease_deadline"]

    stale = api.post(f"{url}/heartbeat", json={"lease_token": "old", "progress": {"done": 99}})
    assert_problem(stale, 409, "stale-lease")
    assert api.get(url).json() == batch


def test_fatal_failure_fails_job_and_retry_failed_runs_it_to_success(api):
    register(api)
    job_id = create_job(api)["job_id"]
    env = lease(api, job_id)
    resp = api.post(f"/v1/jobs/{job_id}/batches/0/fail", json={
        "lease_token": env["lease_token"],
        "error": {"message": "bad row", "retryable": False, "type": "ValueError"}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["outcome"] == "failed"

    batch = api.get(f"/v1/jobs/{job_id}/batches/0").json()
    assert (batch["status"], batch["error"]) == ("failed", "bad row")
    view = job(api, job_id)
    assert view["status"] == "failed" and view["batches"]["failed"] == 1
    blocked = api.post(f"/v1/jobs/{job_id}/lease")
    assert blocked.status_code == 204 and blocked.headers["Batchgate-Job-Status"] == "failed"
    assert any(e["event"] == "batch_failed" for e in api.get(f"/v1/jobs/{job_id}/log").json()["entries"])

    retried = api.post(f"/v1/jobs/{job_id}/retry-failed")
    assert retried.status_code == 200, retried.text
    assert (retried.json()["reopened"], retried.json()["status"]) == (1, "running")
    seen = drain(api, job_id)  # batches planned ahead with batch 0 were ready before it was re-opened
    again = [env for env in seen if env["seq"] == 0]
    assert [(env["stage"], env["attempt"]) for env in again][:1] == [("score", 1)]
    view = job(api, job_id)
    assert (view["status"], view["items_done"], view["batches"]["failed"]) == ("succeeded", 4, 0)


def test_items_from_a_non_fetching_stage_cannot_inflate_the_job_counts(api):
    register(api)
    job_id = create_job(api)["job_id"]
    env = lease(api, job_id)
    resp = api.post(f"/v1/jobs/{job_id}/batches/0/complete",
                    json={"lease_token": env["lease_token"], "items": list(range(50))})
    if resp.status_code != 200:  # refusing is as good as ignoring
        assert_problem(resp, 422)
        assert complete(api, env).status_code == 200
    drain(api, job_id)
    view = job(api, job_id)
    assert api.get(f"/v1/jobs/{job_id}/batches/0").json()["items"] == 2
    assert (view["status"], view["items_done"], view["progress"]) == ("succeeded", 4, 1.0)


def test_retryable_failure_is_retried_not_failed(api):
    register(api)
    job_id = create_job(api)["job_id"]
    env = lease(api, job_id)
    resp = api.post(f"/v1/jobs/{job_id}/batches/0/fail", json={
        "lease_token": env["lease_token"], "error": {"message": "timeout"}})
    assert resp.json()["outcome"] == "retry"
    assert api.get(f"/v1/jobs/{job_id}/batches/0").json()["status"] == "pending"
    assert job(api, job_id)["status"] == "running"
    again = api.post(f"/v1/jobs/{job_id}/batches/0/fail", json={
        "lease_token": env["lease_token"], "error": {"message": "timeout"}})
    assert_problem(again, 409, "stale-lease")


def test_a_job_that_succeeded_within_its_budget_can_retry_its_failed_batches(api):
    """Issue 15: the budget let the job succeed, but the failed batch's items were never stored."""
    register(api, count=8, stages=("only",), tolerated_failure_percentage=50)
    job_id = create_job(api)["job_id"]
    env = lease(api, job_id)
    failed = api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/fail", json={
        "lease_token": env["lease_token"], "error": {"message": "bad row", "retryable": False}})
    assert failed.json()["outcome"] == "failed"
    drain(api, job_id)
    view = job(api, job_id)
    assert (view["status"], view["items_done"], view["retryable_failed"]) == ("succeeded", 6, 1)

    retried = api.post(f"/v1/jobs/{job_id}/retry-failed")
    assert retried.status_code == 200, retried.text
    assert (retried.json()["reopened"], retried.json()["status"]) == (1, "running")
    again = drain(api, job_id)
    assert [(e["seq"], e["items"] or e["cursor"]) for e in again][:1] == [(env["seq"], env["items"] or env["cursor"])]
    view = job(api, job_id)
    assert (view["status"], view["items_done"], view["batches"]["failed"], view["retryable_failed"]) == (
        "succeeded", 8, 0, 0)
    audit = [e["event"] for e in api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]]
    assert audit.count("retry_failed") == 1


def test_retry_failed_on_a_succeeded_job_leaves_it_succeeded(api):
    register(api, stages=("only",))
    job_id = create_job(api)["job_id"]
    drain(api, job_id)
    resp = api.post(f"/v1/jobs/{job_id}/retry-failed")
    assert resp.status_code in (200, 409), resp.text
    assert job(api, job_id)["status"] == "succeeded"
    done = api.post(f"/v1/jobs/{job_id}/lease")
    assert done.headers["Batchgate-Job-Status"] == "succeeded"


def test_retry_failed_does_not_revive_a_cancelled_job(api):
    register(api)
    job_id = create_job(api)["job_id"]
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    api.post(f"/v1/jobs/{job_id}/retry-failed")
    assert job(api, job_id)["status"] == "cancelled"
    assert api.post(f"/v1/jobs/{job_id}/lease").status_code == 204


# -- pause, resume, cursors, flow versions --------------------------------------------------------

def test_pause_blocks_leases_until_resume(api):
    register(api)
    job_id = create_job(api)["job_id"]
    paused = api.post(f"/v1/jobs/{job_id}/pause")
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    resp = api.post(f"/v1/jobs/{job_id}/lease")
    assert resp.status_code == 204 and resp.headers["Batchgate-Job-Status"] == "paused"
    assert_problem(api.post(f"/v1/jobs/{job_id}/pause"), 409)

    resumed = api.post(f"/v1/jobs/{job_id}/resume")
    assert resumed.status_code == 200 and resumed.json()["status"] == "running"
    assert lease(api, job_id)["seq"] == 0


def test_cancel_stops_leasing(api):
    register(api)
    job_id = create_job(api)["job_id"]
    assert api.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    resp = api.post(f"/v1/jobs/{job_id}/lease")
    assert resp.status_code == 204 and resp.headers["Batchgate-Job-Status"] == "cancelled"
    assert_problem(api.post(f"/v1/jobs/{job_id}/pause"), 409)


@pytest.fixture
def succeeded(api):
    """A job over 4 items, 2 per batch, one stage, run to success."""
    register(api, stages=("only",))
    job_id = create_job(api)["job_id"]
    drain(api, job_id)
    assert job(api, job_id)["status"] == "succeeded"
    return job_id


def test_resume_of_a_succeeded_job_needs_a_cursor(api, succeeded):
    before = snapshot(api, succeeded)
    body = assert_problem(api.post(f"/v1/jobs/{succeeded}/resume"), 409)
    assert "cursor" in body["detail"]
    assert snapshot(api, succeeded) == before


def test_resume_with_a_cursor_reruns_from_it(api, succeeded):
    resp = api.post(f"/v1/jobs/{succeeded}/resume",
                    json={"cursor": {"type": "offset", "offset": 0}, "reason": "rerun"})
    assert resp.status_code == 200, resp.text
    view = resp.json()
    assert view["status"] == "running"
    assert view["resume"]["first_new_seq"] == 2
    assert view["committed_cursor"] == {"type": "offset", "offset": 0}

    seen = drain(api, succeeded)
    assert [(e["seq"], e["items"]) for e in seen] == [(2, [0, 1]), (3, [2, 3])]
    assert job(api, succeeded)["status"] == "succeeded"
    moved = [e for e in api.get(f"/v1/jobs/{succeeded}/log").json()["entries"]
             if e["event"] == "cursor_moved"]
    assert len(moved) == 1
    assert moved[0]["actor"] == "tenant:acme"
    assert moved[0]["to"] == {"type": "offset", "offset": 0}  # typed: a cursor is JSON, not text
    assert moved[0]["reason"] == "rerun"
    audit = api.get(f"/v1/jobs/{succeeded}/audit").json()["entries"]
    assert [e["event"] for e in audit] == ["job_created", "cursor_moved"]
    assert audit[1]["to"] == {"type": "offset", "offset": 0} and audit[1]["superseded"] == 0


@pytest.mark.parametrize("cursor", [{"type": "page"}, 5, None, "offset", {"type": "offset",
                                                                             "offset": -1}])
def test_resume_with_a_bad_cursor_is_422_and_changes_nothing(api, succeeded, cursor):
    before = snapshot(api, succeeded)
    body = assert_problem(api.post(f"/v1/jobs/{succeeded}/resume", json={"cursor": cursor}), 422)
    assert "cursor" in body["detail"]
    assert snapshot(api, succeeded) == before


def test_resume_with_a_cursor_of_the_wrong_type_for_the_source_is_422(api, succeeded):
    before = snapshot(api, succeeded)
    resp = api.post(f"/v1/jobs/{succeeded}/resume",
                    json={"cursor": {"type": "page", "page": 0, "skip": 0}})
    assert_problem(resp, 422)
    assert snapshot(api, succeeded) == before


def test_resume_after_the_flow_version_is_retired_is_409(api, succeeded):
    recorded = job(api, succeeded)["flow"]["hash"]
    assert api.delete("/v1/flows/f/versions/1").status_code == 204
    before = snapshot(api, succeeded)
    resp = api.post(f"/v1/jobs/{succeeded}/resume", json={"cursor": {"type": "offset", "offset": 0}})
    body = assert_problem(resp, 409, "flow-version-mismatch")
    assert body["recorded_hash"] == recorded
    assert snapshot(api, succeeded) == before


def test_resume_after_the_stored_definition_was_tampered_is_409(api, settings, redis_client):
    register(api)
    job_id = create_job(api)["job_id"]
    recorded = job(api, job_id)["flow"]["hash"]
    assert api.post(f"/v1/jobs/{job_id}/pause").status_code == 200
    key = Keys(settings.key_prefix).flow("acme", "f", "1")
    tampered = {**flow_def(), "description": "edited behind the registry's back"}
    redis_client.hset(key, "definition", json.dumps(tampered))
    before = snapshot(api, job_id)

    for path in ("resume", "retry-failed"):
        body = assert_problem(api.post(f"/v1/jobs/{job_id}/{path}"), 409, "flow-version-mismatch")
        assert body["recorded_hash"] == recorded
        assert body["current_hash"] and body["current_hash"] != body["recorded_hash"]
        assert snapshot(api, job_id) == before


def test_a_failure_type_a_worker_reports_shows_with_the_batch(api, make_job, ledger):
    job_id = make_job(items=[1, 2], max_items=2, stages=("only",))
    lease = ledger.lease(job_id)
    resp = api.post(f"/v1/jobs/{job_id}/batches/{lease.seq}/fail",
                    json={"lease_token": lease.lease_token,
                          "error": {"message": "model quota exceeded", "type": "quota", "retryable": True}})
    assert resp.status_code == 200 and resp.json()["outcome"] == "retry"
    batch = api.get(f"/v1/jobs/{job_id}/batches/{lease.seq}").json()
    shown = (batch["error"], batch["error_type"], batch["attempts_spent"])
    assert shown == ("model quota exceeded", "quota", 1)
    listed = api.get(f"/v1/jobs/{job_id}/batches").json()["batches"]
    assert listed[0]["error_type"] == "quota"


def test_complete_and_lease_next_runs_a_job_in_one_request_per_step(api, ledger):
    """issue 18 item 0: a pull loop pays one round trip per step; the commit stands whatever the lease.
    A lost answer replayed commits nothing twice; the batch its first answer leased comes back when
    that lease runs out."""
    api.post("/v1/flows", json={"id": "ln", "version": "1", "batching": {"max_items": 2},
                                "source": {"type": "sequence", "count": 10},
                                "stages": [{"name": "s", "lease": 1,
                                            "retry": {"initial_interval": 0.1, "maximum_attempts": 3}}]})
    job_id = api.post("/v1/jobs", json={"flow_id": "ln"}).json()["job_id"]
    env = api.post(f"/v1/jobs/{job_id}/lease").json()
    replayed = False
    deadline = time.monotonic() + 30
    while True:
        assert time.monotonic() < deadline
        body = {"lease_token": env["lease_token"], "output": {"seq": env["seq"]}, "lease_next": True}
        resp = api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete", json=body)
        assert resp.status_code == 200 and resp.json()["status"] == "committed", resp.text
        if not replayed and resp.json()["next"] is not None:
            replayed = True  # this answer is "lost": the loop sends the same request again
            resp = api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete", json=body)
            assert resp.status_code == 200 and resp.json()["duplicate"] is True
        env = resp.json()["next"]
        while env is None and resp.headers["Batchgate-Job-Status"] == "running":
            assert time.monotonic() < deadline, "the orphaned batch never came back"
            time.sleep(0.1)  # the orphaned batch's lease has not run out yet: the supervisor expires it
            Supervisor(ledger, name="sup").tick()
            resp = api.post(f"/v1/jobs/{job_id}/lease")
            env = resp.json() if resp.status_code == 200 else None
        if env is None:
            break
    assert resp.headers["Batchgate-Job-Status"] == "succeeded"
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "succeeded" and view["batches"]["completed"] == 5
    log = [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).log) if f["event"] == "stage_completed"]
    assert sorted(int(f["seq"]) for f in log) == [0, 1, 2, 3, 4]  # each batch committed once
