"""The README's "Running it" walk-through, run as written against a live `batchgate up`.

The two bash blocks under "Running it" are taken from README.md and run by bash in order, from the
repository's folder, with three differences only: `.venv/bin/` is this test's interpreter's folder,
and the data dir, the port and the user's state folder are the test's own (BATCHGATE_DATA_DIR,
BATCHGATE_PORT, XDG_STATE_HOME: settings the README documents), so nothing lands in the checkout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from gateway.ledger.embedded import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Running it"):]
    section = section[:section.index("\n## ", 5)]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def test_the_walk_through_runs_as_written(tmp_path):
    found = [b for b in blocks() if "docker compose" not in b]  # compose: tests/test_compose.py
    assert len(found) == 2 and "batchgate up &" in found[0]
    bindir = Path(sys.executable).parent
    script = "set -euo pipefail\n" + "\n".join(found).replace(".venv/bin/", f"{bindir}/") + """
echo "JOB_ID=$JOB_ID"
echo "JOB2=$JOB2"
kill %1
wait %1 || true
"""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGATE_")}
    env.update(BATCHGATE_DATA_DIR=str(tmp_path / "data"), BATCHGATE_PORT=str(port),
               XDG_STATE_HOME=str(tmp_path / "state"), BATCHGATE_LOG_LEVEL="WARNING",
               BATCHGATE_SUPERVISOR_INTERVAL="0.2")
    run = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    out, err = run.stdout, run.stderr
    assert run.returncode == 0, f"exit {run.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    ids = dict(line.split("=", 1) for line in out.splitlines() if line.startswith(("JOB_ID=", "JOB2=")))
    job, job2 = ids["JOB_ID"], ids["JOB2"]
    assert job.startswith("job_") and job2.startswith("job_") and job != job2
    assert "flow resume-screening@1" in out
    assert f"{job}  running" in out  # jobs list, before the worker
    assert "30 items" in err and "succeeded" in err and "100%" in err  # the bar followed the CSV to its end
    assert out.count("completed  stage") == 3  # jobs batches: 30 resumes in batches of 10
    assert "stage_completed" in out and "job_created" in out
    cancelled = [json.loads(m) for m in re.findall(r"^\{.*?^\}", out, re.S | re.M)]
    assert any(v.get("cancel", {}).get("cancelled") for v in cancelled)
    assert any(v.get("job_id") == job and v.get("status") == "running" for v in cancelled)  # the rewind
    results = list((tmp_path / "data" / "resume-screening" / "results").glob("*.json"))
    assert len(results) == 3  # the worker stored every batch's scores
    with pytest.raises(requests.ConnectionError):  # `kill %1` stopped up and everything it started
        requests.get(f"http://127.0.0.1:{port}/livez", timeout=2)
