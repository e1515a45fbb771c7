"""The approvals API and signed decision links, over a real socket on a real Redis."""

from __future__ import annotations

import re
import time

import requests

from tests.conftest import OTHER_TOKEN

FLOW = {"id": "review", "version": "1", "batching": {"max_items": 2},
        "stages": [{"name": "score"},
                   {"name": "check", "approval": {"timeout": "PT1H", "on_timeout": "reject"}},
                   {"name": "store"}],
        "tolerated_failure_percentage": 100}


def start(api, count=6, flow=FLOW):
    assert api.post("/v1/flows", json=flow).status_code in (200, 201)
    job = api.post("/v1/jobs", json={"flow_id": flow["id"], "source": {"type": "sequence", "count": count}})
    assert job.status_code == 201, job.text
    job_id = job.json()["job_id"]
    while (lease := api.post(f"/v1/jobs/{job_id}/lease", json={})).status_code == 200:
        env = lease.json()
        done = api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
                        json={"lease_token": env["lease_token"], "output": {"scored": env["seq"]}})
        assert done.status_code == 200, done.text
    assert lease.headers["Batchgate-Job-Status"] == "waiting_human"
    return job_id


def pending(api):
    ids, path = [], "/v1/approvals?status=pending&limit=2"
    while path:
        page = api.get(path)
        assert page.status_code == 200, page.text
        ids += [a["id"] for a in page.json()["approvals"]]
        path = page.json()["next"]
    return ids


def test_list_show_decide_and_the_4xx_answers(api):
    job_id = start(api)
    ids = pending(api)
    assert len(ids) == 3 and all(i.startswith(job_id) for i in ids)
    one = api.get(f"/v1/approvals/{ids[0]}").json()
    assert one["status"] == "pending" and one["stage"] == "check" and one["items"]["count"] == 2
    assert one["shown_output"] == {"scored": one["seq"]} and one["links"][0]["approver"] is None
    other = api.as_token(OTHER_TOKEN)
    assert other.get(f"/v1/approvals/{ids[0]}").status_code == 404
    assert other.post(f"/v1/approvals/{ids[0]}", json={"decision": "approve"}).status_code == 404
    assert other.get("/v1/approvals").json()["approvals"] == []
    assert api.get("/v1/approvals/job_nope.1.1.1").status_code == 404
    for bad in ({"decision": "maybe"}, {}, {"decision": "approve", "extra": 1},
                {"decision": "reject", "output": {"x": 1}}, {"decision": "approve", "comment": "x" * 3000}):
        res = api.post(f"/v1/approvals/{ids[0]}", json=bad)
        assert res.status_code == 422, (bad, res.text)
        assert res.headers["Content-Type"].startswith("application/problem+json")
    assert api.get("/v1/approvals?status=nope").status_code == 422
    assert api.get("/v1/approvals?cursor=garbage").status_code == 422
    ok = api.post(f"/v1/approvals/{ids[0]}", json={"decision": "approve", "output": {"edited": 1}})
    assert ok.status_code == 200 and ok.json()["decision"]["actor"] == "tenant:acme"
    again = api.post(f"/v1/approvals/{ids[0]}", json={"decision": "approve"})
    assert again.status_code == 200 and again.json()["decision"] == ok.json()["decision"]
    conflict = api.post(f"/v1/approvals/{ids[0]}", json={"decision": "reject"})
    assert conflict.status_code == 409 and conflict.json()["type"].endswith("/approval-decided")
    lease = api.post(f"/v1/jobs/{job_id}/lease", json={}).json()
    assert lease["stage"] == "store" and lease["input"] == {"edited": 1}
    rejected = api.post(f"/v1/approvals/{ids[1]}", json={"decision": "reject", "comment": "no"})
    assert rejected.status_code == 200 and rejected.json()["status"] == "rejected"
    listed = api.get("/v1/approvals?status=rejected").json()["approvals"]
    assert [a["id"] for a in listed] == [ids[1]]
    assert ids[0] in [a["id"] for a in api.get("/v1/approvals?status=approved").json()["approvals"]]


