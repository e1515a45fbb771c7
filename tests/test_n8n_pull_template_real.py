"""Pull mode against a REAL n8n: examples/platforms/n8n/pull-loop.json works a whole job through, and a
SIGKILL of n8n mid-job loses nothing and commits nothing twice.

The test owns its n8n: ``BATCHGATE_TEST_N8N_PULL_START`` is a command that runs n8n in the foreground
(default none: skipped), answering at ``BATCHGATE_TEST_N8N_PULL_URL`` (default http://127.0.0.1:5690, a
port of its own so a developer's n8n on 5678 is left alone), and ``BATCHGATE_TEST_N8N_PULL_API_KEY`` is an
API key of that n8n with credential and workflow scopes. On this machine (n8n 2.41.1, Node 24):

    /work/n8n2/start-pull.sh --setup     # once: owner + API key in /work/n8n2/owner-pull.txt
    BATCHGATE_TEST_N8N_PULL_START=/work/n8n2/start-pull.sh \\
    BATCHGATE_TEST_N8N_PULL_API_KEY=$(sed -n 's/^api_key=//p' /work/n8n2/owner-pull.txt) \\
      .venv/bin/python -m pytest tests/test_n8n_pull_template_real.py

Skipped without those, or when something already answers at the URL (the test must be able to kill it).
What happens: batchgate's API on a real socket (behind a recorder that keeps every request and answer,
and stands in for the template's optional ``results_url`` side effect) and a supervisor thread; the
credential ``batchgate`` and the template (Config node pointed here, nothing else changed) go in through
n8n's public API and the workflow is activated. A 60-item job in batches of 5 with a 5 s lease runs
through it. When the 4th complete arrives the recorder holds it (its batch stays leased, its side effect
already done) and n8n is SIGKILLed; n8n is started again, finds the job, and the batch is leased again
once its lease ran out. At the end the held complete is delivered: stale, 409, nothing changes.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter, defaultdict
from datetime import timedelta
from pathlib import Path

import pytest
import requests
import yaml

from gateway.api.app import create_app
from gateway.ledger.ledger import Ledger
from gateway.push.dispatch import Dispatcher
from gateway.push.supervisor import Supervisor
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app
from tests.n8n_api import public_api

pytestmark = pytest.mark.n8n

N8N_URL = os.environ.get("BATCHGATE_TEST_N8N_PULL_URL", "http://127.0.0.1:5690").rstrip("/")
N8N_START = os.environ.get("BATCHGATE_TEST_N8N_PULL_START", "")
N8N_API_KEY = os.environ.get("BATCHGATE_TEST_N8N_PULL_API_KEY", "")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "platforms" / "n8n"
PROFILE = {"title": "data engineer", "skills": ["python", "sql", "airflow", "spark", "dbt"]}
SKILLS = ["python", "sql", "airflow", "spark", "dbt", "kafka", "go", "react", "k8s", "terraform"]
ITEMS, BATCH, LEASE_S, HOLD_AT = 60, 5, 5, 4
BATCHES = ITEMS // BATCH


def expected_score(resume: dict) -> int:
    """What the template's placeholder node computes (the push examples' stand-in scoring)."""
    wanted = {s.lower() for s in PROFILE["skills"]}
    overlap = len({s.lower() for s in resume["skills"]} & wanted)
    return min(100, int(70 * overlap / len(wanted) + 0.5) + min(int(resume["years"]), 10) * 3)


def make_resumes(count: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"r{i:04d}", "name": f"Candidate {i}", "years": rng.randint(0, 15),
             "skills": rng.sample(SKILLS, rng.randint(2, 6))} for i in range(count)]


class N8n:
    """The n8n this test starts and kills, and its public API."""

    def __init__(self, log_path: Path) -> None:
        self.log_path, self.proc = log_path, None
        self.api = requests.Session()
        self.api.headers["X-N8N-API-KEY"] = N8N_API_KEY

    def start(self, within_s: float = 300) -> float:
        """Start n8n; seconds until its public API answers."""
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(N8N_START, shell=True, start_new_session=True, stdout=log,
                                         stderr=subprocess.STDOUT)
        while True:
            assert self.proc.poll() is None, f"n8n exited ({self.proc.returncode}): {self.log_tail()}"
            assert time.monotonic() - started < within_s, f"n8n not up in {within_s} s: {self.log_tail()}"
            try:
                if self.call("GET", "/workflows", params={"limit": 1}).status_code == 200:
                    return time.monotonic() - started
            except requests.RequestException:
                pass
            time.sleep(0.3)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-1500:]

    def kill(self) -> None:
        """SIGKILL n8n and its task runner: a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        assert port_closed(within_s=10), f"{N8N_URL} still answers after the SIGKILL"

    def call(self, method: str, path: str, **kwargs) -> requests.Response:
        """A public API call (asked again while n8n is still registering its routes: n8n_api)."""
        return public_api(self.api, N8N_URL, method, path, **kwargs)


