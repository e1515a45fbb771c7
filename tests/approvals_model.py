"""A Hypothesis state machine for approvals, run by tests/test_ledger_model.py
(``test_ledger_model_approvals``).

It drives one job at a time through the real Ledger on a real Redis: a pull stage ``score``, an approval
stage ``review`` (on_timeout drawn per job), and, in half the flows, a pull stage ``store`` after it.
Actions: lease and complete a pull stage (sometimes answering twice; or several in a row), fail one for
good, open a platform approval instead of completing (sometimes twice with the same lease), decide a
pending approval (approve with or without an edited output, reject; or several), decide a decided one
again (the same decision, or another), let a deadline pass and run the supervisor's timeouts,
retry-failed (a rejected batch waits in a new round), pause, resume, resume by cursor (re-plans: the old
plan's approvals become void when next decided), cancel.

Invariants, after every step:
  1. a committed stage is never committed again: a batch's ``c:<stage>`` never changes once set, and the
     log has at most one stage_completed per (seq, stage);
  2. a decided approval never changes (status, decision, actor, comment, time, edited);
  3. the job's counters equal a recount over the current plan, ``n_waiting`` included (batches whose
     status is waiting_human); no waiting batch holds a lease;
  4. a waiting batch's approval is pending and due; every due approval is pending; the tenant's pending
     listing is exactly the pending records;
  5. a running job whose source is exhausted and whose every open batch waits is waiting_human, and a
     waiting_human job is exactly that;
  6. every record (job, batches, approvals) passes its checksum.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gateway.errors import Conflict, InvalidRequest, NotFound, StaleLease
from gateway.ledger.approvals import ApprovalDecided, ApprovalRef
from gateway.ledger.embedded import client_for
from gateway.ledger.flows import FlowRegistry, parse_flow
from gateway.ledger.jobs import JobRequest, JobService
from gateway.ledger.ledger import Ledger
from gateway.ledger.records import intact, seal
from gateway.push.supervisor import Supervisor
from gateway.settings import Settings

TENANT = "acme"
JOB = st.fixed_dictionaries({
    "n": st.integers(2, 16), "max_items": st.integers(1, 3), "store": st.booleans(),
    "on_timeout": st.sampled_from(["reject", "approve", "fail"]), "pct": st.sampled_from([0, 30, 100])})


class ApprovalMachine(RuleBasedStateMachine):
    """``server`` and ``data_dir`` are set on a subclass by the test function."""

    server = None
    data_dir = None

    def __init__(self):
        super().__init__()
        self.settings = Settings(redis_url=self.server.url, data_dir=self.data_dir,
                                 tokens={"t-acme-0123456789": TENANT})
        self.r = client_for(self.server.url)
        self.r.flushdb()
        self.ledger = Ledger(self.r, self.settings)
        self.registry = FlowRegistry(self.r, self.ledger.keys)
        self.jobs = JobService(self.ledger, self.registry)
        self.supervisor = Supervisor(self.ledger, name="model")
        self.jobs_made = 0
        self.leases: dict[int, object] = {}  # seq -> the lease this machine holds
        self.committed: dict[tuple[int, int], str] = {}  # (seq, stage) -> c:<stage> when first seen
        self.decided: dict[str, tuple] = {}  # approval id -> its decision when first seen

    def teardown(self):
        self.r.close()

    @initialize(params=JOB)
    def start(self, params):
        self.new_job(**params)

    def new_job(self, n, max_items, store, on_timeout, pct):
        stages = [{"name": "score", "lease": 3600},
                  {"name": "review", "approval": {"timeout": 3600, "on_timeout": on_timeout}}]
        if store:
            stages.append({"name": "store", "lease": 3600})
        flow_id = f"ap{self.jobs_made}"
        self.jobs_made += 1
        self.registry.register(TENANT, parse_flow({
            "id": flow_id, "version": "1", "stages": stages, "batching": {"max_items": max_items},
            "tolerated_failure_percentage": pct, "source": {"type": "sequence", "count": n}}))
        self.job_id = self.jobs.create(TENANT, JobRequest(flow_id=flow_id))["job_id"]
        self.k = self.ledger.keys.job(self.job_id)
        self.nstages = len(stages)
        self.leases = {}
        self.committed = {}

    # -- helpers --------------------------------------------------------------------------------
    def status(self) -> str:
        return self.r.hget(self.k.job, "status")

    def pending_ids(self) -> list[str]:
        return sorted(self.r.zrange(self.k.approvals_due, 0, -1))

    def decided_ids(self) -> list[str]:
        ids = self.r.zrange(self.k.approvals, 0, -1)
        return sorted(set(ids) - set(self.pending_ids()))

    def lease_one(self):
        lease = self.ledger.lease(self.job_id)
        if lease is not None:
            self.leases[lease.seq] = lease
        return lease

    # -- actions --------------------------------------------------------------------------------
    @rule(twice=st.booleans())
    def lease_and_complete(self, twice):
        lease = self.lease_one()
        if lease is None:
            return
        out = {"seq": lease.seq, "stage": lease.stage}
        for _ in range(2 if twice else 1):
            try:
                self.ledger.complete(self.job_id, lease.seq, lease.lease_token, out)
            except (StaleLease, Conflict):
                pass
        self.leases.pop(lease.seq, None)

    @rule(count=st.integers(1, 6))
    def work_through(self, count):
        """Several leases and commits in a row: batches reach their approvals more often."""
        for _ in range(count):
            self.lease_and_complete(False)

    @rule(data=st.data())
    def decide_several(self, data):
        for _ in range(data.draw(st.integers(1, 4))):
            self.decide(data, data.draw(st.sampled_from(["approve", "reject"])), data.draw(st.booleans()))

    @rule()
    def lease_and_fail(self):
        lease = self.lease_one()
        if lease is None:
            return
        try:
            self.ledger.fail(self.job_id, lease.seq, lease.lease_token, "broken", retryable=False)
        except Conflict:
            pass
        self.leases.pop(lease.seq, None)

    @rule(platform=st.booleans(), twice=st.booleans())
    def platform_waits(self, platform, twice):
        lease = self.lease_one()
        if lease is None:
            return
        answers = []
        for _ in range(2 if twice else 1):
            try:
                answers.append(self.ledger.open_platform_approval(
                    self.job_id, lease.seq, lease.lease_token, {"q": lease.seq},
                    platform={"run": lease.seq} if platform else None))
            except Conflict:
                pass
        if len(answers) == 2:
            assert answers[1]["approval_id"] == answers[0]["approval_id"] and answers[1]["duplicate"]
        self.leases.pop(lease.seq, None)

    @rule(data=st.data(), decision=st.sampled_from(["approve", "reject"]), edit=st.booleans())
    def decide(self, data, decision, edit):
        ids = self.pending_ids()
        if not ids:
            return
        aid = data.draw(st.sampled_from(ids))
        output = {"edited": aid} if edit and decision == "approve" else None
        try:
            view, fresh = self.ledger.approvals.decide(TENANT, aid, decision, "tenant:acme", "c", output)
        except (ApprovalDecided, Conflict):
            return  # void (re-planned) or the job was cancelled
        assert fresh and view["decision"]["decision"] == decision

    @rule(data=st.data(), same=st.booleans())
    def decide_again(self, data, same):
        ids = [a for a in self.decided_ids()
               if self.ledger.approvals.record(ApprovalRef.parse(a))["status"] in ("approved", "rejected")]
        if not ids:
            return
        aid = data.draw(st.sampled_from(ids))
        rec = self.ledger.approvals.record(ApprovalRef.parse(aid))
        first = rec["decision"]
        decision = first if same else ("reject" if first == "approve" else "approve")
        try:
            view, fresh = self.ledger.approvals.decide(TENANT, aid, decision, "tenant:other-person")
        except ApprovalDecided:
            assert not same
            return
        except Conflict:
            return  # cancelled job
        assert same and not fresh and view["decision"]["actor"] == rec["actor"]

    @rule(data=st.data())
    def deadline_passes(self, data):
        ids = self.pending_ids()
        if not ids:
            return
        aid = data.draw(st.sampled_from(ids))
        ref = ApprovalRef.parse(aid)
        key = self.k.approval(ref.seq, ref.stage, ref.round)
        rec = self.r.hgetall(key)
        rec.pop("checksum", None)
        rec["deadline_ms"] = "1"
        self.r.hset(key, mapping=seal(rec))
        self.r.zadd(self.k.approvals_due, {aid: 1})
        self.supervisor_tick()

    @rule()
    def supervisor_tick(self):
        if self.status() in ("held", "cancelled"):
            return
        self.supervisor._approvals(self.job_id)  # re-opened rounds, timeouts, void, listing repair

    @rule()
    def retry_failed(self):
        try:
            self.ledger.reopen(self.job_id, "tester", only_failed=True)
        except Conflict:
            return
        self.supervisor_tick()

    @rule()
    def pause(self):
        try:
            self.ledger.pause(self.job_id, "tester")
        except Conflict:
            pass

    @rule()
    def resume(self):
        try:
            self.ledger.reopen(self.job_id, "tester")
        except Conflict:
            pass
        self.leases = {}

    @rule()
    def replan(self):
        try:
            self.ledger.replan(self.job_id, {"type": "offset", "offset": 0}, "tester", "again")
        except (Conflict, NotFound, InvalidRequest):
            pass
        self.leases = {}

    @rule()
    def cancel(self):
        try:
            self.ledger.cancel(self.job_id, "tester")
        except Conflict:
            assert self.status() == "succeeded"

    @precondition(lambda self: self.status() in ("succeeded", "failed", "cancelled"))
    @rule(params=JOB)
    def next_job(self, params):
        self.new_job(**params)

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def holds(self):
        if not hasattr(self, "job_id"):
            return
        job = self.r.hgetall(self.k.job)
        assert intact(job) and not job.get("corrupt"), job
        base, nxt = int(job["base_seq"]), int(job["next_seq"])
        pipe = self.r.pipeline(transaction=False)
        for seq in range(nxt):
            pipe.hgetall(self.k.batch(seq))
        batches = pipe.execute()
        counts: Counter = Counter()
        leased = set(self.r.zrange(self.k.leases, 0, -1))
        due = set(self.r.zrange(self.k.approvals_due, 0, -1))
        log = self.r.xrange(self.k.log)
        done = Counter((f["seq"], f["stage"]) for _, f in log if f["event"] == "stage_completed")
        assert set(done.values()) <= {1}, "a stage was committed twice"
        for seq, b in enumerate(batches):
            if not b:
                continue
            assert intact(b), (seq, b)
            for stage in range(self.nstages):
                c = b.get(f"c:{stage}")
                if c:
                    assert self.committed.setdefault((seq, stage), c) == c, "a committed stage changed"
            if b["status"] == "waiting_human":
                assert str(seq) not in leased
                if seq >= base:
                    assert b["approval"] in due, (seq, b["approval"])
            if seq >= base:
                counts[b["status"]] += 1
        assert int(job["n_waiting"] if "n_waiting" in job else 0) == counts["waiting_human"]
        assert int(job["n_open"]) == counts["pending"] + counts["leased"] + counts["waiting_human"]
        assert int(job["n_done"]) == counts["completed"] and int(job["n_failed"]) == counts["failed"]
        pending = set()
        for aid in self.r.zrange(self.k.approvals, 0, -1):
            rec = self.ledger.approvals.record(ApprovalRef.parse(aid))  # checks the checksum
            if rec["status"] == "pending":
                pending.add(aid)
            else:
                seen = tuple(rec[f] for f in ("status", "decision", "actor", "comment", "decided_ms",
                                              "edited"))
                assert self.decided.setdefault(aid, seen) == seen, "a decided approval changed"
        assert due == pending
        index = self.ledger.keys.approval_index(TENANT, "pending")
        listed = {m.split(":", 1)[1] for m in self.r.zrange(index, 0, -1)}
        assert {a for a in listed if a.startswith(self.job_id + ".")} == pending
        if job["status"] in ("running", "waiting_human"):
            all_wait = (job["exhausted"] == "1" and job["blocked"] == "" and int(job["n_open"]) > 0
                        and int(job["n_open"]) == int(job.get("n_waiting") or 0))
            assert (job["status"] == "waiting_human") == all_wait, job
