"""The approvals API and signed decision links, over a real socket on a real Redis."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

from tests.conftest import OTHER_TOKEN
from tests.test_push_e2e import push_stack

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
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "waiting_human" and job["batches"]["waiting_human"] == 3
    listed = api.get("/v1/jobs?status=waiting_human").json()["jobs"]
    assert [j["job_id"] for j in listed] == [job_id]  # the job index follows the status
    waiting = api.get(f"/v1/jobs/{job_id}/batches?status=waiting_human").json()["batches"]
    assert sorted(b["approval_id"] for b in waiting) == sorted(ids)
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
    running = api.get("/v1/jobs?status=running").json()["jobs"]
    assert [j["job_id"] for j in running] == [job_id]
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


def test_an_approval_link_is_the_same_whenever_it_is_made(ledger, monkeypatch):
    """approval.requested carries links made at delivery; a redelivery must carry the same ones (receivers
    compare and dedupe). The token's expiry is the deadline plus grace, not now plus what is left of it,
    which rounded to another second between two deliveries for a deadline on a whole second (CI saw a
    redelivered event whose links differed)."""
    from gateway import security
    from gateway.ledger.decisions import links_for

    data = {"approval_id": "apr_1.0.1.1", "deadline_ms": 1_900_000_000_999, "approvers": ["ana", None]}
    made = []
    for start, step in ((1_899_999_000.0, 0.0001), (1_899_999_500.0, 0.002)):  # a fast and a slow machine
        clock = iter(start + n * step for n in range(1000))
        monkeypatch.setattr(security.time, "time", lambda clock=clock: next(clock))
        made.append(links_for(ledger, data, ledger.settings))
    assert made[0] == made[1]


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


class AskingPlatform:
    """A push target whose /ask answers that a person must decide, and whose /store stores."""

    def __init__(self) -> None:
        platform = self
        self.asked, self.stored = [], []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                env = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/ask":
                    platform.asked.append(env["seq"])
                    body = {"status": "waiting_human",
                            "prompt": {"question": f"ship batch {env['seq']}?"}}
                else:
                    platform.stored.append((env["seq"], env["input"]))
                    body = {"status": "succeeded", "output": {"stored": True}}
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_push_stage_answering_waiting_human_opens_an_approval(settings, redis_client, tmp_path):
    platform = AskingPlatform()
    def target(path: str) -> dict:
        return {"type": "http", "url": f"{platform.url}/{path}", "mode": "sync"}

    flow = {"id": "asking", "version": "1", "batching": {"max_items": 2},
            "source": {"type": "sequence", "count": 4},
            "stages": [{"name": "ask", "target": target("ask")},
                       {"name": "store", "target": target("store")}]}
    try:
        with push_stack(settings, redis_client, tmp_path / "data", workers=1) as (api, ledger, _):
            assert api.post("/v1/flows", json=flow).status_code == 201
            job_id = api.post("/v1/jobs", json={"flow_id": "asking"}).json()["job_id"]
            deadline = time.monotonic() + 60
            while len(ids := pending(api)) < 2:
                assert time.monotonic() < deadline, "no approval opened"
                time.sleep(0.1)
            view = api.get(f"/v1/approvals/{ids[0]}").json()
            assert view["kind"] == "platform" and view["prompt"]["question"].startswith("ship batch")
            assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "waiting_human"
            for aid in ids:
                res = api.post(f"/v1/approvals/{aid}", json={"decision": "approve", "output": {"ok": aid}})
                assert res.status_code == 200
            while api.get(f"/v1/jobs/{job_id}").json()["status"] != "succeeded":
                assert time.monotonic() < deadline, "the job did not finish"
                time.sleep(0.1)
    finally:
        platform.close()
    assert sorted(platform.asked) == [0, 1]  # asked once each: a waiting batch is never pushed again
    assert sorted(platform.stored) == sorted((int(a.split(".")[1]), {"ok": a}) for a in ids)
