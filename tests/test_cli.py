"""The CLI against a live gateway: flows apply from YAML, jobs list/show/pause/resume, progress bar."""

from __future__ import annotations

import io

import pytest

from gateway.client import Client
from gateway.runtime.cli import main
from gateway.runtime.cli_client import watch_job
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
    final = watch_job(Client(api.base, TOKEN), job_id, interval_s=0.01, stream=stream)
    assert final["status"] == "succeeded"
    assert "100%" in stream.getvalue() and "10/10" in stream.getvalue()


# -- issue 17: a CLI that fits -------------------------------------------------------------------------

def test_version_and_help_of_every_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("batchgate ")
    for argv in (["--help"], ["jobs", "--help"], ["flows", "--help"], ["worker", "--help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "Usage: batchgate" in out and "Traceback" not in out
        if argv[0] == "jobs":
            assert all(a in out for a in ("create", "list", "log", "audit", "batches", "cancel", "migrate"))
        if argv[0] == "flows":
            assert all(a in out for a in ("apply", "list", "show"))
        if argv[0] == "worker":
            assert "16" in out  # the real default concurrency
    assert main(["completion", "bash"]) == 0 and "_BATCHGATE_COMPLETE" in capsys.readouterr().out


def test_create_with_params_and_source_from_files_then_watch_to_the_end(cli, api, tmp_path):
    api.post("/v1/flows", json={"id": "c", "version": "1", "batching": {"max_items": 2},
                                "stages": [{"name": "s"}], "source": {"type": "sequence", "count": 4}})
    (tmp_path / "params.yaml").write_text("role: data engineer\n")
    code, out, err = cli("jobs", "create", "--flow", "c@1", "--params", f"@{tmp_path / 'params.yaml'}",
                         "--source", '{"type": "inline", "items": [1, 2, 3]}', "--idempotency-key", "k1")
    assert code == 0, err
    job_id = out.strip()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["params"] == {"role": "data engineer"} and job["items_total"] == 3
    assert cli("jobs", "create", "--flow", "c@1", "--params", f"@{tmp_path / 'params.yaml'}",
               "--source", '{"type": "inline", "items": [1, 2, 3]}', "--idempotency-key", "k1")[1].strip() == job_id
    code, _, err = cli("jobs", "create", "--flow", "c", "--params", "{not json")
    assert code == 2 and "--params" in err and "Traceback" not in err
    # a job's own result sink; one the tenant may not write is the API's 422, said plainly
    code, out, err = cli("jobs", "create", "--flow", "c", "--sink", '{"type": "discard"}')
    assert code == 0, err
    assert api.get(f"/v1/jobs/{out.strip()}").json()["sink"]["type"] == "discard"
    code, _, err = cli("jobs", "create", "--flow", "c", "--sink", '{"type": "s3", "bucket": "results"}')
    assert code != 0 and "BATCHGATE_SINK_S3_BUCKETS" in err and "Traceback" not in err
    while (r := api.post(f"/v1/jobs/{job_id}/lease")).status_code == 200:
        api.post(f"/v1/jobs/{job_id}/batches/{r.json()['seq']}/complete",
                 json={"lease_token": r.json()["lease_token"], "output": {}})
    code, out, err = cli("jobs", "show", job_id, "--watch")
    assert code == 0 and "3/3" in err and "succeeded" in err
    code, out, _ = cli("jobs", "log", job_id)
    assert code == 0 and "stage_completed" in out and "planned" in out
    code, out, _ = cli("jobs", "batches", job_id)
    assert code == 0 and out.count("completed") == 2
    code, out, _ = cli("jobs", "audit", job_id)
    assert code == 0 and "job_created" in out and "T" in out.split()[0]  # a timestamp per entry
    code, out, _ = cli("flows", "list")
    assert code == 0 and "c@1" in out
    code, out, _ = cli("flows", "show", "c@1")
    assert code == 0 and '"id": "c"' in out


def test_problems_print_their_detail_and_every_error(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("id: x\nversion: '1'\nstages: [{name: a}, {name: a, lease: -1}]\n")
    code, _, err = cli("flows", "apply", "-f", str(bad))
    assert code == 1 and "422" in err and "  - " in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if ln.startswith("  - ")]) >= 1


def test_empty_list_says_so_and_cancel_takes_a_reason(cli, api):
    code, out, err = cli("jobs", "list", "--status", "failed")
    assert code == 0 and out == "" and "no jobs" in err
    api.post("/v1/flows", json={"id": "r", "version": "1", "stages": [{"name": "s"}],
                                "source": {"type": "sequence", "count": 3}})
    job_id = api.post("/v1/jobs", json={"flow_id": "r"}).json()["job_id"]
    assert cli("jobs", "cancel", job_id, "--reason", "wrong file")[0] == 0
    audit = api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]
    assert any(e["event"] == "job_cancelled" and e.get("reason") == "wrong file" for e in audit)


