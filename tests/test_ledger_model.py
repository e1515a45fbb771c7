"""Model-based test of the ledger: a Hypothesis state machine drives jobs through the real Ledger API and
checks a small pure-Python reference model (``Model``), and the ledger's invariants, against Redis after
every step.

Actions (one weighted rule, ``ACTIONS``): lease (any stage, or one stage by name), complete (current,
duplicate, stale, late), fail (retryable or not; current or stale), heartbeat (current or stale; into the
attempt's max_run, which caps the lease, and past it, which fails the attempt: odd stages are idempotent
and retry it, even ones fail for good; time moved by rewriting the batch's sealed leased_ms), begin (a
push-mode worker about to call its platform), a lease running out (expire_due), pause, resume, resume by
cursor forward and backward (replan), cancel, retry-failed, supervisor recovery in auto mode (with a fresh
or a still-held claim) and record mode (the job is held) and release, supervisor ticks (expiry, retire),
a SIGKILLed and restarted Redis (AOF), a next job once one is final, and the result sink's delivery:
a chunk of committed batches below the watermark written to the job's jsonl sink and compacted to range
summaries (compact.lua), or the torn tail a deliverer killed mid-write leaves in the file. One more
rule, enabled only when a job succeeded with failed batches its budget tolerated, retries them (a state
the weighted actions reach too rarely to test the rule by). Jobs run over a ``sequence``
source of 5..40 items, 1..5 per batch, 1..3 stages, concurrency 1..6, 1..4 attempts per stage and a
failure budget of 0..100 %, on a ledger that plans 1, 2, 3 or 16 batches at a time (``plan_ahead``: every
action above also meets batches planned ahead but not leased yet).

The server is private to this module (it gets killed and restarted from its AOF; ``appendfsync always``
so nothing acknowledged is lost). Time is moved by rewriting the scores of the two unchecksummed zsets
only: ``leases`` (score 0 = the lease ran out) and ``ready:<stage>`` (score 0 = a retry's backoff is over;
done before every lease, so which ready batch is leased depends on nothing timed).

Invariants (checked after every step):
  1. each (item, stage) is committed at most once between explicit rewinds (a replan clears the items
     from its cursor on);
  2. the committed cursor only moves forward by commits, or by an operator's replan;
  3. the job's counters equal a recount over the batches of the current plan (base_seq .. next_seq-1),
     none is negative, and ``wm`` is the first seq of the plan not completed;
  4. a succeeded job has every item from its plan cursor to the end committed at the last stage by a
     completed batch of the current plan, except the items of failed batches the failure budget tolerated
     (decision: ``tolerated_failure_percentage`` > 0 lets a job succeed with failed batches; their items
     are the tolerated loss, visible as ``batches.failed``, so they are exempt, and the job must be within
     its budget);
  5. a succeeded or cancelled job changes no more (a succeeded one only by an explicit replan, or by a
     retry-failed that re-opens failed batches its budget tolerated); ``failed``
     is not final; a cancelled job refuses resume, retry-failed, replan and every answer;
  6. every record passes its checksum and nothing is marked corrupt;
  7. compaction drops only delivered records: every seq below the sink cursor is completed or superseded
     (in the model) and below the watermark, its records are gone, and the sink file up to the recorded
     offset holds exactly one line per completed batch among them, in seq order; every seq above the
     cursor keeps its record.
Also: the model's view of every batch and of the job (status, cursors, attempts, tokens, per-stage status,
items), the indexes (leases, ready, failed, done, items keys) agree with the batch records, the job view,
the audit stream (every control action that took effect, once), and TTLs (a job that runs has none; the
recovery claim and the plan lock always have their own short one).

Decisions where the semantics could be read two ways (the model encodes them):
  - retry-failed on a succeeded job re-opens the failed batches the budget tolerated and runs the job
    again (their items were never stored; refusing left them lost for good); with none failed it answers 0
    and changes nothing. Resume on a succeeded job is refused (409): a replan with a cursor is how a part
    that committed runs again;
  - a duplicate ``complete`` (same token as an answer already committed) answers ``duplicate: True`` even
    when the job has been cancelled since: it changes nothing, and it tells the caller the truth about an
    answer that was accepted before the cancel;
  - retry-failed on a held job re-opens the failed batches and lets the job run, as resume does: both are
    an operator's explicit "go on"; on a paused job it re-opens them but does not unpause;
  - a lease taken back by resume counts as an attempt spent (like one that ran out): its holder may have
    made the call.

``test_ledger_model`` (fixed seed, CI) takes about 30 s; ``test_ledger_model_slow`` runs 20x the examples
(about 10 min) and only with BATCHGATE_SLOW=1. BATCHGATE_MODEL_STATS=1 (with ``pytest -s``) prints what the
examples reached.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gateway.ledger import archive
from gateway.ledger.embedded import EmbeddedRedis, client_for
from gateway.errors import Conflict, JobCancelled, RunTooLong, StaleLease
from gateway.ledger.flows import FlowRegistry, parse_flow
from gateway.ledger.jobs import JobRequest, JobService
from gateway.ledger.ledger import Ledger
from gateway.ledger.records import dumps, intact, loads_or_none, seal
from gateway.ledger.scripts import JOURNAL_MS
from gateway.settings import Settings
from gateway.push.sinks import SinkDeliverer
from gateway.push.supervisor import Supervisor
from tests.conftest import ready_all_now

TENANT = "acme"
LIVE = ("running", "paused", "held")
AOF_REWRITE_BYTES = 4 << 20
LEASE_MS, MAX_RUN_MS = 3_600_000, 7_200_000  # each stage's lease and max_run (the machine moves time)
STATS: Counter = Counter()  # what the examples reached; printed with BATCHGATE_MODEL_STATS=1 (pytest -s)


def cursor(offset: int) -> str:
    """A sequence source's cursor as the ledger stores it."""
    return dumps({"type": "offset", "offset": offset})


# == the reference model =================================================================================

@dataclass
class MBatch:
    seq: int
    start: int
    end: int  # items range(start, end)
    final: bool  # the source ended with this batch: its end cursor is null
    status: str = "pending"
    stage: int = 0
    attempt: int = 0
    token: str | None = None  # the current lease's token
    rec_token: str = ""  # lease_token as recorded: a commit keeps it (duplicates), other moves clear it
    unspent: int = 0  # leases released by begin.lua before any platform call: attempts not spent
    commits: dict[int, tuple[int, str]] = field(default_factory=dict)  # stage -> (attempt, token)
    capped: bool = False  # a heartbeat held this attempt's lease at its start + max_run (capped_ms)
    past_max_run: bool = False  # this attempt's clock was moved past its max_run


    @property
    def end_json(self) -> str:
        return "null" if self.final else cursor(self.end)


