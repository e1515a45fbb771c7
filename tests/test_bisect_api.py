"""Bisection over HTTP: a pull worker's fatal ``fail`` splits the batch, the next leases hand out the
halves (``item_indices``), the quarantine is listed and retried through the API and the CLI."""

from __future__ import annotations

import json

import pytest

from gateway.runtime.cli import main
from tests.conftest import TOKEN

FLOW = {"id": "pull-bisect", "version": "1", "batching": {"max_items": 8}, "tolerated_failure_percentage": 50,
        "source": {"type": "sequence", "count": 8}, "stages": [{"name": "score", "on_fatal": "bisect"}]}


def work(api, job_id: str, poison: set[int]) -> list[dict]:
    """A pull worker: fails (fatal) every lease holding a poison item, completes the others."""
    seen = []
    while (res := api.post(f"/v1/jobs/{job_id}/lease")).status_code == 200:
        lease = res.json()
        seen.append(lease)
        bad = [i for i in lease["items"] if i in poison]
        path = f"/v1/jobs/{job_id}/batches/{lease['seq']}"
        if bad:
            body = {"lease_token": lease["lease_token"],
                    "error": {"message": f"item {bad[0]} has no text", "retryable": False}}
            assert api.post(f"{path}/fail", json=body).status_code == 200
        else:
            body = {"lease_token": lease["lease_token"], "output": {"n": len(lease["items"])}}
            assert api.post(f"{path}/complete", json=body).status_code == 200
    return seen


@pytest.fixture
def cli(api, monkeypatch, capsys):
    monkeypatch.setenv("BATCHGATE_TOKEN", TOKEN)

    def run(*argv: str) -> tuple[int, str]:
        code = main([*argv[:2], "--url", api.base, *argv[2:]])
        return code, capsys.readouterr().out

    return run


def test_pull_halves_then_quarantine_listed_and_retried(api, cli):
    assert api.post("/v1/flows", json=FLOW).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "pull-bisect"}).json()["job_id"]
    seen = work(api, job_id, {5})
    assert [lease["items"] for lease in seen] == [
        list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], [4, 5], [4], [5], [6, 7]]
    assert seen[0].get("item_indices") is None and seen[2]["item_indices"] == [4, 5, 6, 7]
    assert seen[2]["idempotency_key"] == seen[0]["idempotency_key"] + ":b4-8"
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["items_done"] == 7 and job["items_quarantined"] == 1
    batch = api.get(f"/v1/jobs/{job_id}/batches/0").json()
    assert batch["status"] == "completed" and batch["quarantined_items"] == [5]
    assert [p["items"] for p in batch["stages"]["score"]["output"]["parts"]] == [[0, 1, 2, 3], [4], [6, 7]]

    listing = api.get(f"/v1/jobs/{job_id}/quarantine").json()
    assert listing["count"] == 1 and listing["items"][0] | {"quarantined_ms": 0} == {
        "id": "0.5", "seq": 0, "index": 5, "item": 5, "stage": "score", "error": "item 5 has no text",
        "error_type": None, "quarantined_ms": 0}
    code, out = cli("jobs", "quarantine", job_id)
    assert code == 0 and out.split() == ["0.5", "stage", "score", "item", "5", "has", "no", "text"]

    assert api.post(f"/v1/jobs/{job_id}/quarantine/retry", json={"items": ["nope"]}).status_code == 422
    code, out = cli("jobs", "retry-quarantined", job_id, "0.5")
    assert code == 0 and json.loads(out)["quarantine_retry"]["retried"] == 1
    assert [lease["items"] for lease in work(api, job_id, set())] == [[5]]
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["items_done"] == 8 and job["items_quarantined"] == 0
    assert api.get(f"/v1/jobs/{job_id}/quarantine").json() == {"job_id": job_id, "count": 0, "items": []}
    retried = api.post(f"/v1/jobs/{job_id}/quarantine/retry").json()["quarantine_retry"]
    assert retried == {"retried": 0, "busy_batches": [], "job_status": None}


def test_quarantine_of_an_unknown_job_is_404(api):
    assert api.get("/v1/jobs/job_0190c0ffee01a2b3c4d5e6/quarantine").status_code == 404
    assert api.post("/v1/jobs/job_0190c0ffee01a2b3c4d5e6/quarantine/retry", json={}).status_code == 404


def test_the_console_lists_quarantined_items_and_retries_one(api):
    from tests.test_console import csrf_of, signed_in

    assert api.post("/v1/flows", json=FLOW).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "pull-bisect"}).json()["job_id"]
    work(api, job_id, {2, 6})
    http = signed_in(api.base)
    page = http.get(f"{api.base}/console/jobs/{job_id}", timeout=10)
    assert page.status_code == 200 and "Quarantined items" in page.text and "(2 quarantined)" in page.text
    assert "0.2" in page.text and "item 6 has no text" in page.text
    resp = http.post(f"{api.base}/console/jobs/{job_id}/retry-quarantined",
                     data={"csrf": csrf_of(page.text), "item": "0.6"}, timeout=10)
    assert resp.status_code == 200 and "Quarantined items running again." in resp.text
    assert [lease["items"] for lease in work(api, job_id, {2})] == [[6]]
    assert [q["id"] for q in api.get(f"/v1/jobs/{job_id}/quarantine").json()["items"]] == ["0.2"]


def test_lease_next_hands_out_the_next_piece_in_the_same_step(api):
    assert api.post("/v1/flows", json=FLOW).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "pull-bisect"}).json()["job_id"]
    lease = api.post(f"/v1/jobs/{job_id}/lease").json()
    body = {"lease_token": lease["lease_token"], "error": {"message": "item 0 is bad", "retryable": False}}
    assert api.post(f"/v1/jobs/{job_id}/batches/0/fail", json=body).json()["outcome"] == "split"
    lease = api.post(f"/v1/jobs/{job_id}/lease").json()
    assert lease["item_indices"] == [0, 1, 2, 3]
    done = api.post(f"/v1/jobs/{job_id}/batches/0/complete",
                    json={"lease_token": lease["lease_token"], "output": {}, "lease_next": True}).json()
    assert done["next"]["seq"] == 0 and done["next"]["item_indices"] == [4, 5, 6, 7]
    assert done["next"]["items"] == [4, 5, 6, 7]
