"""Push mode against a REAL n8n: batchgate drives the example workflows in examples/platforms/n8n/.

Runs against whichever n8n answers at ``BATCHGATE_TEST_N8N_URL`` (default http://127.0.0.1:5678); tested
with 1.82.3 and 2.41.1 (docs/n8n-notes.md has the results). Needs both example workflows imported and
active; skipped when n8n is not reachable (CI has none) or the webhooks are not registered. Setup, once
(examples/platforms/n8n/README.md has the install):

    n8n import:workflow --input=examples/platforms/n8n/resume-screening-score.json
    n8n import:workflow --input=examples/platforms/n8n/resume-screening-store.json
    n8n publish:workflow --id=bgScore0000000001    # 2.x; 1.x: n8n update:workflow --id=... --active=true
    n8n publish:workflow --id=bgStore0000000001
    mkdir -p /tmp/batchgate-store
    N8N_RESTRICT_FILE_ACCESS_TO=/tmp/batchgate-store n8n start   # (re)start so the activation takes effect

The job is examples/platforms/n8n/flow.yaml over 40 inline resumes: the score stage goes to the
callback-mode webhook (n8n answers "Workflow was started" and its HTTP Request node POSTs the answer to the
signed callback URL, so n8n must reach this test's API on 127.0.0.1), the store stage to the sync webhook,
which writes one file per Idempotency-Key under /tmp/batchgate-store and answers the contract. It runs
twice: items inline, and every batch by ``items_url`` (the Code node GETs the items from batchgate).
RQ workers run as real processes.

With ``BATCHGATE_TEST_N8N_API_KEY`` (an n8n API key with workflow create/read/delete/activate/deactivate and
execution read scopes) one more test creates a probe workflow through the public API and checks the
connector's classes against the real answers: a deleted execution (the workflow saves no successful
executions), "Error in workflow", a webhook that is not registered, a webhook of another method.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
import yaml

from connectors import get_connector
from connectors.base import PlatformError, Retry, Running
from gateway.app import create_app
from gateway.dispatch import Dispatcher
from gateway.ledger import Ledger
from gateway.supervisor import Supervisor
from tests.conftest import TOKEN
from tests.connectors.helpers import call
from tests.http import ApiClient, serve_app

pytestmark = pytest.mark.n8n

N8N_URL = os.environ.get("BATCHGATE_TEST_N8N_URL", "http://127.0.0.1:5678").rstrip("/")
WEBHOOKS = {"score": "batchgate-score", "store": "batchgate-store"}
FLOW_FILE = Path(__file__).resolve().parents[1] / "examples" / "platforms" / "n8n" / "flow.yaml"
STORE_DIR = Path("/tmp/batchgate-store")  # where the store workflow's Read/Write Files node writes
PROFILE = {"title": "data engineer", "skills": ["python", "sql", "airflow", "spark", "dbt"]}
SKILLS = ["python", "sql", "airflow", "spark", "dbt", "kafka", "go", "react", "k8s", "terraform"]
RETRY = {"initial_interval": 0.5, "maximum_interval": 5, "maximum_attempts": 5}
N8N_API_KEY = os.environ.get("BATCHGATE_TEST_N8N_API_KEY", "")
PROBE_PATH = "batchgate-test-probe"
PROBE_WORKFLOW = {  # answers its execution id (or fails on params.fail) and saves no successful execution
    "name": "batchgate test: probe (created and deleted by tests/test_n8n_real.py)",
    "nodes": [
        {"id": "b9a0c1d2-0000-4000-8000-000000000001", "name": "Webhook", "type": "n8n-nodes-base.webhook",
         "typeVersion": 2, "position": [0, 0], "webhookId": "b9a0c1d2-0000-4000-8000-0000000000a1",
         "parameters": {"httpMethod": "POST", "path": PROBE_PATH, "responseMode": "lastNode",
                        "responseData": "firstEntryJson", "options": {}}},
        {"id": "b9a0c1d2-0000-4000-8000-000000000002", "name": "Answer", "type": "n8n-nodes-base.code",
         "typeVersion": 2, "position": [240, 0],
         "parameters": {"mode": "runOnceForAllItems", "language": "javaScript",
                        "jsCode": "const env = $('Webhook').first().json.body || {};\n"
                                  "if (env.params && env.params.fail) { throw new Error('probe failure'); }\n"
                                  "return [{ json: { executionId: $execution.id } }];\n"}},
    ],
    "connections": {"Webhook": {"main": [[{"node": "Answer", "type": "main", "index": 0}]]}},
    "settings": {"executionOrder": "v1", "saveDataSuccessExecution": "none", "saveDataErrorExecution": "all"},
}


def expected_score(resume: dict) -> int:
    """What the example's Code node computes (examples/platforms/n8n/resume-screening-score.json)."""
    wanted = {s.lower() for s in PROFILE["skills"]}
    overlap = len({s.lower() for s in resume["skills"]} & wanted)
    # JavaScript's Math.round: halves round up
    skill_part = int(70 * overlap / len(wanted) + 0.5) if wanted else 0
    return min(100, skill_part + min(int(resume["years"]), 10) * 3)


