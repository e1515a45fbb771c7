"""Push mode through the API: signed callbacks, blobs by reference, outbound guard, 429 cooldown."""

from __future__ import annotations

import time

import pytest

from connectors.base import verify_signature
from gateway.push.dispatch import Dispatcher
from gateway.ledger.ledger import Ledger
from gateway.security import sign
from tests.platforms import FakeHttpPlatform


def callback_flow(url: str, **stage) -> dict:
    return {"id": "cb", "version": "1", "batching": {"max_items": 3}, "source": {"type": "sequence", "count": 9},
            "stages": [{"name": "process", "lease": 5, "retry": {"initial_interval": 0.05},
                        "target": {"type": "http", "url": url, "mode": "callback"}, **stage}]}


@pytest.fixture
def push(settings, redis_client):
    """A ledger and dispatcher allowed to call loopback, sharing the api fixture's settings."""
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})
    ledger = Ledger(redis_client, own)
    return ledger, Dispatcher.build(own, ledger)


@pytest.fixture
def api_push(settings, redis_client, monkeypatch):
    from gateway.api.app import create_app
    from tests.conftest import TOKEN
    from tests.http import ApiClient, serve_app

    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})
    holder = {}
    base, stop = serve_app(lambda env, start: holder["app"](env, start))
    holder["app"] = create_app(own.model_copy(update={"public_url": base}), redis_client)
    yield ApiClient(base, TOKEN), own.model_copy(update={"public_url": base})
    stop()


def start_and_trigger(api, settings, redis_client, platform):
    """Create a job, run its first stage attempt in-process; returns (job_id, envelope sent)."""
    assert api.post("/v1/flows", json=callback_flow(platform.url)).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "cb"}).json()["job_id"]
    ledger = Ledger(redis_client, settings)
    d = Dispatcher.build(settings, ledger)
    lease = ledger.lease_stages(job_id, [0])
    d.run_leased(ledger.spec(job_id), lease)
    return job_id, platform.requests[-1]


def test_callback_commits_and_duplicates_get_the_first_answer(api_push, redis_client):
    api, settings = api_push
    with FakeHttpPlatform() as platform:
        platform.plan("accepted")
        job_id, sent = start_and_trigger(api, settings, redis_client, platform)
    env = sent.json
    assert sent.headers["Idempotency-Key"] == env["idempotency_key"]
    assert env["idempotency_key"].startswith(f"{job_id}:process:r") and env["generation"] == 0
    assert verify_signature(sent.headers["Batchgate-Signature"], sent.body, settings.signing_secret())
    answer = {"status": "succeeded", "output": {"n": 3}}
    first = api.session.post(env["callback_url"], json=answer)
    again = api.session.post(env["callback_url"], json={"status": "succeeded", "output": {"n": 999}})
    assert first.status_code == again.status_code == 200
    assert again.json() == {**first.json(), "duplicate": True}
    assert api.get(f"/v1/jobs/{job_id}/batches/0").json()["stages"]["process"]["output"] == {"n": 3}


def test_forged_expired_and_malformed_callbacks(api_push, redis_client):
    api, settings = api_push
    with FakeHttpPlatform() as platform:
        platform.plan("accepted")
        job_id, sent = start_and_trigger(api, settings, redis_client, platform)
    url = sent.json["callback_url"]
    token = url.rsplit("/", 1)[1]
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    ok = {"status": "succeeded", "output": {}}
    assert api.session.post(f"{api.base}/v1/callbacks/{forged}", json=ok).status_code == 401
    expired = sign({"j": job_id, "s": 0, "st": 0, "a": 1, "t": "x"}, settings.signing_secret(), "callback", -5)
    resp = api.session.post(f"{api.base}/v1/callbacks/{expired}", json=ok)
    assert resp.status_code == 410 and resp.headers["Content-Type"] == "application/problem+json"
    assert api.session.post(url, json={"status": "maybe"}).status_code == 422
    as_json = {"Content-Type": "application/json"}
    assert api.session.post(url, data="{nope", headers=as_json).status_code == 400
    assert api.session.post(url, data='{"status": "succeeded"}').status_code == 415  # no JSON type
    assert api.get(f"/v1/jobs/{job_id}/batches/0").json()["status"] == "leased"  # nothing changed


def test_stale_attempt_callback_gets_409(api_push, redis_client):
    api, settings = api_push
    with FakeHttpPlatform() as platform:
        platform.plan("accepted")
        job_id, sent = start_and_trigger(api, settings, redis_client, platform)
    ledger = Ledger(redis_client, settings)
    batch = ledger.batch_record(job_id, 0)
    ledger.fail(job_id, 0, batch["lease_token"], "lost", retryable=True)  # attempt 1 is over
    resp = api.session.post(sent.json["callback_url"], json={"status": "succeeded", "output": {}})
    assert resp.status_code == 409 and resp.json()["type"].endswith("stale-lease")


def test_failure_callback_takes_the_failure_path(api_push, redis_client):
    api, settings = api_push
    with FakeHttpPlatform() as platform:
        platform.plan("accepted")
        job_id, sent = start_and_trigger(api, settings, redis_client, platform)
    resp = api.session.post(sent.json["callback_url"],
                            json={"status": "failed", "error": {"message": "model quota", "retryable": True}})
    assert resp.status_code == 200 and resp.json()["outcome"] == "retry"
    batch = api.get(f"/v1/jobs/{job_id}/batches/0").json()
    assert batch["status"] == "pending" and batch["error"] == "model quota"


def test_big_items_go_by_signed_url(api_push, redis_client):
    api, settings = api_push
    settings = settings.model_copy(update={"inline_max_bytes": 4})
    with FakeHttpPlatform() as platform:
        platform.plan("accepted")
        job_id, sent = start_and_trigger(api, settings, redis_client, platform)
    env = sent.json
    assert env["items"] is None
    assert api.as_token(None).get(env["items_url"][len(api.base):]).json() == [0, 1, 2]
    assert api.as_token(None).get("/v1/blobs/bogus.token").status_code == 401


def test_registration_refuses_a_target_on_a_private_address(api):
    resp = api.post("/v1/flows", json=callback_flow("http://10.0.0.1/hook"))
    assert resp.status_code == 422 and "private" in resp.json()["detail"]
    resp = api.post("/v1/flows", json=callback_flow("http://169.254.169.254/latest"))
    assert resp.status_code == 422 and "metadata" in resp.json()["detail"]


def test_a_429_cools_the_whole_target_down(push, make_job):
    ledger, dispatcher = push
    with FakeHttpPlatform() as platform:
        platform.plan("rate_limited")  # 429, Retry-After: 2
        job_id = make_job(items=list(range(9)), max_items=3, stage_defs=[
            {"name": "process", "retry": {"initial_interval": 0.05},
             "target": {"type": "http", "url": platform.url, "mode": "sync"}}])
        lease = ledger.lease_stages(job_id, [0])
        dispatcher.run_leased(ledger.spec(job_id), lease)
        calls = len(platform.requests)
        assert dispatcher.run_ready(job_id) == 0  # every batch for this target waits out the Retry-After
        assert len(platform.requests) == calls
        batch = ledger.batch_record(job_id, lease.seq)
        assert batch["status"] == "pending" and int(batch["ready_ms"]) - int(time.time() * 1000) > 1000
        # a 429 is the target's state, not the batch's failure: no attempt is spent on it
        assert int(batch["attempt"]) - int(batch.get("unspent") or 0) == 0
