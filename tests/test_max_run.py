"""A stage's ``max_run``: an attempt's total run time across heartbeats and polls (schedule-to-close).

The clock starts at the lease (pull stage) or at the platform call (push stage, begin.lua's called_ms).
A heartbeat never extends the lease past start + max_run; one at or after it fails the attempt in the
same script with error type ``max_run`` (retried only for an idempotent stage) and the ledger raises
RunTooLong (409). A lease capped at max_run that then runs out is expired with the same message.
Real redis-server, real clock; the API over a real socket.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest

from gateway.errors import InvalidRequest, RunTooLong, StaleLease
from gateway.ledger.flows import DEFAULT_MAX_RUN, parse_flow
from gateway.ledger.records import intact

RETRY = {"initial_interval": 0.05, "maximum_interval": 0.05, "maximum_attempts": 3}


def stage(idempotent=False, lease=0.2, max_run=0.6, **extra):
    return {"name": "work", "lease": lease, "max_run": max_run, "idempotent": idempotent, "retry": RETRY,
            **extra}


def events(ledger, job_id, name):
    return [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).log) if f["event"] == name]


def heartbeat_until_refused(ledger, job_id, lease, every=0.05, limit=5.0):
    """A pull worker stuck on its batch: heartbeats forever (until the ledger refuses).

    Returns (the RunTooLong raised, the deadlines the heartbeats got, the seconds since the lease)."""
    started = time.time()
    deadlines = []
    while time.time() - started < limit:
        try:
            res = ledger.heartbeat(job_id, lease.seq, lease.lease_token, {"at": time.time()})
        except RunTooLong as exc:
            return exc, deadlines, time.time() - started
        deadlines.append(res["lease_deadline"])
        time.sleep(every)
    raise AssertionError("heartbeats kept the lease alive past max_run")


def test_pull_worker_heartbeating_forever_fails_at_max_run_when_not_idempotent(ledger, jobs, make_job):
    # every 0.05 s a heartbeat: those from 0.3 s on get the cap (0.6 s) rather than now + the lease
    job_id = make_job(items=list(range(3)), max_items=3, stage_defs=[stage(idempotent=False, lease=0.3)])
    lease = ledger.lease(job_id)
    leased_ms = int(ledger.batch_record(job_id, lease.seq)["leased_ms"])
    exc, deadlines, elapsed = heartbeat_until_refused(ledger, job_id, lease)
    assert 0.55 <= elapsed < 3.0
    # no heartbeat ever moved the deadline past lease time + max_run
    cap = leased_ms + 600
    batch = ledger.batch_record(job_id, lease.seq)
    assert int(batch["capped_ms"]) == cap
    assert all(_ms(d) <= cap for d in deadlines) and _ms(deadlines[-1]) == cap
    assert exc.status == 409 and exc.type_slug == "run-too-long"
    assert exc.extra == {"outcome": "failed", "attempt": 1, "max_run_s": 0.6, "error_type": "max_run"}
    assert "max_run (0.6 s)" in exc.detail
    # the attempt failed for good (not idempotent), with the error type in the batch and the log
    assert intact(batch)
    assert (batch["status"], batch["error"], batch["error_type"]) == ("failed", "ran past max_run (0.6 s)",
                                                                      "max_run")
    failed = events(ledger, job_id, "batch_failed")
    assert [(f["error"], f["error_type"], f["retryable"]) for f in failed] == [
        ("ran past max_run (0.6 s)", "max_run", "0")]
    view = jobs.view("acme", job_id)
    assert view["status"] == "failed" and view["batches"]["failed"] == 1  # budget 0 %: the job fails
    assert jobs.batch("acme", job_id, lease.seq)["error"] == "ran past max_run (0.6 s)"
    # the stuck worker's late answer is refused
    with pytest.raises(StaleLease):
        ledger.complete(job_id, lease.seq, lease.lease_token, {"late": True})
    with pytest.raises(StaleLease):
        ledger.heartbeat(job_id, lease.seq, lease.lease_token)


def test_pull_worker_heartbeating_forever_is_retried_when_idempotent(ledger, make_job):
    job_id = make_job(items=list(range(3)), max_items=3, stage_defs=[stage(idempotent=True)])
    lease = ledger.lease(job_id)
    exc, _, _ = heartbeat_until_refused(ledger, job_id, lease)
    assert exc.extra["outcome"] == "retry"
    batch = ledger.batch_record(job_id, lease.seq)
    assert (batch["status"], batch["error_type"]) == ("pending", "max_run")
    [retry] = events(ledger, job_id, "retry_scheduled")
    assert (retry["error_type"], retry["retryable"]) == ("max_run", "1")
    time.sleep(0.1)  # backoff
    second = ledger.lease(job_id)
    assert (second.seq, second.attempt) == (lease.seq, 2)
    # the second attempt has its own clock: a heartbeat now extends it again
    res = ledger.heartbeat(job_id, second.seq, second.lease_token)
    assert res["job_status"] == "running"
    ledger.complete(job_id, second.seq, second.lease_token, {"ok": 1})
    batch = ledger.batch_record(job_id, second.seq)
    assert batch["status"] == "completed" and intact(batch)


def test_a_later_plain_failure_clears_the_max_run_error_type(ledger, make_job):
    job_id = make_job(items=list(range(3)), max_items=3, stage_defs=[stage(idempotent=True)])
    lease = ledger.lease(job_id)
    heartbeat_until_refused(ledger, job_id, lease)
    time.sleep(0.1)
    second = ledger.lease(job_id)
    ledger.fail(job_id, second.seq, second.lease_token, "boom")
    batch = ledger.batch_record(job_id, second.seq)
    assert (batch["error"], batch["error_type"]) == ("boom", "")


def test_max_run_in_non_retryable_error_types_fails_even_an_idempotent_stage(ledger, make_job):
    job_id = make_job(items=list(range(3)), max_items=3, stage_defs=[stage(
        idempotent=True, retry={**RETRY, "non_retryable_error_types": ["max_run"]})])
    lease = ledger.lease(job_id)
    exc, _, _ = heartbeat_until_refused(ledger, job_id, lease)
    assert exc.extra["outcome"] == "failed"


@pytest.mark.parametrize("idempotent, outcome", [(False, "failed"), (True, "retry")])
def test_a_lease_capped_at_max_run_that_runs_out_expires_as_max_run(ledger, make_job, idempotent, outcome):
    """The worker heartbeats into the cap, then goes silent: the supervisor's expiry names max_run."""
    job_id = make_job(items=list(range(3)), max_items=3,
                      stage_defs=[stage(idempotent=idempotent, lease=1.0, max_run=1.5)])
    lease = ledger.lease(job_id)
    time.sleep(0.8)
    res = ledger.heartbeat(job_id, lease.seq, lease.lease_token)  # wants +1 s, gets the cap
    batch = ledger.batch_record(job_id, lease.seq)
    assert _ms(res["lease_deadline"]) == int(batch["capped_ms"]) == int(batch["leased_ms"]) + 1500
    assert ledger.expire_due(job_id) == []
    time.sleep(max(0.0, (int(batch["capped_ms"]) + 50) / 1000 - time.time()))
    assert ledger.expire_due(job_id) == [(lease.seq, outcome)]
    batch = ledger.batch_record(job_id, lease.seq)
    assert (batch["error"], batch["error_type"]) == ("ran past max_run (1.5 s)", "max_run")
    [entry] = events(ledger, job_id, "retry_scheduled" if outcome == "retry" else "batch_failed")
    assert entry["error_type"] == "max_run" and entry["actor"] == "supervisor"


