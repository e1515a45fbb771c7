"""The CLI against a live gateway: flows apply from YAML, jobs list/show/pause/resume, progress bar."""

from __future__ import annotations

import io

import pytest

from gateway.runtime.cli import main
from gateway.runtime.cli_client import Client, watch
from tests.conftest import TOKEN

FLOW_YAML = """
id: cli-flow
version: "1"
batching: {max_items: 5}
stages:
  - name: score
source: {type: sequence, count: 12}
"""


@pytest.fixture
def cli(api, monkeypatch, capsys):
    monkeypatch.setenv("BATCHGATE_TOKEN", TOKEN)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main([*argv[:2], "--url", api.base, *argv[2:]])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_flows_apply_from_yaml_then_jobs_commands(cli, api, tmp_path):
    path = tmp_path / "flow.yaml"
    path.write_text(FLOW_YAML)
    code, out, _ = cli("flows", "apply", "-f", str(path))
    assert code == 0 and "cli-flow@1" in out
    job_id = api.post("/v1/jobs", json={"flow_id": "cli-flow"}).json()["job_id"]
    code, out, _ = cli("jobs", "list")
    assert code == 0 and job_id in out and "running" in out
    assert cli("jobs", "pause", job_id)[0] == 0
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "paused"
    assert cli("jobs", "resume", job_id)[0] == 0
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "running"


def test_cli_reports_problems_without_a_traceback(cli, tmp_path):
    code, _, err = cli("jobs", "show", "job_missing")
    assert code == 1 and "404" in err and "Traceback" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("id: x\nversion: '1'\nstages: []\n")
    code, _, err = cli("flows", "apply", "-f", str(bad))
    assert code == 1 and "422" in err


def test_watch_draws_progress_until_the_job_ends(api):
    api.post("/v1/flows", json={"id": "w", "version": "1", "batching": {"max_items": 5},
                                "stages": [{"name": "s"}], "source": {"type": "sequence", "count": 10}})
    job_id = api.post("/v1/jobs", json={"flow_id": "w"}).json()["job_id"]
    while (r := api.post(f"/v1/jobs/{job_id}/lease")).status_code == 200:
        env = r.json()
        api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
                 json={"lease_token": env["lease_token"], "output": {}})
    stream = io.StringIO()
    final = watch(Client(api.base, TOKEN), job_id, interval_s=0.01, stream=stream)
    assert final["status"] == "succeeded"
    assert "100.0% 10/10 items" in stream.getvalue()