class Model:
    """What the ledger should hold for one job over ``sequence`` N, after each operation."""

    def __init__(self, n, max_items, stages, concurrency, attempts, pct, ahead=1):
        self.n, self.max_items, self.stages = n, max_items, stages
        self.ahead = ahead  # batches one plan cuts (the ledger's plan_ahead)
        self.concurrency, self.attempts, self.pct = concurrency, attempts, pct
        self.budget_total = math.ceil(n / max_items)
        self.status = "running"
        self.base = self.next_seq = 0
        self.frontier, self.frontier_json = 0, cursor(0)
        self.exhausted = False
        self.plan_cursor = cursor(0)
        self.batches: dict[int, MBatch] = {}
        self.tokens: dict[str, int] = {}  # every lease token ever handed out -> its seq
        self.token_stage: dict[str, int] = {}  # ... -> the stage it was leased for
        self.committed: set[tuple[int, int]] = set()  # (item, stage), invariant 1
        self.overdue: set[int] = set()  # leased seqs whose deadline we moved into the past
        self.active = True  # in the supervisor's active set
        self.claim = False  # a recovery claim (60 s) is held
        self.idempotent = [i % 2 == 1 for i in range(stages)]  # odd stages: a run past max_run is retried

    # -- derived state ----------------------------------------------------------------------------
    def plan(self) -> list[MBatch]:
        return [self.batches[s] for s in range(self.base, self.next_seq)]

    def count(self, status: str) -> int:
        return sum(b.status == status for b in self.plan())

    def counters(self) -> dict[str, int]:
        plan = self.plan()
        return {"n_open": sum(b.status in ("pending", "leased") for b in plan),
                "n_done": sum(b.status == "completed" for b in plan),
                "n_failed": sum(b.status == "failed" for b in plan),
                "items_done": sum(b.end - b.start for b in plan if b.status == "completed")}

    def wm(self) -> int:
        seq = self.base
        while seq < self.next_seq and self.batches[seq].status == "completed":
            seq += 1
        return seq

    def committed_cursor(self) -> str:
        wm = self.wm()
        return self.plan_cursor if wm == self.base else self.batches[wm - 1].end_json

    def leased(self) -> list[MBatch]:
        return [b for b in self.plan() if b.status == "leased"]

    def over_budget(self, n_failed: int) -> bool:
        total = max(self.budget_total, self.next_seq - self.base, 1)
        return n_failed * 100 > self.pct * total

    def finish(self) -> None:
        """finish_changes in lib.lua."""
        if self.status in LIVE and self.exhausted and self.counters()["n_open"] == 0:
            failed = self.counters()["n_failed"]
            self.status = "failed" if failed > 0 and self.over_budget(failed) else "succeeded"

    # -- transitions ------------------------------------------------------------------------------
    def cut(self) -> MBatch | None:
        """plan.lua at the frontier: up to ``ahead`` new batches, the first of which the planner leases;
        None when the source is over (the job may finish)."""
        if self.frontier >= self.n:
            self.exhausted = True
            self.finish()
            return None
        first = None
        for _ in range(self.ahead):
            f = self.frontier
            end = min(f + self.max_items, self.n)
            final = f + self.max_items >= self.n
            b = MBatch(self.next_seq, f, end, final)
            self.batches[b.seq] = b
            self.next_seq += 1
            first = first or b
            STATS[f"plan: batch {min(self.next_seq - first.seq, 4)} of one plan"] += 1
            if final:
                self.exhausted, self.frontier_json = True, "null"
                break
            self.frontier, self.frontier_json = end, cursor(end)
        return first

    def expect_lease(self, scores: dict[int, dict[int, float]], stage: int | None = None) -> MBatch | None:
        """Ledger.lease (of any stage, or of ``stage`` only): the batch it should hand out (None: nothing);
        plans (and may finish) as it goes.

        ``scores``: stage -> seq -> ready score, read just before the call (every score is in the past).
        """
        if self.status != "running":
            return None
        pending = [b for b in self.plan() if b.status == "pending" and stage in (None, b.stage)]
        if pending:
            if len(self.leased()) >= self.concurrency:
                return None
            stage = max(b.stage for b in pending)
            cands = [b for b in pending if b.stage == stage]
            return min(cands, key=lambda b: (scores[stage][b.seq], str(b.seq)))
        if stage not in (None, 0) or self.exhausted or len(self.leased()) >= self.concurrency:
            return None  # only a lease that may take the first stage plans a new batch
        return self.cut()

    def lease(self, b: MBatch, token: str) -> None:
        b.status, b.attempt, b.token, b.rec_token = "leased", b.attempt + 1, token, token
        b.capped = b.past_max_run = False  # a new attempt, a new max_run clock
        self.tokens[token] = b.seq
        self.token_stage[token] = b.stage
        self.overdue.discard(b.seq)

    def commit(self, b: MBatch) -> None:
        b.commits[b.stage] = (b.attempt, b.token)
        b.token = None
        self.overdue.discard(b.seq)
        if b.stage + 1 < self.stages:
            b.stage, b.status, b.attempt, b.unspent = b.stage + 1, "pending", 0, 0
        else:
            b.status = "completed"
            self.finish()

    def fail_attempt(self, b: MBatch, retryable: bool) -> str:
        """fail_attempt in lib.lua; returns 'retry' or 'failed'."""
        b.token, b.rec_token = None, ""
        self.overdue.discard(b.seq)
        if retryable and b.attempt - b.unspent < self.attempts[b.stage]:
            b.status = "pending"
            return "retry"
        was_live = self.status in LIVE
        b.status = "failed"
        if was_live:
            if self.over_budget(self.counters()["n_failed"]):
                self.status = "failed"
            else:
                self.finish()
        return "failed"

    def expire_due(self) -> list[tuple[int, str]]:
        """Ledger.expire_due with the overdue leases (all score 0: lexicographic member order)."""
        due = sorted((s for s in self.overdue if self.batches[s].status == "leased"), key=str)
        if not due or self.status == "held":
            return []
        # a lease a heartbeat capped at max_run ran past it: retried only for an idempotent stage
        return [(s, self.fail_attempt(self.batches[s], self.max_run_retryable(self.batches[s])
                                      if self.batches[s].capped else True)) for s in due]

    def max_run_retryable(self, b: MBatch) -> bool:
        return self.idempotent[b.stage]

    def reopen(self, only_failed: bool) -> int:
        """reopen.lua (resume / retry_failed), for a job that is neither cancelled nor refused."""
        if not only_failed and self.status == "paused":
            self.status = "running"
            return 0
        todo = [b for b in self.plan()
                if b.status == "failed" or (not only_failed and b.status == "leased")]
        for b in todo:
            if b.status == "failed":
                b.attempt = b.unspent = 0
            b.status, b.token, b.rec_token = "pending", None, ""
            self.overdue.discard(b.seq)
        if (not only_failed or todo) and self.status in ("running", "failed", "held", "succeeded"):
            self.status = "running"
            self.finish()
        return len(todo)

    def replan(self, offset: int) -> int:
        superseded = 0
        for b in self.plan():
            if b.status not in ("completed", "superseded"):
                b.status, b.token, b.rec_token = "superseded", None, ""
                superseded += 1
        self.overdue.clear()
        self.base = self.next_seq
        self.frontier, self.frontier_json = offset, cursor(offset)
        self.plan_cursor = cursor(offset)
        self.exhausted = False
        self.status = "running"
        # an explicit rewind: items from the cursor on may be committed again
        self.committed = {(item, stage) for item, stage in self.committed if item < offset}
        return superseded

    def cancel(self) -> int:
        voided = 0
        for b in self.leased():
            b.status, b.token, b.rec_token = "pending", None, ""
            voided += 1
        self.overdue.clear()
        self.status = "cancelled"
        return voided