def port_closed(within_s: float) -> bool:
    """Whether nothing listens at N8N_URL (waiting up to ``within_s`` for it to go)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            requests.get(f"{N8N_URL}/healthz", timeout=1)
        except requests.ConnectionError:
            return True
        except requests.RequestException:
            pass  # a listener that does not answer (a process going away) is still there
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="module")
def n8n(tmp_path_factory):
    if not (N8N_START and N8N_API_KEY):
        pytest.skip("set BATCHGATE_TEST_N8N_PULL_START and BATCHGATE_TEST_N8N_PULL_API_KEY (see this "
                    "module's docstring) to run the pull template on a real n8n")
    if not port_closed(within_s=15):  # an n8n of an earlier run may still be going away
        pytest.skip(f"something already answers at {N8N_URL}: stop it, the test must own (and kill) n8n")
    proc = N8n(tmp_path_factory.mktemp("n8n") / "n8n.log")
    proc.start()
    yield proc
    proc.kill()


class Recorder:
    """batchgate's API behind a recorder: every call and answer, the template's ``results_url``, and
    the hold: the ``hold_at``-th complete is not delivered until ``release`` is set."""

    def __init__(self, hold_at: int | None) -> None:
        self.app = None
        self.calls: list[dict] = []
        self.results: list[tuple[str, dict]] = []  # (Idempotency-Key, body) of every results POST
        self.hold_at, self.completes = hold_at, 0
        self.held: dict | None = None
        self.holding, self.release = threading.Event(), threading.Event()
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        if path == "/results":
            with self.lock:
                self.results.append((environ.get("HTTP_IDEMPOTENCY_KEY", ""), json.loads(body)))
            start_response("200 OK", [("Content-Type", "application/json")])
            return [b"{}"]
        if method == "POST" and path.endswith("/complete"):
            with self.lock:
                self.completes += 1
                hold = self.completes == self.hold_at
            if hold:  # this batch's execution is about to be killed: the complete never gets through
                self.held = {"path": path, "body": body, "at": time.time()}
                self.holding.set()
                self.release.wait(300)
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [b"held"]
        answer: dict = {}

        def recording_start(status, headers, exc_info=None):
            answer["status"] = int(status.split()[0])
            return start_response(status, headers, exc_info)

        out = b"".join(self.app(environ, recording_start))
        with self.lock:
            self.calls.append({"method": method, "path": path, "status": answer["status"], "at": time.time(),
                               "request": json.loads(body) if body else None,
                               "answer": json.loads(out) if out.startswith(b"{") else None})
        return [out]

    def of(self, suffix: str) -> list[dict]:
        with self.lock:
            return [c for c in self.calls if c["method"] == "POST" and c["path"].endswith(suffix)]


@pytest.fixture
def batchgate(settings, redis_client, tmp_path, request):
    """batchgate's API on a socket behind a Recorder, plus a supervisor (it expires leases)."""
    own = settings.model_copy(update={"data_dir": tmp_path / "data",
                                      "supervisor_interval": timedelta(milliseconds=200)})
    recorder = Recorder(getattr(request, "param", None))
    base, stop_api = serve_app(recorder)
    recorder.app = create_app(own.model_copy(update={"public_url": base}), redis_client)
    sup = Supervisor(Ledger(redis_client, own), name="n8n-pull-real",
                     dispatcher=Dispatcher.build(own, Ledger(redis_client, own)))
    threading.Thread(target=sup.run, daemon=True).start()
    yield base, recorder
    recorder.release.set()
    sup.stop.set()
    stop_api()


