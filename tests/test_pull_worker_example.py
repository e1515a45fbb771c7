"""examples/resume_screening/worker.py, the pull loop the README's pull demo runs: it pays one request
per step (complete with lease_next) and still stores every resume once through a SIGKILL."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.conftest import TOKEN

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "resume_screening"
sys.path.insert(0, str(EXAMPLE))

from worker import Worker  # noqa: E402


def test_the_worker_leases_once_and_then_each_commit_leases_the_next(api, tmp_path, monkeypatch):
    monkeypatch.setattr("worker.SECONDS_PER_RESUME", 0)
    flow = yaml.safe_load((EXAMPLE / "flow.yaml").read_text())
    assert api.post("/v1/flows", json=flow).status_code == 201
    resumes = [{"id": f"r{i}", "skills": ["python", "sql"], "years": i % 12} for i in range(60)]
    job_id = api.post("/v1/jobs", json={"flow_id": flow["id"], "source": {"type": "inline", "items": resumes},
                                        "params": {"profile": {"skills": ["python"]}}}).json()["job_id"]
    (tmp_path / "results").mkdir()
    worker = Worker(api.base, TOKEN, job_id, tmp_path)
    sent: Counter = Counter()
    post = worker.post

    def counted(path: str, body: dict | None = None):
        kind = "lease" if path == "/lease" else path.rsplit("/", 1)[-1]
        sent[kind, bool(body and body.get("lease_next"))] += 1
        return post(path, body)

    worker.post = counted
    done = threading.Thread(target=worker.loop)
    done.start()
    done.join(timeout=60)
    assert not done.is_alive()
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "succeeded" and view["items_done"] == 60
    steps = 2 * 6  # 6 batches, 2 stages each
    assert sent["complete", True] == steps  # every commit asked for the next batch
    # a plain lease only to start and when a commit leased nothing (the last), not once per step
    assert sent["lease", False] <= 3, sent
    stored = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert len(stored) == 6


@pytest.mark.slow
def test_the_pull_demo_stores_every_resume_once_through_a_sigkill(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE / "demo.py"), "--mode", "pull", "--resumes", "200",
                           "--work-dir", str(tmp_path / "demo")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("[ok]") == 5, done.stdout[-3000:]
