"""Approval stages in the ledger: opening on commit, deciding, timeouts, platform approvals, the listing.

Every test runs the real Lua scripts on a real redis-server (tests/conftest.py)."""

from __future__ import annotations

import time

import pytest

from gateway.errors import Conflict, Forbidden, InvalidRequest, NotFound, StaleLease
from gateway.ledger.approvals import ApprovalDecided, ApprovalRef
from gateway.ledger.flows import parse_flow
from gateway.push.supervisor import Supervisor


def gated(timeout="PT1H", on_timeout="reject", approvers=None, show=None, last=True):
    approval = {"timeout": timeout, "on_timeout": on_timeout}
    if approvers is not None:
        approval["approvers"] = approvers
    if show is not None:
        approval["show"] = show
    stages = [{"name": "score"}, {"name": "review", "approval": approval}]
    if not last:
        stages.append({"name": "store"})
    return stages


def score_all(ledger, job_id):
    """Lease and commit every batch's first stage; returns the approval ids opened, by seq."""
    opened = {}
    while (lease := ledger.lease(job_id)) is not None:
        assert lease.stage == "score"
        ledger.complete(job_id, lease.seq, lease.lease_token, {"score": lease.seq, "n": len(lease.items)})
        opened[lease.seq] = ledger.batch_record(job_id, lease.seq)["approval"]
    return opened


def status(ledger, job_id):
    return ledger.job_fields(job_id)["status"]


def test_commit_opens_an_approval_and_the_job_waits(ledger, make_job):
    job = make_job(items=6, max_items=3, stage_defs=gated(last=False))
    opened = score_all(ledger, job)
    assert sorted(opened) == [0, 1]
    assert opened[0] == f"{job}.0.1.1"
    batch = ledger.batch_record(job, 0)
    assert batch["status"] == "waiting_human" and batch["stage"] == "1"
    assert ledger.r.zcard(ledger.keys.job(job).leases) == 0  # no lease held
    assert status(ledger, job) == "waiting_human"
    assert ledger.lease(job) is None  # an approval stage is never leased
    with pytest.raises(Conflict):
        ledger.lease(job, "review")
    page, nxt = ledger.approvals.list("acme", "pending")
    assert {a["id"] for a in page} == set(opened.values()) and nxt is None
    view = ledger.approvals.get("acme", opened[0])
    assert view["shown_output"] == {"score": 0, "n": 3}
    assert view["items"]["count"] == 3 and view["decision"] is None
    events = [f["type"] for _, f in ledger.r.xrange(ledger.keys.job(job).events)]
    assert events.count("approval.requested") == 2


def test_approve_commits_and_moves_on_reject_fails_the_batch(ledger, make_job):
    job = make_job(items=6, max_items=3, stage_defs=gated(last=False), tolerated_failure_percentage=50)
    opened = score_all(ledger, job)
    view, fresh = ledger.approvals.decide("acme", opened[0], "approve", "tenant:acme",
                                          output={"edited": True})
    assert fresh and view["status"] == "approved" and view["decision"]["edited_output"]
    assert status(ledger, job) == "running"
    lease = ledger.lease(job)
    assert lease.stage == "store" and lease.seq == 0 and lease.input == {"edited": True}
    ledger.complete(job, 0, lease.lease_token, {"stored": True})
    again, fresh = ledger.approvals.decide("acme", opened[0], "approve", "tenant:acme")
    assert not fresh and again["decision"]["edited_output"]
    with pytest.raises(ApprovalDecided):
        ledger.approvals.decide("acme", opened[0], "reject", "tenant:acme")
    view, _ = ledger.approvals.decide("acme", opened[1], "reject", "tenant:acme", comment="bad")
    assert view["status"] == "rejected"
    batch = ledger.batch_record(job, 1)
    assert batch["status"] == "failed" and batch["error_type"] == "rejected"
    job_fields = ledger.job_fields(job)
    assert job_fields["status"] == "succeeded" and job_fields["n_failed"] == "1"
    types = [f["type"] for _, f in ledger.r.xrange(ledger.keys.job(job).events)]
    assert types.count("approval.decided") == 2 and "batch.failed" in types and "job.succeeded" in types


def test_reject_over_budget_fails_the_job(ledger, make_job):
    job = make_job(items=6, max_items=3, stage_defs=gated())
    opened = score_all(ledger, job)
    ledger.approvals.decide("acme", opened[0], "reject", "tenant:acme")
    assert status(ledger, job) == "failed"
    # a job failed by its budget still takes the other decision (like an answer in flight)
    view, _ = ledger.approvals.decide("acme", opened[1], "approve", "tenant:acme")
    assert view["status"] == "approved"
    assert ledger.batch_record(job, 1)["status"] == "completed"