def template_for(base: str, flow_id: str, credential_id: str, process_prefix: str = "") -> dict:
    """pull-loop.json as a user would set it up: the Config node's values and the credential (and, for
    the failure test, lines put before the placeholder's code)."""
    workflow = json.loads((EXAMPLES / "pull-loop.json").read_text())
    process = next(n for n in workflow["nodes"] if n["name"] == "Process batch (replace me)")
    process["parameters"]["jsCode"] = process_prefix + process["parameters"]["jsCode"]
    config = next(n for n in workflow["nodes"] if n["name"] == "Config")
    values = {"batchgate_url": base, "flow_id": flow_id, "results_url": f"{base}/results"}
    for assignment in config["parameters"]["assignments"]["assignments"]:
        assignment["value"] = values.get(assignment["name"], assignment["value"])
    for node in workflow["nodes"]:
        if "credentials" in node:
            assert node["credentials"] == {"httpHeaderAuth": {"id": "bgPullCredential1", "name": "batchgate"}}
            node["credentials"]["httpHeaderAuth"]["id"] = credential_id
    return {key: workflow[key] for key in ("name", "nodes", "connections", "settings")}


@pytest.fixture
def workflow(n8n, batchgate, request):
    """The credential and the template, created and activated through n8n's public API."""
    base, _ = batchgate
    flow_id = f"n8n-pull-real-{random.randrange(10**6)}"
    header = {"name": "Authorization", "value": f"Bearer {TOKEN}"}
    resp = n8n.call("POST", "/credentials",
                    json={"name": "batchgate", "type": "httpHeaderAuth", "data": header})
    assert resp.status_code == 200, resp.text
    credential_id = resp.json()["id"]
    resp = n8n.call("POST", "/workflows", json=template_for(base, flow_id, credential_id,
                                                            getattr(request, "param", "")))
    assert resp.status_code == 200, resp.text
    workflow_id = resp.json()["id"]
    resp = n8n.call("POST", f"/workflows/{workflow_id}/activate")
    assert resp.status_code == 200 and resp.json()["active"], resp.text
    yield flow_id, workflow_id
    if n8n.proc is not None and n8n.proc.poll() is None:
        n8n.call("POST", f"/workflows/{workflow_id}/deactivate")
        n8n.call("POST", f"/workflows/{workflow_id}/archive")  # 2.x deletes archived workflows only
        n8n.call("DELETE", f"/workflows/{workflow_id}")
        n8n.call("DELETE", f"/credentials/{credential_id}")


def register(api: ApiClient, flow_id: str, **changes) -> None:
    """pull-flow.yaml under the test's flow id, in batches of BATCH, with a LEASE_S lease."""
    flow = yaml.safe_load((EXAMPLES / "pull-flow.yaml").read_text())
    assert flow["stages"][0]["lease"] >= 300  # as shipped: sized for a real loop
    flow.update({"id": flow_id, "batching": {"max_items": BATCH}, **changes})
    flow["stages"][0].update({"lease": LEASE_S, "retry": {"initial_interval": 0.5, "maximum_attempts": 5}})
    assert api.post("/v1/flows", json=flow).status_code == 201


def start_job(api: ApiClient, flow_id: str, resumes: list[dict], **params) -> str:
    resp = api.post("/v1/jobs", json={"flow_id": flow_id, "params": {"profile": PROFILE, **params},
                                      "source": {"type": "inline", "items": resumes}})
    assert resp.status_code == 201, resp.text
    return resp.json()["job_id"]