# == the machine =========================================================================================

JOB = st.fixed_dictionaries({
    "n": st.integers(5, 40), "max_items": st.integers(1, 5), "stages": st.integers(1, 3),
    "concurrency": st.integers(1, 6), "attempts": st.lists(st.integers(1, 4), min_size=3, max_size=3),
    "interval_ms": st.integers(1, 5), "pct": st.sampled_from([0, 0, 0, 10, 25, 50, 100, 100]),
    "ahead": st.sampled_from([1, 2, 3, 16])})

# Each step draws one action, weighted by repetition: workers lease and answer most of the time; operators,
# supervisors and the crash now and then. (One rule, so the weights hold in every example.)
ACTIONS = (
    ["lease"] * 3 + ["lease_stage"] + ["complete"] * 6 + ["work_through"] * 2
    + ["fail"] * 3 + ["late_complete"] * 2 + ["late_fail"] + ["heartbeat"] * 2 + ["lease_runs_out"] * 2
    + ["heartbeat_into_max_run", "heartbeat_past_max_run"]
    + ["begin"]
    + ["pause", "resume", "resume", "retry_failed", "retry_failed", "replan", "replan", "cancel",
       "release", "release", "recover_auto", "recover_record", "supervisor_tick", "redis_crash_and_restart"]
    + ["deliver"] * 2 + ["deliver_torn"]
    + ["next_job"] * 2
)


