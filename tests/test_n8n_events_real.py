"""Event webhooks into a REAL n8n: the example workflows in examples/platforms/n8n/ that start on batchgate's
events (``on-job-succeeded.json``, ``on-approval-requested.json``), fed by batchgate's own deliverer.

Needs an n8n at ``BATCHGATE_TEST_N8N_URL`` (default http://127.0.0.1:5678) started with
``NODE_FUNCTION_ALLOW_BUILTIN=crypto`` (the Verify signature node requires it), and
``BATCHGATE_TEST_N8N_API_KEY`` (an n8n API key with workflow create/read/delete/activate/deactivate and
execution read scopes): each test creates its workflow through n8n's public API, so nothing has to be
imported by hand. With ``BATCHGATE_TEST_N8N_START`` (a command running n8n in the foreground) and nothing
answering, this module starts n8n and stops it after. Skipped otherwise (CI has no n8n). Tested with
2.41.1 (docs/n8n-notes.md).

Each test takes a shipped workflow as it is, with two substitutions: the subscription's secret for the
``whsec_REPLACE_WITH_YOUR_SUBSCRIPTION_SECRET`` placeholder, and a webhook path of its own (``-test``
appended), so an imported copy of the example on the same n8n does not clash with it. batchgate runs as in
tests/test_n8n_real.py: the API on a socket and a supervisor thread, whose deliverer posts the events.
The job is a pull-mode job driven through the API by the test (no n8n workflow is needed for the job
itself: the events are the subject here).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests

from gateway.api.app import create_app
from gateway.ledger.events import EVENT_TYPES, new_secret
from gateway.ledger.ledger import Ledger
from gateway.push.supervisor import Supervisor
from gateway.push.webhooks import Deliverer, RetryPolicy, sign
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app
from tests.n8n_api import public_api

pytestmark = pytest.mark.n8n

N8N_URL = os.environ.get("BATCHGATE_TEST_N8N_URL", "http://127.0.0.1:5678").rstrip("/")
N8N_API_KEY = os.environ.get("BATCHGATE_TEST_N8N_API_KEY", "")
N8N_START = os.environ.get("BATCHGATE_TEST_N8N_START", "")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "platforms" / "n8n"
PLACEHOLDER = "whsec_REPLACE_WITH_YOUR_SUBSCRIPTION_SECRET"
OTHER_SECRET = "whsec_" + "QUJD" * 11  # base64 of "ABC" * 11: well formed, and not the subscription's
CRYPTO_HINT = ("; a 500 'Error in workflow' on every delivery: is n8n started with "
               "NODE_FUNCTION_ALLOW_BUILTIN=crypto? (the Verify signature node requires it)")
FAST = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_interval=timedelta(seconds=1))


# -- n8n ---------------------------------------------------------------------------------------------------


def api_answers(session: requests.Session) -> str | None:
    """None when n8n's public API answers with this key, else why not."""
    try:
        resp = session.get(f"{N8N_URL}/api/v1/workflows", params={"limit": 1}, timeout=5)
    except requests.RequestException as exc:
        return f"no answer ({type(exc).__name__})"
    return None if resp.status_code == 200 else f"{resp.status_code} {resp.text[:120]}"