def test_a_plain_lease_expiry_is_no_max_run(ledger, make_job):
    """Not capped (a silent worker whose lease ran out well before max_run): plain 'lease expired',
    retried whatever the stage's idempotency."""
    job_id = make_job(items=list(range(3)), max_items=3, stage_defs=[stage(lease=0.1, max_run=5)])
    lease = ledger.lease(job_id)
    time.sleep(0.15)
    assert ledger.expire_due(job_id) == [(lease.seq, "retry")]
    batch = ledger.batch_record(job_id, lease.seq)
    assert batch["error"] == "lease expired" and "error_type" not in batch


def test_a_heartbeat_on_a_held_job_past_max_run_changes_nothing_but_the_cap(ledger, make_job):
    """Held (record-only recovery): nothing changes by itself; the lease stays at its cap, and once
    released, expiry ends the attempt as a max_run."""
    job_id = make_job(items=list(range(3)), max_items=3, stage_defs=[stage(lease=0.2, max_run=0.3)])
    lease = ledger.lease(job_id)
    ledger.hold(job_id, "test", "looking")
    time.sleep(0.35)
    res = ledger.heartbeat(job_id, lease.seq, lease.lease_token)
    batch = ledger.batch_record(job_id, lease.seq)
    assert res["job_status"] == "held" and batch["status"] == "leased"
    assert _ms(res["lease_deadline"]) == int(batch["leased_ms"]) + 300
    assert ledger.expire_due(job_id) == []  # held: expires nothing
    ledger.release(job_id, "test")
    assert ledger.expire_due(job_id) == [(lease.seq, "failed")]
    assert ledger.batch_record(job_id, lease.seq)["error_type"] == "max_run"