class LedgerMachine(RuleBasedStateMachine):
    """One job at a time (another once it is final), on a Redis emptied for each example; ``server`` and
    ``data_dir`` are set on a subclass by the test function."""

    server: EmbeddedRedis
    data_dir = None

    def __init__(self):
        super().__init__()
        self.sink_dir = Path(tempfile.mkdtemp(prefix="batchgate-model-sinks-"))  # not under data_dir
        self.settings = Settings(redis_url=self.server.url, data_dir=self.data_dir,
                                 tokens={"t-acme-0123456789": TENANT}, sink_roots=[str(self.sink_dir)],
                                 sink_chunk=3, sink_grace=0)
        self.connect()
        self.r.flushdb()
        # Keep the AOF small: it grows by every example's writes, and each restart replays all of it
        # (seconds per restart after a few thousand examples). Rarely: FLUSHDB stops a rewrite under way.
        aof = self.r.info("persistence")
        if aof["aof_current_size"] > AOF_REWRITE_BYTES and not aof["aof_rewrite_in_progress"]:
            self.r.bgrewriteaof()
        self.model: Model | None = None
        self.jobs_made = 0
        self.restarts = 0
        self.steps = 0

    def connect(self) -> None:
        self.r = client_for(self.server.url)
        self.ledger = Ledger(self.r, self.settings)
        self.record_ledger = Ledger(self.r, self.settings.model_copy(update={"recovery": "record"}))
        if getattr(self, "model", None) is not None:  # a restarted Redis: the same ledger settings
            self.ledger.plan_ahead = self.model.ahead
        self.registry = FlowRegistry(self.r, self.ledger.keys)
        self.jobs = JobService(self.ledger, self.registry)

    def teardown(self):
        self.r.close()
        shutil.rmtree(self.sink_dir, ignore_errors=True)

    # -- set-up -------------------------------------------------------------------------------------
    @initialize(params=JOB)
    def create_job(self, params):
        self.start_job(**params)

    def start_job(self, n, max_items, stages, concurrency, attempts, interval_ms, pct, ahead):
        """A job over ``sequence`` n, and a fresh model (and expectations) for it."""
        stage_defs = [{"name": f"s{i}", "retry": {"initial_interval": interval_ms / 1000,
                                                  "maximum_interval": 0.01,
                                                  "maximum_attempts": attempts[i]},
                       "lease": LEASE_MS / 1000, "max_run": MAX_RUN_MS / 1000, "idempotent": i % 2 == 1}
                      for i in range(stages)]
        flow_id = f"model{self.jobs_made}"
        self.jobs_made += 1
        flow = parse_flow({"id": flow_id, "version": "1", "stages": stage_defs,
                           "batching": {"max_items": max_items}, "concurrency": concurrency,
                           "tolerated_failure_percentage": pct,
                           "source": {"type": "sequence", "count": n}})
        self.registry.register(TENANT, flow)
        self.sink_path = self.sink_dir / f"{flow_id}.jsonl"
        self.job_id = self.jobs.create(TENANT, JobRequest(
            flow_id=flow_id, sink={"type": "jsonl", "path": str(self.sink_path)}))["job_id"]
        self.k = self.ledger.keys.job(self.job_id)
        self.model = Model(n, max_items, stages, concurrency, attempts[:stages], pct, ahead)
        self.ledger.plan_ahead = ahead
        self.audit = ["job_created"]  # the control events the job's audit stream should hold, in order
        self.last_cursor_offset = 0
        self.snapshot = None
        self.replanned = False
        self.delivered = False

    # -- helpers ------------------------------------------------------------------------------------
    def all_ready_now(self) -> dict[int, dict[int, float]]:
        """Every retry's backoff is over: ready scores to 0; returns stage -> seq -> score (all 0).

        Which ready batch a lease takes then depends on nothing timed (equal scores: member order), so
        every example replays exactly (Hypothesis needs that to shrink)."""
        found = ready_all_now(self.r, self.k, self.model.stages)
        return {i: dict.fromkeys((int(m) for m in members), 0.0) for i, members in enumerate(found)}

    def do_lease(self, stage: int | None = None):
        m = self.model
        scores = self.all_ready_now()
        expected = m.expect_lease(scores, stage)
        got = self.ledger.lease(self.job_id, None if stage is None else f"s{stage}")
        if expected is None:
            assert got is None, f"leased {got} where the model expected nothing"
            STATS["lease: nothing"] += 1
            return None
        STATS[f"lease: stage {expected.stage} attempt {min(expected.attempt + 1, 3)}"] += 1
        assert got is not None, f"nothing leased where the model expected batch {expected.seq}"
        assert (got.seq, got.stage_index, got.attempt) == (expected.seq, expected.stage, expected.attempt + 1)
        assert got.cursor == {"type": "offset", "offset": expected.start}
        assert got.items == list(range(expected.start, expected.end))
        # a later stage gets the output the stage before it committed (see do_complete)
        previous = {"seq": expected.seq, "stage": expected.stage - 1}
        assert got.input == (None if expected.stage == 0 else previous)
        m.lease(expected, got.lease_token)
        return got

    def do_complete(self, token: str):
        m = self.model
        b = m.batches[m.tokens[token]]
        output = {"seq": b.seq, "stage": b.stage}
        if b.status == "leased" and b.token == token:
            stage, attempt = b.stage, b.attempt
            for item in range(b.start, b.end):
                assert (item, stage) not in m.committed, f"item {item} stage {stage} committed twice"
            res = self.ledger.complete(self.job_id, b.seq, token, output)
            assert res["duplicate"] is False
            assert (res["stage"], res["attempt"]) == (f"s{stage}", attempt)
            m.committed.update((item, stage) for item in range(b.start, b.end))
            m.commit(b)
            STATS[f"complete: committed in a {m.status} job"] += 1
            return
        dup = [(stage, att) for stage, (att, tok) in b.commits.items() if tok == token]
        if self.compacted(b.seq):  # delivered to the sink, its record gone: any answer is stale
            with pytest.raises(JobCancelled if m.status == "cancelled" else StaleLease) as err:
                self.ledger.complete(self.job_id, b.seq, token, output)
            assert m.status == "cancelled" or err.value.extra["batch_status"] == "compacted"
            STATS["complete: compacted"] += 1
        elif dup:
            res = self.ledger.complete(self.job_id, b.seq, token, output)
            assert res["duplicate"] is True and (res["stage"], res["attempt"]) == (f"s{dup[0][0]}", dup[0][1])
            STATS["complete: duplicate"] += 1
        elif m.status == "cancelled":
            with pytest.raises(JobCancelled):
                self.ledger.complete(self.job_id, b.seq, token, output)
            STATS["complete: cancelled"] += 1
        else:
            with pytest.raises(StaleLease):
                self.ledger.complete(self.job_id, b.seq, token, output)
            STATS[f"complete: stale ({b.status})"] += 1

    def current_tokens(self) -> list[str]:
        return [b.token for b in self.model.leased()]

    # -- actions: one weighted rule draws them (see ACTIONS) ---------------------------------------
    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def step(self, action, data):
        STATS[f"action {action}"] += 1
        getattr(self, action)(data)

    @precondition(lambda self: self.model is not None and self.model.status == "succeeded"
                  and self.model.count("failed") > 0)
    @rule(data=st.data())
    def retry_tolerated_failures(self, data):
        """An operator retries the batches a succeeded job's budget tolerated (issue 15): a state the
        weighted actions reach rarely (a budget that tolerates, then every other batch committed), so
        it has a rule of its own, enabled only there."""
        STATS["action retry_tolerated_failures"] += 1
        self.retry_failed(data)

    # worker
    def lease(self, data):
        self.do_lease()

    def lease_stage(self, data):
        """A worker that runs one stage only leases by its name."""
        self.do_lease(data.draw(st.integers(0, self.model.stages - 1), label="stage"))

    def complete(self, data):
        """The holder of a current lease answers (a lease is taken first if none is held)."""
        if not self.current_tokens() and self.do_lease() is None:
            return
        self.do_complete(data.draw(st.sampled_from(self.current_tokens()), label="token"))

    def late_complete(self, data):
        """An answer with any token handed out so far: late, duplicate, stale, or by chance current."""
        if self.model.tokens:
            self.do_complete(data.draw(st.sampled_from(list(self.model.tokens)), label="token"))

    def work_through(self, data):
        """A worker leasing and committing in a loop until nothing is handed out."""
        for _ in range(data.draw(st.integers(1, 25), label="steps")):
            got = self.do_lease()
            if got is None:
                return
            self.do_complete(got.lease_token)

    def heartbeat(self, data):
        m = self.model
        if not m.tokens:
            return
        token = data.draw(st.sampled_from(list(m.tokens)), label="token")
        b = m.batches[m.tokens[token]]
        if b.status == "leased" and b.token == token:
            self.do_heartbeat(b, token)
        elif m.status == "cancelled":
            with pytest.raises(JobCancelled):
                self.ledger.heartbeat(self.job_id, b.seq, token, None)
        else:
            with pytest.raises(StaleLease):
                self.ledger.heartbeat(self.job_id, b.seq, token, None)

    def do_heartbeat(self, b: MBatch, token: str):
        """The current holder heartbeats: the lease is extended (up to the attempt's start + max_run),
        or, past max_run, the attempt fails here (retried only for an idempotent stage); a held job's
        lease only stays at its cap (nothing fails by itself there)."""
        m = self.model
        if b.past_max_run and m.status != "held":
            attempt = b.attempt
            with pytest.raises(RunTooLong) as caught:
                self.ledger.heartbeat(self.job_id, b.seq, token, {"at": self.steps})
            outcome = m.fail_attempt(b, m.max_run_retryable(b))
            assert (caught.value.extra["outcome"], caught.value.extra["attempt"]) == (outcome, attempt)
            STATS[f"heartbeat: past max_run, {outcome}"] += 1
            return
        res = self.ledger.heartbeat(self.job_id, b.seq, token, {"at": self.steps})
        assert res["job_status"] == m.status
        if b.past_max_run:  # held: the deadline is the cap, in the past
            b.capped = True
            m.overdue.add(b.seq)
            STATS["heartbeat: past max_run, held"] += 1
        else:
            m.overdue.discard(b.seq)  # the deadline moved into the future again
        if b.capped:
            STATS["heartbeat: capped"] += 1

    def move_run_start(self, b: MBatch, back_ms: int):
        """Time for one attempt's max_run clock: its lease time (leased_ms, in the checksummed batch
        record, sealed again) moved to ``back_ms`` before now."""
        fields = self.r.hgetall(self.k.batch(b.seq))
        fields["leased_ms"] = str(int(time.time() * 1000) - back_ms)
        self.r.hset(self.k.batch(b.seq), mapping=seal(fields))

    def heartbeat_into_max_run(self, data):
        """The holder's attempt has run until half a lease before its max_run: its heartbeat gets the
        cap (start + max_run), not a full lease."""
        m = self.model
        if not self.current_tokens():
            return
        token = data.draw(st.sampled_from(self.current_tokens()), label="token")
        b = m.batches[m.tokens[token]]
        if not b.past_max_run:
            self.move_run_start(b, MAX_RUN_MS - LEASE_MS // 2)
            b.capped = True
        self.do_heartbeat(b, token)
        fields = self.r.hgetall(self.k.batch(b.seq))
        assert int(fields["capped_ms"]) == int(fields["leased_ms"]) + MAX_RUN_MS
        if b.status == "leased" and data.draw(st.booleans(), label="then silent"):
            self.run_out(b.seq)  # the capped lease runs out: expired as a run past max_run

    def heartbeat_past_max_run(self, data):
        """The holder heartbeats after its attempt ran past max_run: the attempt fails (see
        do_heartbeat)."""
        m = self.model
        if not self.current_tokens():
            return
        token = data.draw(st.sampled_from(self.current_tokens()), label="token")
        b = m.batches[m.tokens[token]]
        self.move_run_start(b, MAX_RUN_MS + 1000)
        b.past_max_run = True
        self.do_heartbeat(b, token)

    def fail(self, data):
        """The holder of a current lease reports a failure (a lease is taken first if none is held)."""
        if not self.current_tokens() and self.do_lease() is None:
            return
        token = data.draw(st.sampled_from(self.current_tokens()), label="token")
        self.do_fail(token, data.draw(st.booleans(), label="retryable"))

    def late_fail(self, data):
        """A failure report with any token handed out so far."""
        if self.model.tokens:
            token = data.draw(st.sampled_from(list(self.model.tokens)), label="token")
            self.do_fail(token, data.draw(st.booleans(), label="retryable"))

    def do_fail(self, token: str, retryable: bool):
        m = self.model
        b = m.batches[m.tokens[token]]
        if b.status == "leased" and b.token == token:
            attempt = b.attempt
            res = self.ledger.fail(self.job_id, b.seq, token, "boom", retryable=retryable)
            outcome = m.fail_attempt(b, retryable)
            assert (res["outcome"], res["attempt"]) == (outcome, attempt)
            STATS[f"fail: {outcome}"] += 1
        elif m.status == "cancelled":
            with pytest.raises(JobCancelled):
                self.ledger.fail(self.job_id, b.seq, token, "late", retryable=retryable)
        else:
            with pytest.raises(StaleLease):
                self.ledger.fail(self.job_id, b.seq, token, "late", retryable=retryable)

    def begin(self, data):
        """A push-mode worker about to make its platform call (begin.lua, with the keys the dispatcher
        passes): it starts only for a current lease of a running job; otherwise the lease goes back
        to the pool without spending an attempt."""
        m = self.model
        if not m.tokens:
            return
        current = self.current_tokens()
        pool = current if current and data.draw(st.integers(0, 3), label="late") else list(m.tokens)
        token = data.draw(st.sampled_from(pool), label="token")
        b = m.batches[m.tokens[token]]
        k = self.k
        res = self.ledger.scripts.begin(keys=[k.job, k.batch(b.seq), k.leases, k.ready(m.token_stage[token]),
                                              k.log], args=[token, 60_000, 1000])
        if b.status == "leased" and b.token == token:
            if m.status == "running":
                assert res[0] == "ok"
                m.overdue.discard(b.seq)
            else:
                assert res == ["released", m.status]
                b.status, b.token, b.rec_token, b.unspent = "pending", None, "", b.unspent + 1
                m.overdue.discard(b.seq)
            STATS[f"begin: {res[0]}"] += 1
        elif self.compacted(b.seq):
            assert res == ["missing"]  # delivered to the sink and compacted: no record to be stale
        elif m.status == "cancelled":
            assert res == ["cancelled"]
        else:
            assert res == ["stale", b.status, str(b.attempt)]

    # time
    def lease_runs_out(self, data):
        """A holder went silent: its lease deadline passes, and expire_due returns it (or fails it)."""
        m = self.model
        if not m.leased():
            return
        self.run_out(data.draw(st.sampled_from([b.seq for b in m.leased()]), label="seq"))

    def run_out(self, seq: int):
        m = self.model
        self.r.zadd(self.k.leases, {str(seq): 0}, xx=True)
        m.overdue.add(seq)
        capped = {s for s in m.overdue if m.batches[s].capped}
        expired = m.expire_due()
        assert self.ledger.expire_due(self.job_id) == expired
        STATS.update(f"expire: {outcome}{' (max_run)' if s in capped else ''}" for s, outcome in expired)

    # operator
    def pause(self, data):
        m = self.model
        if m.status != "running":
            with pytest.raises(Conflict):
                self.ledger.pause(self.job_id, "op")
            return
        assert self.ledger.pause(self.job_id, "op") == "running"
        self.audit.append("job_paused")
        m.status = "paused"

    def resume(self, data):
        m = self.model
        if m.status == "cancelled":
            with pytest.raises(JobCancelled):
                self.ledger.reopen(self.job_id, "op")
        elif m.status == "succeeded":
            with pytest.raises(Conflict):
                self.ledger.reopen(self.job_id, "op")
        else:
            expected = m.reopen(only_failed=False)
            assert self.ledger.reopen(self.job_id, "op") == expected
            self.audit.append("job_resumed")
            STATS[f"resume: reopened {min(expected, 2)}"] += 1
            m.active = True

    def retry_failed(self, data):
        m = self.model
        if m.status == "cancelled":
            with pytest.raises(JobCancelled):
                self.ledger.reopen(self.job_id, "op", only_failed=True)
        else:
            was = m.status
            expected = m.reopen(only_failed=True)
            if was == "succeeded":
                STATS[f"retry-failed on succeeded: reopened {min(expected, 2)}"] += 1
                if expected:
                    self.replanned = True  # invariant 5: a succeeded job may change by this action
            assert self.ledger.reopen(self.job_id, "op", only_failed=True) == expected
            if was == "succeeded" and not expected:
                return  # nothing was lost: the job is unchanged (invariant 5 checks it)
            self.audit.append("retry_failed")
            STATS[f"retry-failed: reopened {min(expected, 2)}"] += 1
            m.active = True

    def replan(self, data):
        """Resume by cursor: forward (skip a range) or backward (rewind)."""
        m = self.model
        offset = data.draw(st.integers(0, m.n), label="offset")
        target = {"type": "offset", "offset": offset}
        if m.status == "cancelled":
            with pytest.raises(JobCancelled):
                self.ledger.replan(self.job_id, target, "op", "model")
            return
        first = m.next_seq
        direction = "back" if offset < self.last_cursor_offset else "forward"
        STATS[f"replan {direction} from a {m.status} job"] += 1
        if any(b.status == "pending" and b.attempt == 0 and b.stage == 0 for b in m.plan()):
            STATS[f"replan with batches planned ahead, not leased (ahead {m.ahead})"] += 1
        superseded = m.replan(offset)
        self.audit.append("cursor_moved")
        assert self.ledger.replan(self.job_id, target, "op", "model") == {
            "superseded": superseded, "first_new_seq": first}
        m.active = True
        self.replanned = True

    def cancel(self, data):
        """Cancel, one time in four: it is final, so the rest of the example can only probe it."""
        m = self.model
        if data.draw(st.integers(0, 3), label="not now"):
            return
        if m.status == "cancelled":
            assert self.ledger.cancel(self.job_id, "op")["already"] is True
        elif m.status == "succeeded":
            with pytest.raises(Conflict):
                self.ledger.cancel(self.job_id, "op")
        else:
            STATS[f"cancel a {m.status} job"] += 1
            if any(b.status == "pending" and b.attempt == 0 and b.stage == 0 for b in m.plan()):
                STATS["cancel with batches planned ahead, not leased"] += 1
            voided = m.cancel()
            self.audit.append("job_cancelled")
            assert self.ledger.cancel(self.job_id, "op") == {
                "cancelled": True, "already": False, "voided_leases": voided}

    def next_job(self, data):
        """Once the job is final (succeeded or cancelled) the example may go on with a new one: the old
        job stays in Redis, final, beside it (supervisor passes see both)."""
        if self.model.status in ("succeeded", "cancelled"):
            self.start_job(**data.draw(JOB, label="job"))

    # supervisor
    def recover_auto(self, data):
        """A supervisor starts (``later``: after the last one's 60 s recovery claim ran out)."""
        m = self.model
        if data.draw(st.booleans(), label="later"):
            self.r.delete(self.k.recover)
            m.claim = False
        report = Supervisor(self.ledger, name="sup-auto").recover()
        if m.active and m.status == "running" and not m.claim:
            m.claim = True
            self.audit.append("job_recovered")
            expired = m.expire_due()
            assert len(report) == 1 and report[0]["expired_now"] == [s for s, _ in expired]
        else:
            assert report == []

    def recover_record(self, data):
        m = self.model
        report = Supervisor(self.record_ledger, name="sup-record").recover()
        if m.active and m.status == "running":
            assert len(report) == 1 and report[0]["held"] is True
            m.status = "held"
            self.audit.append("job_held")
        else:
            assert report == []

    def release(self, data):
        m = self.model
        if m.status != "held":
            with pytest.raises(Conflict):
                self.ledger.release(self.job_id, "op")
            return
        assert self.ledger.release(self.job_id, "op") == "held"
        self.audit.append("job_released")
        m.status = "running"
        m.finish()

    def supervisor_tick(self, data):
        m = self.model
        Supervisor(self.ledger, name="sup-tick").tick()
        if not m.active:
            return
        if m.status in ("succeeded", "failed", "cancelled"):
            m.active = False
        elif m.status in ("running", "paused"):
            m.expire_due()

    def redis_crash_and_restart(self, data):
        """SIGKILL the server and start it again on its AOF: nothing acknowledged may be lost.
        Slow (~0.1 s): once per example at most."""
        if self.restarts >= 1:
            return
        before = self.dump(scores=True)
        self.r.close()
        self.server.kill()
        self.server.start()
        self.connect()
        self.restarts += 1
        assert self.dump(scores=True) == before

    # result sink
    def compacted(self, seq: int) -> bool:
        """Whether batch ``seq`` was delivered to the job's sink and its record compacted."""
        return seq < int(self.r.hget(self.k.sink, "seq") or 0)

    def deliver(self, data):
        """The sink deliverer writes and records one to three chunks (3 batches each, sink_chunk)."""
        deliverer = SinkDeliverer(self.ledger, name="model-sink")
        spec = self.ledger.spec(self.job_id)
        for _ in range(data.draw(st.integers(1, 3), label="chunks")):
            if deliverer._deliver_chunk(spec) is None:  # nothing due: a job at rest may fold (archive.py)
                self.delivered = True
                if self.r.exists(self.k.past):
                    STATS["sink: a job at rest folded"] += 1
                break
            STATS["sink: a chunk delivered"] += 1
            self.delivered = True  # invariant 5: a finished job's records may compact

    def deliver_torn(self, data):
        """What a deliverer SIGKILLed mid-write leaves: lines past the recorded offset, the last one half
        written (the next delivery cuts them off before it writes)."""
        with self.sink_path.open("a") as fh:
            fh.write('{"id": "torn", "seq": 0}\n{"id": "half')

    def pipe_all(self, queue) -> list:
        pipe = self.r.pipeline(transaction=False)
        queue(pipe)
        return pipe.execute()

    def dump(self, scores: bool = False) -> dict:
        """Every key of the job but its log and audit streams (and the short-lived claim and plan lock);
        zsets by member only unless ``scores`` (the machine itself moves lease and ready scores: time)."""
        keys = sorted(k for k in self.r.keys(self.k.job.rsplit(":", 1)[0] + ":*")
                      if not k.endswith((":log", ":audit", ":recover", ":planlock")) and ":call:" not in k)
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
        kinds = pipe.execute()
        read = {"hash": lambda key: pipe.hgetall(key), "string": lambda key: pipe.get(key),
                "list": lambda key: pipe.lrange(key, 0, -1),
                "zset": lambda key: pipe.zrange(key, 0, -1, withscores=scores),
                "stream": lambda key: pipe.xrange(key)}  # the event outbox (keys.py)
        for key, kind in zip(keys, kinds, strict=True):
            read[kind](key)
        values = pipe.execute()
        return {key: value if kind != "zset" or scores else sorted(value)
                for key, kind, value in zip(keys, kinds, values, strict=True)}

    @invariant()
    def matches_model_and_invariants(self):
        if self.model is None:
            return
        self.steps += 1
        m, k, r = self.model, self.k, self.r
        STATS[f"status {m.status}"] += 1
        if m.status == "succeeded" and m.count("failed"):
            STATS["status succeeded with failed batches"] += 1
        pipe = r.pipeline(transaction=False)
        pipe.hgetall(k.job)
        pipe.hgetall(k.spec)
        pipe.zrange(k.leases, 0, -1)
        pipe.zrange(k.failed, 0, -1)
        pipe.hgetall(k.done)
        pipe.sismember(self.ledger.keys.active, self.job_id)
        for i in range(m.stages):
            pipe.zrange(k.ready(i), 0, -1)
        for seq in range(m.next_seq):
            pipe.hgetall(k.batch(seq))
            pipe.get(k.items(seq))
        res = pipe.execute()
        job, spec, leases, failed, done, active = res[:6]
        spec = archive.spec_fields(r, k, spec)  # a job at rest whose results are delivered folds it
        ready = res[6:6 + m.stages]
        rest = res[6 + m.stages:]
        batches = {seq: rest[2 * seq] for seq in range(m.next_seq)}
        items = {seq: rest[2 * seq + 1] for seq in range(m.next_seq)}

        # 7. compaction dropped only delivered records, and the sink holds each delivered batch once
        sink = r.hgetall(k.sink)
        compacted, offset = int(sink.get("seq") or 0), int(sink.get("off") or 0)
        assert compacted <= int(job["wm"]), "compacted above the watermark"
        for seq in range(compacted):
            b = m.batches[seq]
            assert b.status in ("completed", "superseded"), f"batch {seq} ({b.status}) compacted"
            assert not batches[seq] and items[seq] is None, f"compacted batch {seq} still has records"
            # stands in for the record in the checks below: what the model says it was
            batches[seq] = {"status": b.status, "stage": str(b.stage), "n_items": str(b.end - b.start),
                            "start_cursor": cursor(b.start), "end_cursor": b.end_json, "compacted": "1"}
        written = self.sink_path.read_bytes() if self.sink_path.exists() else b""
        assert len(written) >= offset
        lines = [json.loads(line) for line in written[:offset].decode().splitlines()]
        assert [line["seq"] for line in lines] == [s for s in range(compacted)
                                                   if m.batches[s].status == "completed"]
        assert [line["cursor"]["offset"] for line in lines] == [m.batches[s].start for s in range(compacted)
                                                                if m.batches[s].status == "completed"]
        assert int(sink.get("batches") or 0) == len(lines)
        if compacted:
            STATS["sink: records compacted"] += 1

        # 6. checksums, nothing corrupt
        assert intact(job), f"job record fails its checksum: {job}"
        assert intact(spec), "spec record fails its checksum"
        for seq, fields in batches.items():
            assert fields, f"batch {seq} is missing"
            assert fields.get("compacted") or intact(fields), f"batch {seq} fails its checksum: {fields}"

        # the model, field by field
        base, next_seq = int(job["base_seq"]), int(job["next_seq"])
        assert job["status"] == m.status
        assert (base, next_seq) == (m.base, m.next_seq)
        assert (job["frontier"], job["exhausted"] == "1") == (m.frontier_json, m.exhausted)
        assert job["plan_cursor"] == m.plan_cursor
        assert int(job["wm"]) == m.wm()
        assert job["committed_cursor"] == m.committed_cursor()
        for seq, b in m.batches.items():
            fields = batches[seq]
            if fields.get("compacted"):
                continue
            got = (fields["status"], int(fields["stage"]), int(fields["attempt"]), fields["lease_token"])
            assert got == (b.status, b.stage, b.attempt, b.rec_token), f"batch {seq}: {got} vs {b}"
            assert (fields["start_cursor"], fields["end_cursor"]) == (cursor(b.start), b.end_json)
            assert int(fields["n_items"]) == b.end - b.start
            assert int(fields.get("unspent") or 0) == b.unspent, f"batch {seq} unspent"
            for stage, (attempt, token) in b.commits.items():
                assert fields[f"c:{stage}"] == f"{attempt} {token}"
            # the per-stage status the batch view shows: 'running' only while leased, 'completed' once
            # committed
            for stage in range(m.stages):
                shown = fields.get(f"st:{stage}", "pending")
                assert (shown == "running") == (b.status == "leased" and b.stage == stage), \
                    f"batch {seq} ({b.status} at stage {b.stage}) shows stage {stage} {shown}"
                assert (shown == "completed") == (stage in b.commits), f"batch {seq} stage {stage} {shown}"
        assert bool(active) == m.active
        # what the view shows with the status: a live job has no end and no error; a finished one has an
        # end; only a held job shows why it is held
        assert bool(job["finished_ms"]) == (m.status in ("succeeded", "failed", "cancelled"))
        if m.status in (*LIVE, "succeeded"):
            assert job["error"] == "", f"a {m.status} job shows error {job['error']!r}"
        if m.status == "failed":
            assert job["error"]
        assert bool(job["held_reason"]) == (m.status == "held"), f"a {m.status} job shows a held reason"

        # 3. counters: a recount over the current plan; none negative; wm the first seq not completed
        plan = [batches[s] for s in range(base, next_seq)]
        recount = {"n_open": sum(b["status"] in ("pending", "leased") for b in plan),
                   "n_done": sum(b["status"] == "completed" for b in plan),
                   "n_failed": sum(b["status"] == "failed" for b in plan),
                   "items_done": sum(int(b["n_items"]) for b in plan if b["status"] == "completed")}
        assert {c: int(job[c]) for c in recount} == recount
        assert all(int(job[c]) >= 0 for c in recount)
        wm = base
        while wm < next_seq and batches[wm]["status"] == "completed":
            wm += 1
        assert int(job["wm"]) == wm
        assert recount == m.counters()

        # the indexes agree with the batch records
        statuses = {seq: batches[seq]["status"] for seq in range(base, next_seq)}
        assert sorted(leases, key=int) == [str(s) for s, st_ in statuses.items() if st_ == "leased"]
        assert sorted(failed, key=int) == [str(s) for s, st_ in statuses.items() if st_ == "failed"]
        assert sorted(done, key=int) == [str(s) for s, st_ in statuses.items()
                                         if st_ == "completed" and s > wm]
        if m.status != "cancelled":  # cancel voids leases to pending without queueing them
            for i in range(m.stages):
                want = [str(s) for s, st_ in statuses.items()
                        if st_ == "pending" and int(batches[s]["stage"]) == i]
                assert sorted(ready[i], key=int) == want, f"ready:{i}"
        for seq in range(next_seq):
            status = batches[seq]["status"]
            b = m.batches[seq]
            if status in ("completed", "superseded"):
                assert items[seq] is None, f"items of {status} batch {seq} kept"
            else:
                assert loads_or_none(items[seq]) == list(range(b.start, b.end))

        # the job view the API serves
        view = self.jobs.view(TENANT, self.job_id)
        assert view["corrupt"] is False and view["status"] == m.status
        assert view["committed_seq"] == wm - 1
        counts = dict(view["batches"])
        assert counts.pop("planned") in (next_seq, next_seq - base)  # all seqs, or the current plan's
        assert counts == {"completed": recount["n_done"], "failed": recount["n_failed"],
                          "open": recount["n_open"], "leased": len(leases)}
        assert view["items_done"] == recount["items_done"]

        # 2. the committed cursor only moves forward by commits, or by a replan
        cc = loads_or_none(job["committed_cursor"])
        offset = m.n if cc is None else cc["offset"]
        if not self.replanned:
            assert offset >= self.last_cursor_offset, "committed cursor moved backwards without a replan"
        self.last_cursor_offset = offset

        # 4. succeeded: every item of the current range committed at the last stage, but tolerated losses
        if m.status == "succeeded":
            start = loads_or_none(job["plan_cursor"])["offset"]
            covered = {}
            for fields in plan:
                b_start = loads_or_none(fields["start_cursor"])["offset"]
                for item in range(b_start, b_start + int(fields["n_items"])):
                    covered[item] = fields["status"]
            for item in range(start, m.n):
                assert covered.get(item) in ("completed", "failed"), f"item {item} not done at success"
                if covered[item] == "completed":
                    assert (item, m.stages - 1) in m.committed
            assert not m.over_budget(recount["n_failed"])

        # every control action that took effect is in the audit stream, once, in order; refused ones not
        # (a job at rest folds its streams into its past; a resume starts them afresh: archive.py)
        assert [f["event"] for _, f in archive.entries(r, k, "audit")] == self.audit

        # retention: only a finished job's keys may carry a TTL (the supervisor's retire): one that runs
        # again must not vanish mid-run; the recovery claim and the plan lock always expire by their own,
        # and so do the call journal's first answers (scripts.JOURNAL_MS)
        keys = r.keys(k.job.rsplit(":", 1)[0] + ":*")
        ttls = self.pipe_all(lambda pipe: [pipe.pttl(key) for key in keys])
        for key, ttl in zip(keys, ttls, strict=True):
            if key.endswith((":recover", ":planlock")):
                assert 0 < ttl <= 60_000, f"{key} of a {m.status} job: TTL {ttl}"
            elif ":call:" in key:
                assert 0 < ttl <= JOURNAL_MS, f"{key}: a call's first answer kept for {ttl} ms"
            elif m.status not in ("succeeded", "cancelled"):
                assert ttl == -1, f"{key} of a {m.status} job expires in {ttl} ms"

        # 5. succeeded and cancelled jobs change no more (a succeeded one only by a replan)
        if self.snapshot is not None and not self.replanned and not self.delivered:
            assert self.dump() == self.snapshot, f"a {self.snapshot_status} job changed"
        self.replanned = self.delivered = False
        if m.status in ("succeeded", "cancelled"):
            self.snapshot, self.snapshot_status = self.dump(), m.status
        else:
            self.snapshot = None


# == the tests ===========================================================================================

@pytest.fixture(scope="module")
def model_server(tmp_path_factory):
    """A redis-server of this module's own: the machine SIGKILLs and restarts it.

    ``appendfsync always``: every write is in the AOF before it is acknowledged. The data folder is on
    tmpfs (/dev/shm) where there is one, which makes those fsyncs free (5x faster steps); a SIGKILL, the
    crash under test, kills the process, not the page cache, so the AOF replay is tested all the same.
    """
    shm = Path("/dev/shm")
    data = Path(tempfile.mkdtemp(prefix="batchgate-model-", dir=shm)) if os.access(shm, os.W_OK) \
        else tmp_path_factory.mktemp("model-redis")
    server = EmbeddedRedis(data, fsync="always")
    server.start()
    yield server
    server.kill()
    server.stop()
    shutil.rmtree(data, ignore_errors=True)


def run_machine(server, data_dir, **profile):
    machine = type("Machine", (LedgerMachine,), {"server": server, "data_dir": data_dir})
    STATS.clear()
    run_state_machine_as_test(machine, settings=settings(
        deadline=None, derandomize=True, database=None, print_blob=True,
        # no 'explain' phase: it traces every line (sys.settrace), far too slow for a machine this size
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], **profile))
    if os.environ.get("BATCHGATE_MODEL_STATS") == "1":
        print("\n".join(f"{name}: {n}" for name, n in sorted(STATS.items())))