@pytest.fixture(scope="module")
def n8n(tmp_path_factory) -> Iterator[requests.Session]:
    """A session on n8n's public API (base ``N8N_URL``), or skip. Starts n8n with ``BATCHGATE_TEST_N8N_START``
    when nothing answers, and stops it after."""
    if not N8N_API_KEY:
        pytest.skip("set BATCHGATE_TEST_N8N_API_KEY (an n8n API key): the tests create their workflows "
                    "through n8n's public API")
    session = requests.Session()
    session.headers["X-N8N-API-KEY"] = N8N_API_KEY
    proc = None
    try:
        requests.get(f"{N8N_URL}/healthz", timeout=3).raise_for_status()
    except requests.RequestException as exc:
        if not N8N_START:
            pytest.skip(f"no n8n reachable at {N8N_URL} ({type(exc).__name__}); set BATCHGATE_TEST_N8N_URL, "
                        f"BATCHGATE_TEST_N8N_START, or start one (examples/platforms/n8n/README.md)")
        log_path = tmp_path_factory.mktemp("n8n") / "n8n.log"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(N8N_START, shell=True, start_new_session=True, stdout=log,
                                    stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while (why := api_answers(session)) is not None:
        if proc is None and why.startswith("401"):
            pytest.fail(f"n8n at {N8N_URL} refuses BATCHGATE_TEST_N8N_API_KEY: {why}")
        assert proc is None or proc.poll() is None, f"n8n exited ({proc.returncode}); see {log_path}"
        assert time.monotonic() < deadline, f"n8n's public API not answering after 240 s: {why}"
        time.sleep(0.5)
    yield session
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def registered(path: str) -> bool:
    """Whether the POST webhook at ``path`` is registered: a GET runs nothing, and its 404 says which."""
    return "make a POST request" in requests.get(f"{N8N_URL}/webhook/{path}", timeout=5).text


def wait_for(what: str, probe: Callable[[], Any], within_s: float = 30, every_s: float = 0.2) -> Any:
    """The first truthy answer of ``probe``, polled until ``within_s``."""
    deadline = time.monotonic() + within_s
    while not (answer := probe()):
        assert time.monotonic() < deadline, f"{what}: not within {within_s} s"
        time.sleep(every_s)
    return answer


def example_workflow(name: str, secret: str) -> tuple[dict, str]:
    """The shipped workflow, as n8n's public API takes it, with ``secret`` pasted in and a test path; and
    that path."""
    shipped = json.loads((EXAMPLES / name).read_text())[0]
    code = [n for n in shipped["nodes"] if n["name"] == "Verify signature"][0]["parameters"]["jsCode"]
    assert code.count(PLACEHOLDER) == 1, "the example's secret placeholder moved"
    workflow = {k: copy.deepcopy(shipped[k]) for k in ("nodes", "connections", "settings")}
    workflow["name"] = f"{shipped['name']} (created and deleted by tests/test_n8n_events_real.py)"
    for node in workflow["nodes"]:
        if node["name"] == "Verify signature":
            node["parameters"]["jsCode"] = code.replace(PLACEHOLDER, secret)
        if node["type"] == "n8n-nodes-base.webhook":
            node["parameters"]["path"] += "-test"
            path = node["parameters"]["path"]
    return workflow, path


class Workflow:
    """An example workflow created and activated through n8n's public API; ``close`` deactivates, deletes."""

    def __init__(self, api: requests.Session, name: str, secret: str) -> None:
        self.api = api
        body, self.path = example_workflow(name, secret)
        self.url = f"{N8N_URL}/webhook/{self.path}"
        assert not registered(self.path), f"{self.url} is taken: delete the workflow holding it"
        resp = public_api(api, N8N_URL, "POST", "/workflows", json=body)
        assert resp.status_code == 200, resp.text
        self.id = resp.json()["id"]
        try:
            resp = public_api(api, N8N_URL, "POST", f"/workflows/{self.id}/activate")
            assert resp.status_code == 200, resp.text
            wait_for(f"webhook {self.url} registered", lambda: registered(self.path), 15)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.api.post(f"{N8N_URL}/api/v1/workflows/{self.id}/deactivate", timeout=30)
        time.sleep(1)  # the deactivation takes effect a moment after n8n answers it
        self.api.delete(f"{N8N_URL}/api/v1/workflows/{self.id}", timeout=30)

    def executions(self) -> list[dict]:
        """Its finished executions, data included, newest first."""
        resp = self.api.get(f"{N8N_URL}/api/v1/executions", timeout=30,
                            params={"workflowId": self.id, "includeData": "true", "limit": 100})
        assert resp.status_code == 200, resp.text
        return [ex for ex in resp.json()["data"] if ex.get("finished") or ex.get("stoppedAt")]

    def wait_executions(self, count: int, within_s: float = 30) -> list[dict]:
        """Oldest first, once at least ``count`` have finished (n8n saves one when it ends)."""
        def enough() -> list[dict] | None:
            runs = self.executions()
            return runs if len(runs) >= count else None

        found = wait_for(f"{count} executions of {self.path}", enough, within_s, 0.5)
        return sorted(found, key=lambda ex: int(ex["id"]))


def node_items(execution: dict, node: str) -> list[dict] | None:
    """The JSON of the items ``node`` output in ``execution``, or None when it did not run."""
    runs = (((execution.get("data") or {}).get("resultData") or {}).get("runData") or {}).get(node)
    if not runs:
        return None
    main = (runs[0].get("data") or {}).get("main") or [[]]
    return [item["json"] for item in (main[0] or [])]


# -- batchgate ---------------------------------------------------------------------------------------------


class Batchgate:
    """batchgate as in tests/test_n8n_real.py: the API on a socket and a supervisor thread (its deliverer
    posts the events), allowed to call 127.0.0.1."""

    def __init__(self, settings, redis_client) -> None:
        holder: dict = {}
        base, self.stop_api = serve_app(lambda environ, start: holder["app"](environ, start))
        own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"], "public_url": base,
                                          "supervisor_interval": timedelta(milliseconds=200)})
        holder["app"] = create_app(own, redis_client)
        self.ledger = Ledger(redis_client, own)
        self.sup = Supervisor(self.ledger, name="n8n-events-real",
                              deliverer=Deliverer(self.ledger, retry=FAST,
                                                  interval=timedelta(milliseconds=200)))
        self.thread = threading.Thread(target=self.sup.run, daemon=True)
        self.thread.start()
        self.api = ApiClient(base, TOKEN)
        self.subscriptions: list[str] = []

    def close(self) -> None:
        for sub_id in self.subscriptions:
            self.api.delete(f"/v1/subscriptions/{sub_id}")
        self.sup.stop.set()
        self.thread.join(timeout=15)
        self.stop_api()

    def subscribe(self, url: str, events: list[str]) -> dict:
        resp = self.api.post("/v1/subscriptions", json={"url": url, "events": events})
        assert resp.status_code == 201, resp.text
        self.subscriptions.append(resp.json()["id"])
        return resp.json()

    def deliveries(self, sub_id: str) -> list[dict]:
        resp = self.api.get(f"/v1/subscriptions/{sub_id}/deliveries")
        assert resp.status_code == 200, resp.text
        return resp.json()["deliveries"]

    def run_pull_job(self, items: int = 6, max_items: int = 2) -> str:
        """A pull-mode job over a sequence, leased and completed through the API until it succeeds."""
        flow = {"id": "n8n-events", "version": "1", "stages": [{"name": "work"}],
                "batching": {"max_items": max_items}, "source": {"type": "sequence", "count": items}}
        resp = self.api.post("/v1/flows", json=flow)
        assert resp.status_code in (200, 201), resp.text
        resp = self.api.post("/v1/jobs", json={"flow_id": "n8n-events"})
        assert resp.status_code == 201, resp.text
        job_id = resp.json()["job_id"]
        while (resp := self.api.post(f"/v1/jobs/{job_id}/lease")).status_code == 200:
            env = resp.json()
            done = self.api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
                                 json={"lease_token": env["lease_token"], "output": {"n": len(env["items"])}})
            assert done.status_code == 200, done.text
        assert resp.status_code == 204 and resp.headers["Batchgate-Job-Status"] == "succeeded", resp.text
        return job_id