def test_push_stage_max_run_clock_starts_at_the_call(ledger, make_job):
    """Before begin.lua records the call, heartbeats (waiting for a target slot) are not capped; from
    the call on, the lease never runs past called_ms + max_run."""
    target = {"type": "http", "url": "https://platform.example/run", "mode": "sync"}
    job_id = make_job(items=list(range(3)), max_items=3,
                      stage_defs=[stage(lease=0.5, max_run=1.0, target=target)])
    lease = ledger.lease_stages(job_id, [0])
    k = ledger.keys.job(job_id)
    time.sleep(1.05)  # queued (or waiting for a slot) for longer than max_run: that time does not count
    res = ledger.heartbeat(job_id, lease.seq, lease.lease_token)
    assert "capped_ms" not in ledger.batch_record(job_id, lease.seq)
    begun = ledger.scripts.begin(keys=[k.job, k.batch(lease.seq), k.leases, k.ready(0), k.log],
                                 args=[lease.lease_token, 500, 1000, ""])
    assert begun[0] == "ok"
    called = int(ledger.batch_record(job_id, lease.seq)["called_ms"])
    time.sleep(0.7)
    res = ledger.heartbeat(job_id, lease.seq, lease.lease_token)  # wants +0.5 s, gets the cap
    assert _ms(res["lease_deadline"]) == called + 1000
    time.sleep(0.4)
    with pytest.raises(RunTooLong) as caught:
        ledger.heartbeat(job_id, lease.seq, lease.lease_token)
    assert caught.value.extra["outcome"] == "failed"


def test_api_heartbeat_after_max_run_is_a_409_problem(api, make_job):
    job_id = make_job(items=list(range(3)), max_items=3, stage_defs=[stage(idempotent=False)])
    env = api.post(f"/v1/jobs/{job_id}/lease", json={}).json()
    path = f"/v1/jobs/{job_id}/batches/{env['seq']}/heartbeat"
    assert api.post(path, json={"lease_token": env["lease_token"]}).status_code == 200
    time.sleep(0.65)
    resp = api.post(path, json={"lease_token": env["lease_token"], "progress": {"done": 1}})
    assert resp.status_code == 409
    assert resp.headers["Content-Type"] == "application/problem+json"
    body = resp.json()
    assert body["type"] == "https://batchgate.dev/problems/run-too-long"
    assert body["title"] == "Run exceeded max_run" and body["status"] == 409
    assert (body["outcome"], body["attempt"], body["max_run_s"], body["error_type"]) == (
        "failed", 1, 0.6, "max_run")
    assert "max_run (0.6 s)" in body["detail"]
    # the log the API serves shows the error type; the batch view the error
    entries = api.get(f"/v1/jobs/{job_id}/log").json()
    entries = entries.get("entries", entries) if isinstance(entries, dict) else entries
    failed = [e for e in entries if e["event"] == "batch_failed"]
    assert failed and failed[0]["error_type"] == "max_run" and failed[0]["retryable"] is False
    assert failed[0]["actor"] == "tenant:acme"
    assert api.get(f"/v1/jobs/{job_id}/batches/{env['seq']}").json()["error"] == "ran past max_run (0.6 s)"
    again = api.post(path, json={"lease_token": env["lease_token"]})
    assert again.status_code == 409 and again.json()["type"].endswith("/stale-lease")


def test_flow_max_run_default_bounds_and_stored_form():
    flow = parse_flow({"id": "f", "version": "1", "stages": [{"name": "s"}]})
    assert flow.stages[0].max_run == DEFAULT_MAX_RUN
    # left out of the stored definition at its default: the content hash of a flow that does not
    # name it is what it was before max_run existed (computed with the code of 793a10c)
    dumped = flow.model_dump(mode="json")
    assert "max_run" not in dumped["stages"][0]
    assert flow.content_hash() == "71bbd9970402412e9eacc6cf51ef4a178edd76e2643b79b8e67a568a2ad2fc92"
    named = parse_flow({"id": "f", "version": "1", "stages": [{"name": "s", "max_run": "PT2H"}]})
    assert named.model_dump(mode="json")["stages"][0]["max_run"] == "PT2H"
    assert parse_flow(json.loads(json.dumps(named.model_dump(mode="json")))).stages[0].max_run.seconds == 7200
    for bad in ({"max_run": 5, "lease": 10}, {"max_run": 0}, {"max_run": 31 * 86400}):
        with pytest.raises(InvalidRequest):
            parse_flow({"id": "f", "version": "1", "stages": [{"name": "s", **bad}]})


def test_api_refuses_a_max_run_shorter_than_the_lease(api):
    resp = api.post("/v1/flows", json={"id": "short", "version": "1", "stages": [
        {"name": "s", "lease": 60, "max_run": 30}]})
    assert resp.status_code == 422
    assert "max_run (30 s) must be at least the stage's lease (60 s)" in resp.text


def _ms(iso: str) -> int:
    """A lease_deadline (ISO 8601, UTC, milliseconds) as epoch milliseconds."""
    return round(datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
                 * 1000)