def test_approvers_only(api):
    flow = {**FLOW, "id": "guarded", "stages": [
        {"name": "score"}, {"name": "check", "approval": {"timeout": "PT1H", "approvers": ["alice", "bob"]}}]}
    start(api, count=2, flow=flow)
    (aid,) = pending(api)
    assert api.post(f"/v1/approvals/{aid}", json={"decision": "approve"}).status_code == 403
    links = api.get(f"/v1/approvals/{aid}").json()["links"]
    assert [link["approver"] for link in links] == ["alice", "bob"]


def test_bad_flow_specs_are_422_naming_the_field(api):
    flow = {**FLOW, "id": "bad", "stages": [{"name": "score"},
                                            {"name": "check", "approval": {"timeout": "PT0.1S"}}]}
    res = api.post("/v1/flows", json=flow)
    assert res.status_code == 422 and "timeout" in res.text


def _form_action(html):
    return re.search(r'<form method="post"', html) is not None


def test_signed_link_get_shows_post_decides_once(api):
    start(api, count=4)
    aid = pending(api)[0]
    url = api.get(f"/v1/approvals/{aid}").json()["links"][0]["url"]
    page = requests.get(url, timeout=10)  # what a chat app's link preview does
    assert page.status_code == 200 and _form_action(page.text) and "scored" in page.text
    assert api.get(f"/v1/approvals/{aid}").json()["status"] == "pending"  # a GET decides nothing
    done = requests.post(url, data={"decision": "approve", "comment": "fine"}, timeout=10)
    assert done.status_code == 200 and "approved" in done.text
    view = api.get(f"/v1/approvals/{aid}").json()
    assert view["status"] == "approved" and view["decision"]["actor"] == "link"
    second = requests.post(url, data={"decision": "reject"}, timeout=10)
    assert second.status_code == 409 and "used already" in second.text
    assert api.get(f"/v1/approvals/{aid}").json()["status"] == "approved"
    shown = requests.get(url, timeout=10)
    assert shown.status_code == 200 and not _form_action(shown.text)


def test_tampered_and_expired_links(api, ledger):
    from gateway.ledger.decisions import token_for

    start(api, count=2)
    aid = pending(api)[0]
    url = api.get(f"/v1/approvals/{aid}").json()["links"][0]["url"]
    base, token = url.rsplit("/", 1)
    body, mac = token.split(".")
    other_mac = mac[:-2] + ("AA" if mac[-2:] != "AA" else "BB")
    for forged in (body + "." + other_mac, body[:-1] + "." + mac, "x.y"):
        res = requests.post(f"{base}/{forged}", data={"decision": "approve"}, timeout=10)
        assert res.status_code == 401 and res.headers["Content-Type"].startswith("text/html")
    expired = token_for(ledger, aid, None, int(time.time() * 1000) - 120_000)
    res = requests.post(f"{base}/{expired}", data={"decision": "approve"}, timeout=10)
    assert res.status_code == 410
    assert requests.post(url, data={"decision": "maybe"}, timeout=10).status_code == 422
    assert api.get(f"/v1/approvals/{aid}").json()["status"] == "pending"


def test_pull_complete_waiting_human_opens_a_platform_approval(api):
    flow = {"id": "ask", "version": "1", "stages": [{"name": "work"}, {"name": "store"}]}
    assert api.post("/v1/flows", json=flow).status_code == 201
    job = api.post("/v1/jobs", json={"flow_id": "ask", "source": {"type": "sequence", "count": 1}})
    job_id = job.json()["job_id"]
    env = api.post(f"/v1/jobs/{job_id}/lease", json={}).json()
    body = {"lease_token": env["lease_token"], "status": "waiting_human", "prompt": {"q": "ship it?"}}
    first = api.post(f"/v1/jobs/{job_id}/batches/0/complete", json=body)
    assert first.status_code == 200 and first.json()["status"] == "waiting_human"
    again = api.post(f"/v1/jobs/{job_id}/batches/0/complete", json=body)
    assert again.json()["approval_id"] == first.json()["approval_id"] and again.json()["duplicate"]
    view = api.get(f"/v1/approvals/{first.json()['approval_id']}").json()
    assert view["kind"] == "platform" and view["prompt"] == {"q": "ship it?"}
    assert api.post(f"/v1/approvals/{view['id']}", json={"decision": "approve",
                                                        "output": {"a": "yes"}}).status_code == 200
    nxt = api.post(f"/v1/jobs/{job_id}/lease", json={}).json()
    assert nxt["stage"] == "store" and nxt["input"] == {"a": "yes"}
