"""Control actions through the API: cancel is final, pause keeps taking paid answers, held jobs wait
for release, and a lease never answers 204 while work is ready."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from gateway.runtime.cli import main as cli_main
from tests.conftest import TOKEN


def make(api, flow_id="ctl", count=30, max_items=3, concurrency=8, stages=("score",), **extra):
    flow = {"id": flow_id, "version": "1", "batching": {"max_items": max_items},
            "concurrency": concurrency, "stages": [{"name": s} for s in stages],
            "source": {"type": "sequence", "count": count}, **extra}
    assert api.post("/v1/flows", json=flow).status_code == 201
    resp = api.post("/v1/jobs", json={"flow_id": flow_id})
    assert resp.status_code == 201
    return resp.json()["job_id"]


def lease(api, job_id):
    resp = api.post(f"/v1/jobs/{job_id}/lease")
    return resp.json() if resp.status_code == 200 else None


def view(api, job_id):
    return api.get(f"/v1/jobs/{job_id}").json()


def log_events(api, job_id):
    return api.get(f"/v1/jobs/{job_id}/log?limit=10000").json()["entries"]


# -- cancel -------------------------------------------------------------------------------------

def test_cancel_is_final_and_late_answers_change_nothing(api):
    job_id = make(api)
    held = [lease(api, job_id) for _ in range(3)]
    done = held.pop()
    api.post(f"/v1/jobs/{job_id}/batches/{done['seq']}/complete", json={"lease_token": done["lease_token"]})
    resp = api.post(f"/v1/jobs/{job_id}/cancel", json={"reason": "wrong input file"})
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "cancelled" and body["cancel"] == {"cancelled": True, "already": False,
                                                                 "voided_leases": 2}
    before = view(api, job_id)
    assert before["batches"]["leased"] == 0  # every lease voided in the same step

    # every answer for a lease handed out before the cancel: 409 "job cancelled", nothing changes
    first = held[0]
    base = f"/v1/jobs/{job_id}/batches/{first['seq']}"
    answers = [
        api.post(f"{base}/heartbeat", json={"lease_token": first["lease_token"]}),
        api.post(f"{base}/complete", json={"lease_token": first["lease_token"], "output": {"x": 1}}),
        api.post(f"{base}/fail", json={"lease_token": first["lease_token"],
                                       "error": {"message": "late", "retryable": True}}),
    ]
    for resp in answers:
        assert resp.status_code == 409, resp.text
        assert resp.headers["Content-Type"] == "application/problem+json"
        assert resp.json()["title"] == "Job cancelled" and resp.json()["job_status"] == "cancelled"
    # the duplicate of an answer committed before the cancel still gets its first answer back
    dup = api.post(f"/v1/jobs/{job_id}/batches/{done['seq']}/complete",
                   json={"lease_token": done["lease_token"]})
    assert dup.status_code == 200 and dup.json()["duplicate"] is True
    after = view(api, job_id)
    assert {k: after[k] for k in ("status", "batches", "items_done", "committed_cursor")} == \
        {k: before[k] for k in ("status", "batches", "items_done", "committed_cursor")}
    late = [e for e in log_events(api, job_id) if e["event"] == "late_answer"]
    assert [(e["seq"], e["answer"]) for e in late] == [(first["seq"], "completed"), (first["seq"], "failed")]

    # no resume, no retry-failed, no resume by cursor; a second cancel is an idempotent 200
    for path, body in (("resume", {}), ("retry-failed", None),
                       ("resume", {"cursor": {"type": "offset", "offset": 0}})):
        resp = api.post(f"/v1/jobs/{job_id}/{path}", json=body)
        assert resp.status_code == 409, (path, resp.text)
        assert resp.json()["job_status"] == "cancelled" and "cancelled" in resp.json()["detail"]
    again = api.post(f"/v1/jobs/{job_id}/cancel")
    assert again.status_code == 200 and again.json()["cancel"]["already"] is True
    assert lease(api, job_id) is None
    resp = api.post(f"/v1/jobs/{job_id}/lease")
    assert resp.status_code == 204 and resp.headers["Batchgate-Job-Status"] == "cancelled"
    audit = api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]
    assert [e["event"] for e in audit] == ["job_created", "job_cancelled"]
    assert audit[1]["reason"] == "wrong input file" and audit[1]["voided"] == 2


def test_a_succeeded_job_cannot_be_cancelled(api):
    job_id = make(api, count=3)
    got = lease(api, job_id)
    api.post(f"/v1/jobs/{job_id}/batches/{got['seq']}/complete", json={"lease_token": got["lease_token"]})
    assert view(api, job_id)["status"] == "succeeded"
    resp = api.post(f"/v1/jobs/{job_id}/cancel")
    assert resp.status_code == 409 and resp.json()["job_status"] == "succeeded"


# -- pause --------------------------------------------------------------------------------------

def test_pause_takes_answers_in_flight_and_hands_out_nothing_new(api):
    job_id = make(api, count=12)
    a, b = lease(api, job_id), lease(api, job_id)
    assert api.post(f"/v1/jobs/{job_id}/pause").json()["status"] == "paused"
    resp = api.post(f"/v1/jobs/{job_id}/lease")
    assert resp.status_code == 204 and resp.headers["Batchgate-Job-Status"] == "paused"
    hb = api.post(f"/v1/jobs/{job_id}/batches/{a['seq']}/heartbeat",
                  json={"lease_token": a["lease_token"], "extend_s": 30})
    assert hb.status_code == 200 and hb.json()["job_status"] == "paused"  # a loop can see the pause
    ok = api.post(f"/v1/jobs/{job_id}/batches/{a['seq']}/complete", json={"lease_token": a["lease_token"]})
    assert ok.status_code == 200  # paid work in flight is kept
    failed = api.post(f"/v1/jobs/{job_id}/batches/{b['seq']}/fail",
                      json={"lease_token": b["lease_token"], "error": {"message": "x"}})
    assert failed.status_code == 200 and failed.json()["outcome"] == "retry"
    paused = view(api, job_id)
    assert paused["status"] == "paused" and paused["batches"]["completed"] == 1
    assert api.post(f"/v1/jobs/{job_id}/resume").json()["status"] == "running"
    assert lease(api, job_id) is not None


# -- held (record-only recovery) -----------------------------------------------------------------

def test_release_lets_a_held_job_run_again_through_the_api_and_the_cli(api, ledger, monkeypatch, capsys):
    job_id = make(api, count=6)
    ledger.hold(job_id, "supervisor (recovery: record)", "found running at start")
    held = view(api, job_id)
    assert held["status"] == "held" and held["held_reason"] == "found running at start"
    resp = api.post(f"/v1/jobs/{job_id}/lease")
    assert resp.status_code == 204 and resp.headers["Batchgate-Job-Status"] == "held"
    monkeypatch.setenv("BATCHGATE_TOKEN", TOKEN)
    assert cli_main(["jobs", "release", "--url", api.base, job_id]) == 0
    assert '"status": "running"' in capsys.readouterr().out
    assert lease(api, job_id) is not None
    again = api.post(f"/v1/jobs/{job_id}/release")
    assert again.status_code == 409 and again.json()["job_status"] == "running"
    assert [e["event"] for e in api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]] == \
        ["job_created", "job_held", "job_released"]


# -- lease never answers "nothing ready" while work is ready ---------------------------------------

def test_concurrent_leasers_never_get_a_spurious_204(api):
    """8 pull loops on a job with plenty left: every lease gets a batch (the lost planning or
    candidate races are retried inside the gateway), until the source runs out."""
    job_id = make(api, count=2000, max_items=2, concurrency=64)
    answers: Counter = Counter()
    seen: list[int] = []
    lock = threading.Lock()

    def loop():
        for _ in range(40):
            resp = api.post(f"/v1/jobs/{job_id}/lease")
            with lock:
                answers[resp.status_code] += 1
            if resp.status_code == 200:
                got = resp.json()
                with lock:
                    seen.append(got["seq"])
                done = api.post(f"/v1/jobs/{job_id}/batches/{got['seq']}/complete",
                                json={"lease_token": got["lease_token"]})
                assert done.status_code == 200

    threads = [threading.Thread(target=loop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == Counter({200: 320})
    assert sorted(seen) == list(range(320))  # each batch leased once, none skipped
    assert view(api, job_id)["batches"]["completed"] == 320


@pytest.mark.parametrize("action", ["pause", "cancel"])
def test_a_control_action_racing_with_leasers_leaves_counters_exact(api, ledger, action):
    job_id = make(api, count=600, max_items=2, concurrency=16)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            resp = api.post(f"/v1/jobs/{job_id}/lease")
            if resp.status_code != 200:
                return
            got = resp.json()
            api.post(f"/v1/jobs/{job_id}/batches/{got['seq']}/complete",
                     json={"lease_token": got["lease_token"]})

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    acted = api.post(f"/v1/jobs/{job_id}/{action}")
    assert acted.status_code == 200, acted.text  # never "changed too fast": a busy job is still cancelled
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    job = ledger.job_fields(job_id)
    batches = [ledger.batch_record(job_id, s) for s in range(int(job["next_seq"]))]
    by_status = Counter(b["status"] for b in batches)
    assert int(job["n_done"]) == by_status["completed"]
    assert int(job["n_open"]) == by_status["pending"] + by_status["leased"]
    assert int(job["items_done"]) == sum(int(b["n_items"]) for b in batches if b["status"] == "completed")
    assert job["status"] == ("paused" if action == "pause" else "cancelled")


def test_progress_after_a_cursor_move_counts_from_the_new_cursor(api):
    job_id = make(api, count=30, max_items=5)
    moved = api.post(f"/v1/jobs/{job_id}/resume", json={"cursor": {"type": "offset", "offset": 20},
                                                         "reason": "skip rows 0-19"}).json()
    assert moved["items_done"] == 0 and moved["progress"] == round(20 / 30, 4)
    while (got := lease(api, job_id)) is not None:
        api.post(f"/v1/jobs/{job_id}/batches/{got['seq']}/complete", json={"lease_token": got["lease_token"]})
    done = view(api, job_id)
    assert done["status"] == "succeeded" and done["items_done"] == 10 and done["progress"] == 1.0
    assert done["batches"] == {"planned": 2, "completed": 2, "failed": 0, "open": 0, "leased": 0}