@pytest.fixture
def batchgate(settings, redis_client) -> Iterator[Batchgate]:
    bg = Batchgate(settings, redis_client)
    yield bg
    bg.close()


@pytest.fixture
def workflows(n8n) -> Iterator[Callable[[str, str], Workflow]]:
    """Creates example workflows on n8n; deactivates and deletes them after the test."""
    made: list[Workflow] = []

    def make(name: str, secret: str) -> Workflow:
        made.append(Workflow(n8n, name, secret))
        return made[-1]

    yield make
    for workflow in made:
        workflow.close()


def post_signed(url: str, secret: str, msg_id: str, body: bytes, timestamp_s: int | None = None,
                signature: str | None = None) -> requests.Response:
    """POST ``body`` as batchgate's deliverer would, signed with ``secret`` unless ``signature`` is given."""
    ts = int(time.time()) if timestamp_s is None else timestamp_s
    headers = {"content-type": "application/json", "webhook-id": msg_id, "webhook-timestamp": str(ts),
               "webhook-signature": signature if signature is not None else sign(secret, msg_id, ts, body)}
    return requests.post(url, data=body, headers=headers, timeout=30)


# -- job.succeeded -------------------------------------------------------------------------------------------


def test_job_succeeded_reaches_the_example_workflow_signed_once(batchgate, workflows):
    """A real job's job.succeeded goes through batchgate's deliverer to on-job-succeeded.json on n8n: the
    signature verifies (204 in the deliveries), the Message node names the job; forged, stale and unsigned
    posts get 401; the same event delivered again (same webhook-id) is stopped by the workflow's dedupe."""
    _, path = example_workflow("on-job-succeeded.json", PLACEHOLDER)  # subscribe first: it makes the secret
    sub = batchgate.subscribe(f"{N8N_URL}/webhook/{path}", ["job.succeeded"])
    workflow = workflows("on-job-succeeded.json", sub["secret"])

    job_id = batchgate.run_pull_job(items=6, max_items=2)
    delivered = wait_for("a job.succeeded delivery", lambda: [
        d for d in batchgate.deliveries(sub["id"]) if d["job_id"] == job_id])
    # the first attempt is accepted: the workflow verified batchgate's signature (else 401, and a retry)
    assert [(d["type"], d["attempt"], d["status"], d["ok"]) for d in delivered] == [
        ("job.succeeded", 1, 204, True)], f"{delivered}{CRYPTO_HINT}"
    event_id = delivered[0]["event_id"]

    [first] = workflow.wait_executions(1)
    assert first["status"] == "success", first.get("status")
    [verified] = node_items(first, "Verify signature")
    assert verified["valid"] is True and verified["duplicate"] is False and verified["webhook_id"] == event_id
    event = verified["event"]
    assert event["type"] == "job.succeeded" and event["data"]["job_id"] == job_id
    assert node_items(first, "Message") == [{
        "job_id": job_id, "text": f"batchgate job {job_id} succeeded: 6 items in 3 batches."}]

    # forged: another key, a stale timestamp (a replay of a signature older than 5 minutes), no signature
    body = json.dumps(event).encode()
    assert post_signed(workflow.url, OTHER_SECRET, "forged-1", body).status_code == 401
    stale = int(time.time()) - 600
    assert post_signed(workflow.url, sub["secret"], "forged-2", body, timestamp_s=stale).status_code == 401
    assert post_signed(workflow.url, sub["secret"], "forged-3", body, signature="").status_code == 401
    refused = workflow.wait_executions(4)[1:]
    assert all(node_items(ex, "Refuse (401)") is not None for ex in refused)
    assert all(node_items(ex, "Message") is None for ex in refused)

    # batchgate delivers again what it may not have recorded (a deliverer killed between the answer and
    # its cursor write): rewind this subscription's cursor for the job, the deliverer sends the same event
    keys, r = batchgate.ledger.keys, batchgate.ledger.r
    wait_for("the cursor past the event", lambda: r.hget(keys.sub_cursor(sub["id"]), job_id))
    r.hdel(keys.sub_cursor(sub["id"]), job_id)
    r.sadd(keys.events_pending, job_id)
    def twice() -> list[dict] | None:
        mine = [d for d in batchgate.deliveries(sub["id"]) if d["job_id"] == job_id]
        return mine if len(mine) >= 2 else None

    again, once = wait_for("the second delivery", twice)  # newest first
    assert again["event_id"] == once["event_id"] == event_id
    assert again["status"] == 204 and again["ok"]  # accepted as a duplicate: batchgate moves on
    repeat = workflow.wait_executions(5)[-1]
    [verified] = node_items(repeat, "Verify signature")
    assert verified["valid"] is True and verified["duplicate"] is True and verified["webhook_id"] == event_id
    assert node_items(repeat, "Message") is None  # stopped at "New job.succeeded?": no second message
    # and the workflow still takes the next new event
    assert post_signed(workflow.url, sub["secret"], f"{job_id}:manual-1", body).status_code == 204
    fresh = workflow.wait_executions(6)[-1]
    assert node_items(fresh, "Message") == node_items(first, "Message")