CI_PROFILE = {"max_examples": 250, "stateful_step_count": 50}


@pytest.mark.timeout(900)  # ~30 s on a quiet 2-core machine; room for a busy one
def test_ledger_model(model_server, tmp_path):
    """Fixed-seed run for CI (derandomized: the same examples every time)."""
    run_machine(model_server, tmp_path, **CI_PROFILE)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("BATCHGATE_SLOW") != "1", reason="set BATCHGATE_SLOW=1 to run")
def test_ledger_model_slow(model_server, tmp_path):
    """20x the CI profile's examples; skipped unless BATCHGATE_SLOW=1 (CI runs ``test_ledger_model``)."""
    run_machine(model_server, tmp_path, max_examples=CI_PROFILE["max_examples"] * 20,
                stateful_step_count=CI_PROFILE["stateful_step_count"])


def test_ledger_model_approvals(model_server, tmp_path):
    """Approvals: open (on commit, on a platform's wait, re-opened), decide, time out, next to pause,
    resume, retry-failed, re-plan and cancel (tests/approvals_model.py: its rules and invariants)."""
    from tests.approvals_model import ApprovalMachine

    machine = type("Machine", (ApprovalMachine,), {"server": model_server, "data_dir": tmp_path})
    run_state_machine_as_test(machine, settings=settings(
        deadline=None, derandomize=True, database=None, print_blob=True, max_examples=120,
        stateful_step_count=40, phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