def leases(recorder: Recorder, seq: int | None = None) -> list[dict]:
    """Every batch the template was leased, in order: a plain lease's answer, or the batch a commit
    leased with it (its answer's ``next``: the template completes with ``lease_next``); each with the
    time it was answered (``at``) and how (``via``)."""
    out = []
    for c in recorder.calls:
        if c["status"] != 200 or not isinstance(c.get("answer"), dict):
            continue
        if c["path"].endswith("/lease"):
            got = c["answer"]
        elif c["path"].endswith("/complete") and c["answer"].get("next"):
            got = c["answer"]["next"]
        else:
            continue
        if seq is None or got["seq"] == seq:
            out.append({**got, "at": c["at"], "via": c["path"].rsplit("/", 1)[-1]})
    return out


def wait_done(api: ApiClient, job_ids: list[str], recorder: Recorder, within_s: float = 300) -> list[dict]:
    deadline = time.monotonic() + within_s
    while True:
        jobs = [api.get(f"/v1/jobs/{job_id}").json() for job_id in job_ids]
        if all(job["status"] != "running" for job in jobs):
            return jobs
        assert time.monotonic() < deadline, (jobs, recorder.calls[-5:])
        time.sleep(0.5)


@pytest.mark.parametrize("batchgate", [HOLD_AT], indirect=True)
def test_pull_template_runs_a_job_through_a_sigkill_of_n8n(n8n, batchgate, workflow):
    base, recorder = batchgate
    flow_id, _ = workflow
    api = ApiClient(base, TOKEN)
    register(api, flow_id)
    resumes = make_resumes(ITEMS)
    job_id = start_job(api, flow_id, resumes)

    # the schedule fires, the loop leases and completes; the HOLD_AT-th complete is held: SIGKILL now
    assert recorder.holding.wait(120), f"no complete held; calls: {recorder.calls[-5:]}"
    held_seq = int(recorder.held["path"].split("/")[-2])
    n8n.kill()
    killed_at = time.time()
    recorder.release.set()
    held_lease = leases(recorder, held_seq)[0]
    assert held_lease["attempt"] == 1
    committed_at_kill = api.get(f"/v1/jobs/{job_id}").json()["batches"].get("completed", 0)
    assert committed_at_kill >= HOLD_AT - 1
    assert api.get(f"/v1/jobs/{job_id}/batches/{held_seq}").json()["status"] == "leased"

    boot_s = n8n.start()
    job, = wait_done(api, [job_id], recorder)
    assert job["status"] == "succeeded", job
    assert job["items_done"] == ITEMS and job["batches"].get("completed") == BATCHES, job

    # the complete the killed execution never got through arrives now: stale, 409, nothing changes
    before = api.get(f"/v1/jobs/{job_id}/batches/{held_seq}").json()
    late = requests.post(base + recorder.held["path"], data=recorder.held["body"], timeout=30,
                         headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert late.status_code == 409, late.text
    assert api.get(f"/v1/jobs/{job_id}/batches/{held_seq}").json() == before
    assert api.get(f"/v1/jobs/{job_id}").json()["items_done"] == ITEMS

    # the held batch went back to the pool when its lease ran out, and the restarted n8n leased it again
    again = leases(recorder, held_seq)
    assert [lease["attempt"] for lease in again] == [1, 2], again
    deadline_1 = held_lease["lease_deadline"]
    assert again[1]["at"] > killed_at
    assert time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(again[1]["at"])) >= deadline_1[:19]
    log = api.get(f"/v1/jobs/{job_id}/log", params={"limit": 10_000}).json()["entries"]
    expiries = [e for e in log if e.get("event") == "retry_scheduled" and e.get("seq") == held_seq]
    assert len(expiries) == 1 and "lease expired" in str(expiries[0].get("error")), expiries

    # every batch committed once: one accepted complete per batch, every score right, none twice
    accepted = Counter(c["path"].split("/")[-2] for c in recorder.of("/complete")
                       if c["status"] == 200 and not c["answer"].get("duplicate"))
    assert sorted(int(seq) for seq in accepted) == list(range(BATCHES)) and set(accepted.values()) == {1}
    scores: dict[str, int] = {}
    for seq in range(BATCHES):
        batch = api.get(f"/v1/jobs/{job_id}/batches/{seq}").json()
        out = batch["stages"]["score"]["output"]["scores"]
        assert not set(out) & set(scores)
        scores.update(out)
    assert scores == {r["id"]: expected_score(r) for r in resumes}

    # the side effect carried the batch's idempotency key: the held batch's ran twice under one key
    by_key: dict[str, list[dict]] = defaultdict(list)
    for key, body in recorder.results:
        assert key == body["idempotency_key"] and key.startswith(f"{job_id}:score:r")
        by_key[key].append(body)
    assert len(by_key) == BATCHES
    held_key = held_lease["idempotency_key"]
    assert again[1]["idempotency_key"] == held_key and len(by_key[held_key]) == 2
    assert all(len(v) == 1 for k, v in by_key.items() if k != held_key)
    # one request a step: most batches came with the commit before them, not from a plain lease
    got = Counter(lease["via"] for lease in leases(recorder))
    assert got["complete"] > got["lease"], got
    print(f"held seq {held_seq} with {committed_at_kill} batches committed; n8n API back {boot_s:.0f} s "
          f"after the restart; batches leased by a commit / by a plain lease: "
          f"{got['complete']} / {got['lease']}")


