"""Regressions found by the model-based test (tests/test_ledger_model.py), each as a short hand-written
sequence against the real ledger."""

from __future__ import annotations

import pytest

from gateway.push.supervisor import Supervisor
from tests.conftest import drain


def test_retry_failed_reopens_only_the_failed_batches_of_a_succeeded_job(ledger, jobs, make_job):
    """A job that succeeded with a failed batch its budget tolerated: that batch's items were never
    stored. Issue 15 asked for retry-failed to run them (it was refused, so they were lost for good):
    it re-opens the failed batch only, and the job succeeds again with nothing failed.

    Found earlier: reopen.lua re-opened the failed batch without being asked; now it is asked."""
    job_id = make_job(items=6, max_items=3, stages=("only",), tolerated_failure_percentage=50)
    first = ledger.lease(job_id)
    ledger.fail(job_id, first.seq, first.lease_token, "bad row", retryable=False)
    drain(ledger, job_id)
    view = jobs.view("acme", job_id)
    assert (view["status"], view["batches"]["failed"], view["retryable_failed"]) == ("succeeded", 1, 1)
    k = ledger.keys.job(job_id)
    committed = ledger.r.hgetall(k.batch(1))

    assert ledger.reopen(job_id, "tenant:acme", only_failed=True) == 1
    assert ledger.r.hgetall(k.batch(1)) == committed  # the committed batch is untouched
    again = drain(ledger, job_id)
    assert [(lease.seq, lease.attempt) for lease in again] == [(first.seq, 1)]
    view = jobs.view("acme", job_id)
    assert (view["status"], view["batches"]["failed"], view["items_done"]) == ("succeeded", 0, 6)


def test_retry_failed_on_a_clean_succeeded_job_leaves_its_record_alone(ledger, make_job):
    """With nothing failed, retry-failed on a succeeded job used to answer 'ok, 0' but still rewrite the
    job record (updated_ms): a final job changed. It answers 0 now, and nothing is written."""
    job_id = make_job(items=3, max_items=3, stages=("only",))
    drain(ledger, job_id)
    k = ledger.keys.job(job_id)
    before = ledger.r.hgetall(k.job), ledger.r.xlen(k.audit)
    assert before[0]["status"] == "succeeded"
    assert ledger.reopen(job_id, "tenant:acme", only_failed=True) == 0
    assert (ledger.r.hgetall(k.job), ledger.r.xlen(k.audit)) == before


def test_cancelling_a_held_job_drops_its_held_reason(ledger, jobs, make_job):
    """Found: a job held by record-mode recovery and then cancelled kept its held reason ("... release it
    to go on"), which the view showed beside status cancelled; a release then answered 409."""
    job_id = make_job(items=6, max_items=3)
    ledger.hold(job_id, "supervisor (recovery: record)", "found running at start; release it to go on")
    ledger.cancel(job_id, "tenant:acme")
    view = jobs.view("acme", job_id)
    assert (view["status"], view["held_reason"]) == ("cancelled", None)


def test_a_held_job_that_ends_is_held_no_more(ledger, jobs, make_job):
    """A worker still alive may commit while its job is held; when that commit is the job's last, the
    job succeeds, and must not go on showing the held reason (found by the model-based test)."""
    job_id = make_job(items=3, max_items=3, stages=("only",))
    lease = ledger.lease(job_id)
    ledger.hold(job_id, "supervisor (recovery: record)", "release it to go on")
    ledger.complete(job_id, lease.seq, lease.lease_token, {})
    view = jobs.view("acme", job_id)
    assert (view["status"], view["held_reason"]) == ("succeeded", None)


def test_a_held_job_failed_by_its_budget_is_held_no_more(ledger, jobs, make_job):
    job_id = make_job(items=6, max_items=3, stages=("only",))
    lease = ledger.lease(job_id)
    ledger.hold(job_id, "supervisor (recovery: record)", "release it to go on")
    ledger.fail(job_id, lease.seq, lease.lease_token, "bad row", retryable=False)
    view = jobs.view("acme", job_id)
    assert (view["status"], view["held_reason"]) == ("failed", None)
    assert "budget" in view["error"]


def test_resume_keeps_the_recovery_claim_short_lived(ledger, make_job):
    """Found: resume (persist_job) removed the TTL of every job key, the supervisor's 60 s recovery claim
    too, so after a resume no supervisor could ever recover that job again after a crash."""
    job_id = make_job(items=6, max_items=3)
    ledger.lease(job_id)
    k = ledger.keys.job(job_id)
    assert Supervisor(ledger, name="sup-a").recover()  # claims the job for 60 s
    ledger.reopen(job_id, "tenant:acme")
    assert 0 < ledger.r.pttl(k.recover) <= 60_000


def test_resume_keeps_a_dead_planners_lock_short_lived(ledger, make_job):
    """The same for the plan lock of a planner that died while reading the source: a resume made it
    permanent, and the job never planned a batch again."""
    job_id = make_job(items=6, max_items=3)
    k = ledger.keys.job(job_id)
    ledger.r.set(k.plan_lock, "a planner that died", px=30_000)
    ledger.reopen(job_id, "tenant:acme")
    assert 0 < ledger.r.pttl(k.plan_lock) <= 30_000


def test_retention_does_not_stretch_the_recovery_claim(ledger, make_job):
    """Retiring a finished job gave its recovery claim the retention TTL (7 days by default): a replan
    then left the job unrecoverable for that long."""
    job_id = make_job(items=3, max_items=3, stages=("only",))
    lease = ledger.lease(job_id)
    k = ledger.keys.job(job_id)
    assert Supervisor(ledger, name="sup-a").recover()
    ledger.complete(job_id, lease.seq, lease.lease_token, {})
    Supervisor(ledger, name="sup-a").tick()  # retires the succeeded job: retention TTL on its keys
    assert 0 < ledger.r.pttl(k.job) and ledger.r.pttl(k.recover) <= 60_000
    ledger.replan(job_id, {"type": "offset", "offset": 0}, "tenant:acme", "run it again")
    assert ledger.r.pttl(k.job) == -1 and 0 < ledger.r.pttl(k.recover) <= 60_000


@pytest.mark.parametrize("take_back", [
    lambda ledger, job_id: ledger.reopen(job_id, "tenant:acme"),
    lambda ledger, job_id: ledger.cancel(job_id, "tenant:acme"),
    lambda ledger, job_id: ledger.replan(job_id, {"type": "offset", "offset": 0}, "tenant:acme", "again"),
], ids=["resume", "cancel", "replan"])
def test_a_lease_taken_back_no_longer_shows_its_stage_running(ledger, jobs, make_job, take_back):
    """Found: after resume took a lease back, cancel voided it or a replan superseded its batch, the
    batch view still showed the stage as 'running' (a cancelled job looking busy)."""
    job_id = make_job(items=6, max_items=3)
    lease = ledger.lease(job_id)
    assert jobs.batch("acme", job_id, lease.seq)["stages"]["score"]["status"] == "running"
    take_back(ledger, job_id)
    assert jobs.batch("acme", job_id, lease.seq)["stages"]["score"]["status"] == "pending"