def test_http_commands_need_no_server_settings_and_find_the_running_up(api, monkeypatch, tmp_path, capsys):
    """A flat BATCHGATE_SECRETS stops the servers, not `jobs list`; the dev token of the `up` running
    here is found from another folder through the record `up` leaves."""
    import json
    import os

    monkeypatch.setenv("BATCHGATE_SECRETS", '{"flat": "value-123456"}')  # refused by Settings
    monkeypatch.delenv("BATCHGATE_TOKEN", raising=False)
    monkeypatch.delenv("BATCHGATE_URL", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    data = tmp_path / "elsewhere" / ".batchgate"
    data.mkdir(parents=True)
    (data / "dev-token").write_text(TOKEN)
    (data / "up.json").write_text(json.dumps({"url": api.base, "pid": os.getpid(),
                                              "token_file": str(data / "dev-token")}))
    (tmp_path / "state" / "batchgate").mkdir(parents=True)
    (tmp_path / "state" / "batchgate" / "last-up.json").write_text(json.dumps({"data_dir": str(data)}))
    monkeypatch.chdir(tmp_path)
    assert main(["jobs", "list"]) == 0, capsys.readouterr().err
    assert "no jobs" in capsys.readouterr().err
    assert main(["supervisor"]) == 2 and "invalid settings" in capsys.readouterr().err
    (data / "up.json").write_text(json.dumps({"url": api.base, "pid": 999_999_999,
                                              "token_file": str(data / "dev-token")}))  # that up is gone
    monkeypatch.setenv("BATCHGATE_URL", api.base)
    assert main(["jobs", "list"]) == 1
    err = capsys.readouterr().err
    assert "401" in err and "BATCHGATE_TOKEN" in err


def test_piping_into_head_is_not_an_error(api, tmp_path):
    import subprocess
    import sys

    api.post("/v1/flows", json={"id": "p", "version": "1", "stages": [{"name": "s"}],
                                "source": {"type": "sequence", "count": 3}})
    job_id = api.post("/v1/jobs", json={"flow_id": "p"}).json()["job_id"]
    env = {"BATCHGATE_TOKEN": TOKEN, "BATCHGATE_URL": api.base, "PATH": "/usr/bin:/bin"}
    run = subprocess.run(f"{sys.executable} -m gateway.runtime.cli jobs show {job_id} | head -1", shell=True,
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "{" and "Traceback" not in run.stderr and "BrokenPipe" not in run.stderr


def test_docs_cli_md_shows_every_commands_help_as_it_is():
    """docs/cli.md is generated (scripts/cli_docs.py); a changed command must regenerate it."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("cli_docs", root / "scripts" / "cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (root / "docs" / "cli.md").read_text() == module.render(), "run: python scripts/cli_docs.py"


def test_approvals_from_the_command_line(cli, api):
    """A batch waits at an approval stage; `approvals list/show/approve/reject` decide it (issue 16/17)."""
    api.post("/v1/flows", json={"id": "ap", "version": "1", "batching": {"max_items": 2},
                                "source": {"type": "sequence", "count": 4}, "tolerated_failure_percentage": 50,
                                "stages": [{"name": "score"}, {"name": "review", "approval": {"timeout": 3600}},
                                           {"name": "store"}]})
    job_id = api.post("/v1/jobs", json={"flow_id": "ap"}).json()["job_id"]
    for _ in range(2):
        lease = api.post(f"/v1/jobs/{job_id}/lease").json()
        api.post(f"/v1/jobs/{job_id}/batches/{lease['seq']}/complete",
                 json={"lease_token": lease["lease_token"], "output": {"score": lease["seq"]}})
    code, out, _ = cli("approvals", "list")
    ids = [line.split()[0] for line in out.splitlines()]
    assert code == 0 and len(ids) == 2 and all(job_id in line for line in out.splitlines())
    code, out, _ = cli("approvals", "show", ids[0])
    assert code == 0 and '"status": "pending"' in out
    code, out, _ = cli("approvals", "approve", ids[0], "--comment", "fine", "--output", '{"score": 99}')
    assert code == 0 and '"status": "approved"' in out
    code, out, err = cli("approvals", "reject", ids[0])  # a decision never changes
    assert code == 1 and "409" in err
    assert cli("approvals", "reject", ids[1], "--comment", "no")[0] == 0
    code, out, err = cli("approvals", "list")
    assert out == "" and "no pending approvals" in err
    lease = api.post(f"/v1/jobs/{job_id}/lease").json()  # the approved batch goes on, with the edit
    assert lease["stage"] == "store" and lease["input"] == {"score": 99}