# Lines put before the placeholder's code: a batch named in params.fail throws, "fatal" always (the
# template reports retryable: false), "flaky" on its first attempt only (retryable: true).
FAILING = """\
const leased = $('Batch').first().json;
const failing = (leased.params.fail || {})[String(leased.seq)];
if (failing === 'fatal') { throw new Error('fatal: resume ' + leased.seq + ' cannot be read'); }
if (failing === 'flaky' && leased.attempt === 1) { throw new Error('model timed out'); }
"""


@pytest.mark.parametrize("workflow", [FAILING], indirect=True)
def test_pull_template_fails_batches_through_the_error_output_and_works_every_job(n8n, batchgate, workflow):
    """The placeholder's error output reaches /fail: an error starting "fatal:" fails the batch for good,
    any other is retried; one execution works through every running job of the flow (204: next job)."""
    base, recorder = batchgate
    flow_id, _ = workflow
    api = ApiClient(base, TOKEN)
    register(api, flow_id, tolerated_failure_percentage=50)
    resumes = make_resumes(20, seed=3)
    failing = start_job(api, flow_id, resumes, fail={"1": "fatal", "2": "flaky"})
    plain = start_job(api, flow_id, make_resumes(20, seed=4))
    first, second = wait_done(api, [failing, plain], recorder, within_s=180)
    assert second["status"] == "succeeded" and second["items_done"] == 20, second
    assert first["status"] == "succeeded" and first["items_done"] == 15, first  # within its failure budget
    fails = {(c["path"].split("/")[-2], c["request"]["error"]["retryable"]): c for c in recorder.of("/fail")
             if failing in c["path"]}
    assert set(fails) == {("1", False), ("2", True)}, fails
    assert all(c["status"] == 200 for c in fails.values())
    assert fails[("1", False)]["request"]["error"]["message"].startswith("fatal: resume 1 cannot be read")
    assert fails[("1", False)]["answer"]["outcome"] == "failed"
    fatal = api.get(f"/v1/jobs/{failing}/batches/1").json()
    assert fatal["status"] == "failed" and fatal["attempt"] == 1, fatal
    assert "fatal: resume 1" in fatal["error"], fatal
    flaky = api.get(f"/v1/jobs/{failing}/batches/2").json()
    assert flaky["status"] == "completed" and flaky["attempt"] == 2, flaky
    expected = {r["id"]: expected_score(r) for r in resumes[10:15]}
    assert flaky["stages"]["score"]["output"]["scores"] == expected