# -- approval.requested ----------------------------------------------------------------------------------

APPROVERS = ["ann@example.com", "bob@example.com"]


def approval_event(job_id: str, links: list[dict]) -> dict:
    """An approval.requested event as on-approval-requested.json reads it: ``data.links`` holds one
    ``{approver, url}`` per approver (``approver`` null for a link anyone may use)."""
    return {"type": "approval.requested", "timestamp": "2026-12-03T08:00:00.000Z",
            "data": {"approval_id": "apr_0123456789abcdef", "job_id": job_id, "tenant": "acme", "seq": 2,
                     "stage": "review", "deadline": "2026-12-04T08:00:00Z", "links": links}}


def assert_messages(execution: dict, event: dict) -> None:
    """The Messages for approvers node made one message per link, each with that link."""
    d = event["data"]
    assert node_items(execution, "Messages for approvers") == [{
        "approval_id": d["approval_id"], "job_id": d["job_id"], "approver": link.get("approver"),
        "link": link["url"], "deadline": d["deadline"],
        "text": f"batchgate needs a decision on batch {d['seq']} of job {d['job_id']} (stage {d['stage']})"
                f" before {d['deadline']}: {link['url']}"} for link in d["links"]]


def test_the_approval_workflow_sends_one_message_per_link(workflows):
    """on-approval-requested.json on real n8n with a delivery signed the way batchgate's deliverer signs
    (gateway.push.webhooks.sign): one message per approver, each with its own link; a repeat of the same
    webhook-id and a forged signature make no message. Runs before batchgate has approval events: the
    contract it checks is the one the workflow is written against."""
    secret = new_secret()
    workflow = workflows("on-approval-requested.json", secret)
    links = [{"approver": a, "url": f"http://127.0.0.1:8080/approve/tok-{i}"}
             for i, a in enumerate(APPROVERS)]
    links.append({"approver": None, "url": "http://127.0.0.1:8080/approve/tok-anyone"})
    event = approval_event("job_0123456789abcdef", links)
    body = json.dumps(event).encode()
    assert post_signed(workflow.url, secret, "job_0123456789abcdef:1-0", body).status_code == 204
    # n8n saves the static data holding the seen ids when an execution ends, after the 204 was answered: a
    # repeat sent before then passes the dedupe (seen on a freshly started n8n), so wait for it to end
    workflow.wait_executions(1)
    assert post_signed(workflow.url, secret, "job_0123456789abcdef:1-0", body).status_code == 204  # a repeat
    assert post_signed(workflow.url, new_secret(), "forged", body).status_code == 401
    first, repeat, forged = workflow.wait_executions(3)
    assert_messages(first, event)
    assert node_items(repeat, "Verify signature")[0]["duplicate"] is True
    assert node_items(repeat, "Messages for approvers") is None
    assert node_items(forged, "Refuse (401)") is not None
    assert node_items(forged, "Messages for approvers") is None