def make_resumes(count: int) -> list[dict]:
    rng = random.Random(11)
    return [{"id": f"r{i:04d}", "name": f"Candidate {i}", "years": rng.randint(0, 15),
             "skills": rng.sample(SKILLS, rng.randint(2, 6))} for i in range(count)]


@pytest.fixture(scope="module")
def n8n() -> str:
    """The n8n base URL, or skip: n8n absent, or the example workflows not imported and active."""
    try:
        requests.get(f"{N8N_URL}/healthz", timeout=3).raise_for_status()
    except requests.RequestException as exc:
        pytest.skip(f"no n8n reachable at {N8N_URL} ({type(exc).__name__}); set BATCHGATE_TEST_N8N_URL "
                    f"or start one (examples/platforms/n8n/README.md)")
    for path in WEBHOOKS.values():
        # A GET to a POST-only webhook answers 404 "... Did you mean to make a POST request?" when the
        # workflow is active, and 404 "... is not registered" when it is not: a probe without side effects.
        resp = requests.get(f"{N8N_URL}/webhook/{path}", timeout=5)
        if "make a POST request" not in resp.text:
            pytest.skip(f"n8n at {N8N_URL} has no active webhook POST /webhook/{path}: import and activate "
                        f"examples/platforms/n8n/*.json, then restart n8n "
                        f"({resp.status_code} {resp.text[:120]})")
    return N8N_URL


def n8n_flow(base: str, resumes: list[dict]) -> dict:
    """examples/platforms/n8n/flow.yaml, pointed at ``base``, over this test's resumes, retrying sooner."""
    text = FLOW_FILE.read_text().replace("http://127.0.0.1:5678", base)
    flow = yaml.safe_load(text)
    flow.update({"id": "n8n-real", "batching": {"max_items": 5},
                 "source": {"type": "inline", "items": resumes}})
    for stage in flow["stages"]:
        stage["retry"] = RETRY
    assert [s["target"]["url"] for s in flow["stages"]] == [f"{base}/webhook/{p}" for p in WEBHOOKS.values()]
    return flow