def test_approvers_and_tenant_walls(ledger, make_job):
    job = make_job(items=3, max_items=3, stage_defs=gated(approvers=["alice", "tenant:acme"]))
    opened = score_all(ledger, job)
    with pytest.raises(Forbidden):
        ledger.approvals.decide("acme", opened[0], "approve", "tenant:acme", approver="mallory")
    with pytest.raises(NotFound):
        ledger.approvals.decide("other", opened[0], "approve", "tenant:other")
    with pytest.raises(NotFound):
        ledger.approvals.get("other", opened[0])
    with pytest.raises(NotFound):
        ledger.approvals.get("acme", "job_nope.0.1.1")
    view, _ = ledger.approvals.decide("acme", opened[0], "approve", "link", approver="alice")
    assert view["decision"]["actor"] == "link"
    assert status(ledger, job) == "succeeded"


@pytest.mark.parametrize("on_timeout,batch_status,job_status", [
    ("reject", "failed", "failed"), ("approve", "completed", "succeeded"), ("fail", "failed", "failed")])
def test_timeouts(ledger, make_job, on_timeout, batch_status, job_status):
    job = make_job(items=3, max_items=3, stage_defs=gated(timeout="PT1S", on_timeout=on_timeout),
                   tolerated_failure_percentage=100 if on_timeout == "fail" else 0)
    opened = score_all(ledger, job)
    supervisor = Supervisor(ledger, name="test")
    supervisor.tick()
    assert ledger.approvals.get("acme", opened[0])["status"] == "pending"  # not due yet
    time.sleep(1.1)
    supervisor.tick()
    supervisor.tick()  # once: a decided approval is not decided again
    assert ledger.approvals.apply_timeouts(job) == []
    events = [f["type"] for _, f in ledger.r.xrange(ledger.keys.job(job).events)]
    assert events.count("approval.decided") == 1
    view = ledger.approvals.get("acme", opened[0])
    assert view["decision"]["actor"] == "supervisor:timeout"
    assert ledger.batch_record(job, 0)["status"] == batch_status
    assert status(ledger, job) == job_status


def test_platform_approval_open_is_idempotent_and_releases_the_lease(ledger, make_job):
    job = make_job(items=3, max_items=3, stages=("score", "store"))
    lease = ledger.lease(job)
    first = ledger.open_platform_approval(job, 0, lease.lease_token, {"question": "ok?"})
    again = ledger.open_platform_approval(job, 0, lease.lease_token, {"question": "ok?"})
    assert again["approval_id"] == first["approval_id"] and again["duplicate"]
    assert ledger.r.zcard(ledger.keys.job(job).leases) == 0
    with pytest.raises(StaleLease):
        ledger.complete(job, 0, lease.lease_token, {})
    view, _ = ledger.approvals.decide("acme", first["approval_id"], "approve", "tenant:acme",
                                      output={"answer": "yes"})
    assert ledger.batch_record(job, 0)["out:0"] == '{"answer":"yes"}'
    nxt = ledger.lease(job)
    assert nxt.stage == "store" and nxt.input == {"answer": "yes"}


def test_resumer_hears_platform_decisions(ledger, make_job):
    heard = []
    ledger.register_resumer(lambda approval, decision: heard.append((approval["id"], decision["decision"])))
    job = make_job(items=3, max_items=3, stages=("score",))
    lease = ledger.lease(job)
    opened = ledger.open_platform_approval(job, 0, lease.lease_token, "go?", platform={"resume_url": "x"})
    ledger.approvals.decide("acme", opened["approval_id"], "approve", "tenant:acme")
    assert heard == [(opened["approval_id"], "approve")]
    batch = ledger.batch_record(job, 0)
    assert batch["status"] == "pending" and batch["stage"] == "0"  # the run goes on: next attempt asks it
    again = ledger.lease(job)
    assert again.seq == 0 and ledger.batch_record(job, 0)["unspent"] == "1"  # the attempt is not spent


def test_retry_failed_reopens_a_rejected_batch_in_a_new_round(ledger, make_job):
    job = make_job(items=3, max_items=3, stage_defs=gated(), tolerated_failure_percentage=0)
    opened = score_all(ledger, job)
    ledger.approvals.decide("acme", opened[0], "reject", "tenant:acme")
    assert status(ledger, job) == "failed"
    ledger.reopen(job, "tenant:acme", only_failed=True)
    assert ledger.approvals.open_ready(job) == [f"{job}.0.1.2"]
    assert ledger.approvals.open_ready(job) == []
    assert ledger.approvals.get("acme", opened[0])["status"] == "rejected"  # never changes
    ledger.approvals.decide("acme", f"{job}.0.1.2", "approve", "tenant:acme")
    assert status(ledger, job) == "succeeded"