def request_approval(bg: Batchgate, approvers: list[str]) -> str:
    """Start a job whose one batch, once scored, waits at an approval stage for ``approvers``; its job id.

    The flow is as the approvals feature (branch fix/approvals, not on main as this is written) declares
    it: a pull stage, then ``{"approval": {"timeout", "approvers"}}``; committing the pull stage opens the
    approval (complete.lua), which appends approval.requested.
    """
    flow = {"id": "n8n-approval", "version": "1", "batching": {"max_items": 2},
            "source": {"type": "sequence", "count": 2},
            "stages": [{"name": "score"},
                       {"name": "review", "approval": {"timeout": 3600, "approvers": approvers}}]}
    resp = bg.api.post("/v1/flows", json=flow)
    assert resp.status_code in (200, 201), resp.text
    resp = bg.api.post("/v1/jobs", json={"flow_id": "n8n-approval"})
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["job_id"]
    env = bg.api.post(f"/v1/jobs/{job_id}/lease").json()
    done = bg.api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
                       json={"lease_token": env["lease_token"], "output": {"scores": {"0": 90, "1": 40}}})
    assert done.status_code == 200, done.text
    return job_id


@pytest.mark.skipif("approval.requested" not in EVENT_TYPES,
                    reason="batchgate has no approval.requested event yet (not in "
                           "gateway.ledger.events.EVENT_TYPES); the approvals feature adds it")
def test_approval_requested_reaches_the_example_workflow(batchgate, workflows):
    """A real approval's approval.requested goes through batchgate's deliverer to on-approval-requested.json:
    204 in the deliveries, one message per approver with the link batchgate signed for that approver."""
    _, path = example_workflow("on-approval-requested.json", PLACEHOLDER)
    sub = batchgate.subscribe(f"{N8N_URL}/webhook/{path}", ["approval.requested"])
    workflow = workflows("on-approval-requested.json", sub["secret"])
    job_id = request_approval(batchgate, APPROVERS)
    delivered = wait_for("an approval.requested delivery", lambda: [
        d for d in batchgate.deliveries(sub["id"]) if d["job_id"] == job_id])
    assert [(d["type"], d["attempt"], d["status"]) for d in delivered] == [
        ("approval.requested", 1, 204)], f"{delivered}{CRYPTO_HINT}"
    [execution] = workflow.wait_executions(1)
    [verified] = node_items(execution, "Verify signature")
    assert verified["valid"] is True and verified["webhook_id"] == delivered[0]["event_id"]
    event = verified["event"]
    assert event["data"]["job_id"] == job_id
    links = event["data"]["links"]
    assert [link.get("approver") for link in links] == APPROVERS
    assert len({link["url"] for link in links}) == len(APPROVERS)  # a link of its own per approver
    assert all(link["url"].startswith(batchgate.api.base + "/") for link in links)  # to batchgate
    assert event["data"]["seq"] == 0 and event["data"]["stage"] == "review"
    assert_messages(execution, event)
    # the link in an approver's message opens batchgate's decision page (a GET shows; only its form decides)
    page = requests.get(node_items(execution, "Messages for approvers")[0]["link"], timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text[:200]
    forged = post_signed(workflow.url, OTHER_SECRET, "forged", json.dumps(event).encode())
    assert forged.status_code == 401