@pytest.mark.parametrize("by_reference", [False, True], ids=["items-inline", "items-url"])
def test_push_job_runs_end_to_end_on_real_n8n(n8n, settings, redis_client, tmp_path, by_reference):
    local_n8n = urlsplit(n8n).hostname in ("127.0.0.1", "localhost")
    if local_n8n:
        STORE_DIR.mkdir(parents=True, exist_ok=True)  # the Read/Write Files node does not create folders
    resumes = make_resumes(40)
    data = tmp_path / "data"
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"], "data_dir": data,
                                      "supervisor_interval": timedelta(milliseconds=200)})
    if by_reference:  # every batch is "big": envelopes carry items_url, which the score Code node GETs
        own = own.model_copy(update={"inline_max_bytes": 64})
    holder: dict = {}
    blob_gets: list[str] = []

    def app(environ, start_response):  # late-bound: public_url needs the listening port
        if environ.get("PATH_INFO", "").startswith("/v1/blobs/"):
            blob_gets.append(environ["PATH_INFO"])
        return holder["app"](environ, start_response)

    base, stop_api = serve_app(app)  # 127.0.0.1: the callback URLs n8n posts to
    own = own.model_copy(update={"public_url": base})
    holder["app"] = create_app(own, redis_client)
    env = {**os.environ, "BATCHGATE_REDIS_URL": own.redis_url.get_secret_value(),
           "BATCHGATE_SIGNING_KEY": own.signing_secret().decode(), "BATCHGATE_PUBLIC_URL": base,
           "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]', "BATCHGATE_LOG_LEVEL": "WARNING",
           "BATCHGATE_DATA_DIR": str(data), "BATCHGATE_INLINE_MAX_BYTES": str(own.inline_max_bytes)}
    ledger = Ledger(redis_client, own)
    sup = Supervisor(ledger, name="n8n-real", dispatcher=Dispatcher.build(own, ledger))
    threading.Thread(target=sup.run, daemon=True).start()
    logs = [(tmp_path / f"worker{i}.log").open("w") for i in range(2)]
    workers = [subprocess.Popen([sys.executable, "-m", "gateway.cli", "worker"], env=env,
                                start_new_session=True, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    job_id = None
    try:
        api = ApiClient(base, TOKEN)
        resp = api.post("/v1/flows", json=n8n_flow(n8n, resumes))
        assert resp.status_code == 201, resp.text
        resp = api.post("/v1/jobs", json={"flow_id": "n8n-real", "params": {"profile": PROFILE}})
        assert resp.status_code == 201, resp.text
        job_id = resp.json()["job_id"]
        deadline = time.monotonic() + 120
        while (job := api.get(f"/v1/jobs/{job_id}").json())["status"] == "running":
            assert time.monotonic() < deadline, f"job did not finish: {job}"
            time.sleep(0.2)
        log = api.get(f"/v1/jobs/{job_id}/log", params={"limit": 10_000}).json()
        assert job["status"] == "succeeded", (job, log, worker_logs(tmp_path))
        assert job["items_done"] == len(resumes)

        batches = api.get(f"/v1/jobs/{job_id}/batches", params={"limit": 1000}).json()["batches"]
        assert len(batches) == len(resumes) // 5
        scores: dict[str, int] = {}
        for summary in batches:
            detail = api.get(f"/v1/jobs/{job_id}/batches/{summary['seq']}").json()
            score_out, store_out = (detail["stages"][name]["output"] for name in ("score", "store"))
            scores.update(score_out["scores"])
            assert store_out["stored"] == len(score_out["scores"]) == 5, detail
            assert store_out["idempotency_key"] == f"{job_id}:{summary['seq']}:store"
        # every resume scored once, by the n8n Code node's formula
        assert scores == {r["id"]: expected_score(r) for r in resumes}

        # by reference, the score workflow fetched each batch's items from batchgate (store needs none)
        assert (len(blob_gets) >= len(batches)) if by_reference else not blob_gets
        callbacks = [e for e in log["entries"] if e.get("event") == "callback_received"]
        assert len(callbacks) >= len(batches)  # the score answers came back through n8n's HTTP Request node

        if local_n8n:  # the store workflow wrote one record per batch, named by its Idempotency-Key
            files = sorted(STORE_DIR.glob(f"{job_id}_*_store.json"))
            assert len(files) == len(batches)
            stored = {}
            for path in files:
                record = json.loads(path.read_text())
                assert path.name == record["idempotency_key"].replace(":", "_") + ".json"
                stored.update(record["scores"])
            assert stored == scores
    finally:
        for proc in workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker and its RQ work-horse
                proc.wait()
        for fh in logs:
            fh.close()
        sup.stop.set()
        stop_api()
        if local_n8n and job_id:
            for path in STORE_DIR.glob(f"{job_id}_*_store.json"):
                path.unlink(missing_ok=True)


def worker_logs(folder: Path) -> str:
    return "\n".join(p.read_text()[-2000:] for p in sorted(folder.glob("worker*.log")))



def wait_registered(url: str, registered: bool = True, within_s: float = 15) -> float:
    """Seconds until the POST webhook at ``url`` is (un)registered, probed by a GET, which runs nothing.

    An activation or deactivation through the API takes effect a moment after n8n answers it.
    """
    started = time.monotonic()
    while ("make a POST request" in requests.get(url, timeout=5).text) is not registered:
        assert time.monotonic() - started < within_s, f"{url} registered={not registered} after {within_s} s"
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.fixture
def probe(n8n):
    """The probe workflow, created and activated through n8n's public API, deleted afterwards."""
    if not N8N_API_KEY:
        pytest.skip("set BATCHGATE_TEST_N8N_API_KEY (an n8n API key) to check the failure classes on real "
                    "n8n")
    api = requests.Session()
    api.headers["X-N8N-API-KEY"] = N8N_API_KEY
    resp = api.post(f"{n8n}/api/v1/workflows", json=PROBE_WORKFLOW, timeout=10)
    assert resp.status_code == 200, resp.text
    workflow_id = resp.json()["id"]
    try:
        resp = api.post(f"{n8n}/api/v1/workflows/{workflow_id}/activate", timeout=10)
        assert resp.status_code == 200, resp.text
        wait_registered(f"{n8n}/webhook/{PROBE_PATH}")
        yield api, workflow_id
    finally:
        api.post(f"{n8n}/api/v1/workflows/{workflow_id}/deactivate", timeout=10)
        api.delete(f"{n8n}/api/v1/workflows/{workflow_id}", timeout=10)


def test_failure_classes_on_real_n8n(n8n, probe):
    """The connector's classes against real answers (docs/n8n-notes.md)."""
    api, workflow_id = probe
    connector, session = get_connector("n8n"), requests.Session()

    def stage(fail: bool = False, **target):
        return call({"type": "n8n", "url": f"{n8n}/webhook/{PROBE_PATH}", "api_url": n8n,
                     "api_key_secret": "N8N_KEY", **target}, {"api_key_secret": N8N_API_KEY}, timeout_s=15,
                    params={"fail": "yes"} if fail else {})

    def error_of(fn) -> PlatformError:
        with pytest.raises(PlatformError) as info:
            fn()
        return info.value

    # a sync answer with an execution id is polled; the instance deleted the successful execution
    out = connector.trigger(stage(), session)
    assert isinstance(out, Running), out
    deadline = time.monotonic() + 10
    while True:  # n8n deletes the execution once it has finished
        try:
            polled = connector.poll(stage(), out.handle, session)
        except PlatformError as exc:
            err = exc
            break
        assert isinstance(polled, Running) and time.monotonic() < deadline, polled
        time.sleep(0.2)
    assert err.retry is Retry.UNKNOWN and err.status == 404, err.message
    assert err.message.startswith(f"n8n deleted execution {out.handle['execution_id']}: save successful "
                                  f"executions for polled flows"), err.message

    # the workflow ran and failed
    err = error_of(lambda: connector.trigger(stage(fail=True), session))
    assert err.retry is Retry.IF_IDEMPOTENT and err.status == 500 and "Error in workflow" in err.message

    # a webhook of another method
    err = error_of(lambda: connector.trigger(stage(method="PUT"), session))
    assert err.retry is Retry.FATAL and not err.outage and "listens for POST" in err.message, err.message

    # not active any more: not registered, an outage with the activation advice
    resp = api.post(f"{n8n}/api/v1/workflows/{workflow_id}/deactivate", timeout=10)
    assert resp.status_code == 200, resp.text
    wait_registered(f"{n8n}/webhook/{PROBE_PATH}", registered=False)
    err = error_of(lambda: connector.trigger(stage(), session))
    assert err.retry is Retry.RETRYABLE and err.outage and err.status == 404, err.message
    assert err.message.startswith(f"n8n has no active webhook at {n8n}/webhook/{PROBE_PATH}: "
                                  f"activate/publish the workflow"), err.message


def test_score_callback_outlives_a_restart_of_batchgate(n8n):
    """The score workflow's HTTP Request node retries its callback (5 tries, 5 s apart): a callback posted
    while batchgate restarts (nothing listening for 12 s) still arrives, so the batch is not paid twice.
    With n8n's default wait (1 s) or the former 2 s, all 5 tries end within 8 s and the callback is lost."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    with socket.socket() as sock:  # a port nothing listens on yet: batchgate is "restarting"
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    received: list[tuple[float, dict]] = []

    class Receiver(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append((time.monotonic(), json.loads(body)))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    envelope = {"job_id": "job_restart", "seq": 0, "stage": "score", "attempt": 1,
                "idempotency_key": "job_restart:0:score", "cursor": None, "items_url": None, "input": None,
                "items": [{"id": "r1", "years": 12, "skills": ["python", "sql"]}],
                "params": {"profile": PROFILE}, "callback_url": f"http://127.0.0.1:{port}/v1/callbacks/t"}
    started = time.monotonic()
    resp = requests.post(f"{n8n}/webhook/{WEBHOOKS['score']}", json=envelope, timeout=10)
    assert resp.status_code == 200 and resp.json() == {"message": "Workflow was started"}, resp.text
    time.sleep(12)  # the first tries (at 0, 5 and 10 s) find nothing listening
    assert not received
    server = ThreadingHTTPServer(("127.0.0.1", port), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        deadline = time.monotonic() + 20
        while not received:
            assert time.monotonic() < deadline, "n8n gave up on the callback"
            time.sleep(0.1)
    finally:
        server.shutdown()
        server.server_close()
    at, body = received[0]
    assert body == {"status": "succeeded", "output": {"scores": {"r1": expected_score(envelope["items"][0])}}}
    assert 12 <= at - started <= 22 and len(received) == 1
