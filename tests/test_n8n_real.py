"""Push mode against a REAL n8n: batchgate drives the example workflows in examples/platforms/n8n/.

Needs an n8n (tested with 1.82.3) at http://127.0.0.1:5678 (or ``BATCHGATE_TEST_N8N_URL``) with both
example workflows imported and active; skipped when n8n is not reachable (CI has none) or the webhooks
are not registered. Setup, once (examples/platforms/n8n/README.md has the install):

    npx n8n import:workflow --input=examples/platforms/n8n/resume-screening-score.json
    npx n8n import:workflow --input=examples/platforms/n8n/resume-screening-store.json
    npx n8n update:workflow --id=bgScore0000000001 --active=true
    npx n8n update:workflow --id=bgStore0000000001 --active=true
    mkdir -p /tmp/batchgate-store && npx n8n start      # (re)start so the activation takes effect

The job is examples/platforms/n8n/flow.yaml over 40 inline resumes: the score stage goes to the
callback-mode webhook (n8n answers "Workflow was started" and its HTTP Request node POSTs the answer to the
signed callback URL, so n8n must reach this test's API on 127.0.0.1), the store stage to the sync webhook,
which writes one file per Idempotency-Key under /tmp/batchgate-store and answers the contract. It runs
twice: items inline, and every batch by ``items_url`` (the Code node GETs the items from batchgate).
RQ workers run as real processes.
"""

from __future__ import annotations

import json
import os
import random
import signal
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

from gateway.app import create_app
from gateway.dispatch import Dispatcher
from gateway.ledger import Ledger
from gateway.supervisor import Supervisor
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app

pytestmark = pytest.mark.n8n

N8N_URL = os.environ.get("BATCHGATE_TEST_N8N_URL", "http://127.0.0.1:5678").rstrip("/")
WEBHOOKS = {"score": "batchgate-score", "store": "batchgate-store"}
FLOW_FILE = Path(__file__).resolve().parents[1] / "examples" / "platforms" / "n8n" / "flow.yaml"
STORE_DIR = Path("/tmp/batchgate-store")  # where the store workflow's Read/Write Files node writes
PROFILE = {"title": "data engineer", "skills": ["python", "sql", "airflow", "spark", "dbt"]}
SKILLS = ["python", "sql", "airflow", "spark", "dbt", "kafka", "go", "react", "k8s", "terraform"]
RETRY = {"initial_interval": 0.5, "maximum_interval": 5, "maximum_attempts": 5}


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
                        f"examples/platforms/n8n/*.json, then restart n8n ({resp.status_code} {resp.text[:120]})")
    return N8N_URL


def n8n_flow(base: str, resumes: list[dict]) -> dict:
    """examples/platforms/n8n/flow.yaml, pointed at ``base``, over this test's resumes, retrying sooner."""
    text = FLOW_FILE.read_text().replace("http://127.0.0.1:5678", base)
    flow = yaml.safe_load(text)
    flow.update({"id": "n8n-real", "batching": {"max_items": 5}, "source": {"type": "inline", "items": resumes}})
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