def test_listing_pages_with_a_cursor(ledger, make_job):
    job = make_job(items=10, max_items=1, stage_defs=gated())
    opened = score_all(ledger, job)
    seen, cursor = [], None
    while True:
        page, cursor = ledger.approvals.list("acme", "pending", limit=3, cursor=cursor)
        seen += [a["id"] for a in page]
        if cursor is None:
            break
    assert sorted(seen) == sorted(opened.values()) and len(seen) == len(set(seen))
    with pytest.raises(InvalidRequest):
        ledger.approvals.list("acme", "approved", cursor=cursor or "bm90IG91cnM")


def test_bad_specs_name_the_field():
    base = {"id": "f", "version": "1", "source": {"type": "sequence", "count": 1}}
    for stages, words in [
        ([{"name": "a", "approval": {"timeout": "PT1H"}}], "stages[0].approval"),
        ([{"name": "a"}, {"name": "b", "approval": {"timeout": "PT0.5S"}}], "timeout"),
        ([{"name": "a"}, {"name": "b", "approval": {"timeout": "P31D"}}], "timeout"),
        ([{"name": "a"}, {"name": "b", "approval": {"timeout": "PT1H", "show": "c"}}], "show"),
        ([{"name": "a"}, {"name": "b", "approval": {"timeout": "PT1H", "on_timeout": "x"}}], "on_timeout"),
        ([{"name": "a"}, {"name": "b", "approval": {"timeout": "PT1H"}, "target": {"type": "http",
                                                                                  "url": "http://x"}}],
         "approval"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            parse_flow({**base, "stages": stages})
        assert words in str(err.value.problem()), (stages, err.value.problem())


def test_ids_parse():
    assert ApprovalRef.parse("job_abc.3.1.2") == ApprovalRef("job_abc", 3, 1, 2)
    with pytest.raises(NotFound):
        ApprovalRef.parse("job_abc:3")


def test_a_job_with_waiting_batches_is_kept_by_retention(ledger, make_job):
    """Failed by its budget while another batch waits: the supervisor keeps watching it (timeouts still
    apply) and retires it only once nothing waits."""
    job = make_job(items=6, max_items=3, stage_defs=gated(timeout="PT1S", on_timeout="approve"))
    opened = score_all(ledger, job)
    ledger.approvals.decide("acme", opened[0], "reject", "tenant:acme")
    assert status(ledger, job) == "failed"
    supervisor = Supervisor(ledger, name="test")
    supervisor.tick()
    assert ledger.r.sismember(ledger.keys.active, job)
    time.sleep(1.1)
    supervisor.tick()
    assert ledger.approvals.get("acme", opened[1])["status"] == "approved"
    assert ledger.batch_record(job, 1)["status"] == "completed"
    supervisor.tick()
    assert not ledger.r.sismember(ledger.keys.active, job)


def test_cancelled_jobs_leave_the_inbox(ledger, make_job):
    job = make_job(items=3, max_items=3, stage_defs=gated())
    opened = score_all(ledger, job)
    ledger.cancel(job, "tester")
    assert ledger.approvals.list("acme", "pending")[0] == []
    with pytest.raises(Conflict):
        ledger.approvals.decide("acme", opened[0], "approve", "tenant:acme")


# -- the scripts called directly, KEYS and ARGV as their headers say ----------------------------------

def decide_raw(ledger, job_id, approval_id, decision="approve", mode="person", output=""):
    from gateway.ledger.approvals import gates_arg

    ref = ApprovalRef.parse(approval_id)
    spec = ledger.spec(job_id)
    k = ledger.keys.job(job_id)
    ready = [k.ready(i) for i in range(spec.stage_count)]
    gates = sorted(spec.flow.gates())
    return ledger.scripts.decide(
        keys=[k.job, k.batch(ref.seq), k.approval(ref.seq, ref.stage, ref.round), k.approvals,
              k.approvals_due, k.items(ref.seq), k.leases, k.done, k.failed, k.log, *ready,
              *[k.approval(ref.seq, i, 1) for i in gates], k.events],
        args=[decision, "tester", "", output, mode, spec.stage_count, 1000, spec.budget_total,
              spec.flow.tolerated_failure_percentage, gates_arg(spec, 11 + len(ready)), job_id, "acme"])


def test_decide_script_answers_a_retry_with_the_first_decision(ledger, make_job):
    job = make_job(items=6, max_items=3, stage_defs=gated(last=False), tolerated_failure_percentage=100)
    opened = score_all(ledger, job)
    assert decide_raw(ledger, job, opened[0], mode="timeout") == ["not_due"]
    first = decide_raw(ledger, job, opened[0], output='{"x":1}')
    assert first[:3] == ["ok", "approved", "running"]
    again = decide_raw(ledger, job, opened[0], "reject")
    assert again[:3] == ["decided", "approved", "approve"]
    assert ledger.batch_record(job, 0)["out:1"] == '{"x":1}'  # the retry changed nothing
    assert ledger.r.zcard(ledger.keys.job(job).ready(2)) == 1  # moved on once
    events = [f["type"] for _, f in ledger.r.xrange(ledger.keys.job(job).events)]
    assert events.count("approval.decided") == 1
    assert decide_raw(ledger, job, f"{job}.0.1.9") == ["missing"]


def test_a_retried_commit_opens_no_second_approval(ledger, make_job):
    job = make_job(items=3, max_items=3, stage_defs=gated())
    lease = ledger.lease(job)
    first = ledger.complete(job, 0, lease.lease_token, {"s": 1})
    again = ledger.complete(job, 0, lease.lease_token, {"s": 1})
    assert not first["duplicate"] and again["duplicate"]
    k = ledger.keys.job(job)
    assert ledger.r.zrange(k.approvals, 0, -1) == [f"{job}.0.1.1"]
    assert ledger.job_fields(job)["n_waiting"] == "1"
    events = [f["type"] for _, f in ledger.r.xrange(k.events)]
    assert events.count("approval.requested") == 1


def test_open_script_retried_by_the_same_lease_answers_the_first_approval(ledger, make_job):
    job = make_job(items=3, max_items=3, stages=("work",))
    lease = ledger.lease(job)
    k = ledger.keys.job(job)
    gate = '{"t":60000,"o":"reject","a":"","s":"","n":"work"}'

    def open_raw(token, rnd):
        return ledger.scripts.open_approval(
            keys=[k.job, k.batch(0), k.approval(0, 0, rnd), k.approvals, k.approvals_due, k.leases,
                  k.ready(0), k.log, k.events],
            args=["leased", token, rnd, job, "acme", 0, gate, '"ok?"', "", 1000, 0])

    first = open_raw(lease.lease_token, 1)
    assert first[0] == "ok" and first[1] == f"{job}.0.0.1" and first[4] == "0"
    again = open_raw(lease.lease_token, 1)
    assert again[:3] == first[:3] and again[4] == "1"
    assert open_raw("someone-else", 2)[0] == "stale"
    assert ledger.job_fields(job)["n_waiting"] == "1"
    assert ledger.r.zcard(k.leases) == 0


def test_a_replan_voids_the_old_plans_approvals(ledger, make_job):
    job = make_job(items=6, max_items=3, stage_defs=gated())
    opened = score_all(ledger, job)
    ledger.replan(job, {"type": "offset", "offset": 0}, "tester", "again")
    assert status(ledger, job) == "running" and ledger.job_fields(job)["n_waiting"] == "0"
    Supervisor(ledger, name="test").tick()  # the old plan's approvals: nobody can decide them
    assert all(ledger.approvals.get("acme", a)["status"] == "void" for a in opened.values())
    assert ledger.approvals.list("acme", "pending")[0] == []
    with pytest.raises(ApprovalDecided):
        ledger.approvals.decide("acme", opened[0], "approve", "tenant:acme")
    again = score_all(ledger, job)  # the new plan waits on new approvals
    assert sorted(again) == [2, 3] and ledger.approvals.list("acme", "pending")[0]


def test_migration_keeps_approval_stages_approval_stages(ledger, make_job, registry):
    from gateway.ledger.migrate import migrate

    job = make_job(items=3, max_items=3, stage_defs=gated(last=False))
    score_all(ledger, job)
    ledger.pause(job, "tester")
    spec = ledger.spec(job)
    plain = parse_flow({**spec.flow.model_dump(mode="json"), "version": "2",
                        "stages": [{"name": "score"}, {"name": "review"}, {"name": "store"}]})
    with pytest.raises(Conflict) as err:
        migrate(ledger, spec, plain, plain.content_hash(), "tester", "no approvals")
    assert err.value.problem()["incompatible"] == ["review"]
    longer = parse_flow({**spec.flow.model_dump(mode="json"), "version": "3",
                         "stages": [{"name": "score"}, {"name": "review", "approval": {"timeout": "P1D"}},
                                    {"name": "store"}]})
    moved = migrate(ledger, spec, longer, longer.content_hash(), "tester", "a longer timeout")
    assert moved["to"]["version"] == "3"
