"""Each ledger Lua script called directly, with raw KEYS/ARGV exactly as its header comment documents.

gateway/ledger/lua/<op>.lua (lib.lua prepended) is run through ``ledger.scripts.<op>``; every test checks the
reply, the Redis state the script leaves behind, and that every record it wrote still passes its checksum.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from gateway.ledger.records import digest, dumps, intact

MAXLEN = 1000
ACTOR = "tester"


def cursor(offset):
    """A sequence source's cursor as the ledger stores it (compact, sorted JSON)."""
    return dumps({"type": "offset", "offset": offset})


def now_ms():
    return time.time() * 1000


def pick(record, *names):
    """The values of ``names`` in ``record``, as a tuple."""
    return tuple(record[n] for n in names)


class Job:
    """One job's keys, the standard KEYS lists of each script, and checksum-verified reads."""

    def __init__(self, ledger, job_id):
        self.ledger, self.r, self.id = ledger, ledger.r, job_id
        self.k = ledger.keys.job(job_id)
        spec = ledger.spec(job_id)
        self.stages = spec.stage_count
        self.budget = spec.budget_total
        self.pct = spec.flow.tolerated_failure_percentage
        self.ready = [self.k.ready(i) for i in range(self.stages)]

    # -- KEYS, in each header's order --------------------------------------------------------
    def plan_keys(self, seq, count=1):
        return [self.k.job, self.k.ready(0), self.k.log, self.k.leases, self.k.plan_lock,
                *[key for s in range(seq, seq + count) for key in (self.k.batch(s), self.k.items(s))],
                self.k.events]

    def lease_keys(self, *stages):
        return [self.k.job, self.k.leases, self.k.log, self.k.failed, self.k.plan_lock, self.k.src,
                *[self.k.ready(s) for s in stages], self.k.events]

    def heartbeat_keys(self, seq):
        return [self.k.job, self.k.batch(seq), self.k.leases, self.k.events]

    def complete_keys(self, seq):
        return [self.k.job, self.k.batch(seq), self.k.items(seq), self.k.leases, self.k.done, self.k.log,
                *self.ready, self.k.events]

    def fail_keys(self, seq):  # fail.lua and expire.lua take the same KEYS
        return [self.k.job, self.k.batch(seq), self.k.leases, self.k.failed, self.k.log, *self.ready,
                self.k.events]

    def reopen_keys(self, seqs):
        return [self.k.job, self.k.leases, self.k.failed, self.k.log, self.k.audit, *self.ready,
                *[self.k.batch(s) for s in seqs], self.k.events]

    def replan_keys(self, seqs):
        return [self.k.job, self.k.leases, self.k.failed, self.k.done, self.k.log, self.k.audit, *self.ready,
                *[key for s in seqs for key in (self.k.batch(s), self.k.items(s))]]

    # -- state -----------------------------------------------------------------------------------
    def record(self, key):
        fields = self.r.hgetall(key)
        assert fields, f"{key} is absent"
        assert intact(fields), f"{key} fails its checksum: {fields}"
        return fields

    def job(self):
        return self.record(self.k.job)

    def batch(self, seq):
        return self.record(self.k.batch(seq))

    def all_intact(self, skip=()):
        """The job record and every planned batch record pass their checksum."""
        job = self.job()
        for seq in range(int(job["next_seq"])):
            if seq not in skip and self.r.exists(self.k.batch(seq)):
                self.batch(seq)
        return True

    def events(self, name=None):
        return [f for _, f in self.r.xrange(self.k.log) if name is None or f["event"] == name]

    def zmembers(self, key):
        return self.r.zrange(key, 0, -1)


@pytest.fixture
def job(ledger, make_job):
    """``job(**make_job_kwargs)`` -> a Job view over a freshly made job.

    The ledger plans one batch at a time here (``plan_ahead = 1``), so a ``ledger.lease`` that plans
    leaves the frontier where the raw ``plan`` calls of a test expect it; planning ahead has its own
    tests below."""
    ledger.plan_ahead = 1
    return lambda **kw: Job(ledger, make_job(**kw))


# -- thin wrappers: ARGV in each header's order ------------------------------------------------------

def plan(j, seq, frontier, end, exhausted="0", items=None, n_items=None):
    """plan.lua cutting one batch and leasing none; an 'ok' reply without its batch count (always 1)."""
    items_json = "" if items is None else dumps(items)
    count = len(items or ()) if n_items is None else n_items
    res = j.ledger.scripts.plan(keys=j.plan_keys(seq), args=[
        seq, frontier, "", MAXLEN, j.budget, j.pct, "", 60_000, 4, 1, end, exhausted, items_json, count])
    if res[0] == "ok":
        assert res == ["ok", str(seq), "1"]
        return res[:2]
    return res


def plan_many(j, seq, frontier, batches, token="", holder="", lease_ms=60_000, concurrency=4):
    """plan.lua cutting len(batches) batches; ``batches`` = (end cursor, exhausted, items) each."""
    args = [v for end, exhausted, items in batches
            for v in (end, exhausted, "" if items is None else dumps(items), len(items or ()))]
    return j.ledger.scripts.plan(keys=j.plan_keys(seq, len(batches)), args=[
        seq, frontier, holder, MAXLEN, j.budget, j.pct, token, lease_ms, concurrency, len(batches), *args])


def plan_next(j, n=3, exhausted="0"):
    """Plan the next batch at the job's own next_seq and frontier (offset cursors); returns its seq."""
    job = j.job()
    seq, start = int(job["next_seq"]), json_offset(job["frontier"])
    res = plan(j, seq, job["frontier"], cursor(start + n), exhausted, items=list(range(start, start + n)))
    assert res == ["ok", str(seq)]
    return seq


def json_offset(text):
    return json.loads(text)["offset"]


def lease_raw(j, token, stages=(0,), lease_ms=60_000, concurrency=4, holder="", prefetch=0):
    """lease.lua offered ``stages`` (latest first, as the ledger orders them); plans only with a holder."""
    pairs = [v for s in stages for v in (s, lease_ms)]
    return j.ledger.scripts.lease(keys=j.lease_keys(*stages), args=[
        token, concurrency, MAXLEN, j.budget, j.pct, holder, 30_000, prefetch, len(stages), *pairs])


def lease(j, seq, token, stage=0, lease_ms=60_000, concurrency=4):
    """lease.lua offered one stage, never planning; an 'ok' reply is checked to name ``seq`` and ``stage``
    and returned without them."""
    res = lease_raw(j, token, (stage,), lease_ms, concurrency)
    if res[0] == "ok":
        assert res[1:3] == [str(seq), str(stage)]
        return [res[0], *res[3:]]
    return res


def heartbeat(j, seq, token, extend_ms, progress=""):
    return j.ledger.scripts.heartbeat(keys=j.heartbeat_keys(seq), args=[token, extend_ms, progress])


def complete(j, seq, token, output=None, next_cursor="", items=None, pct=None):
    items_json = "" if items is None else dumps(items)
    return j.ledger.scripts.complete(keys=j.complete_keys(seq), args=[
        token, dumps(output if output is not None else {}), next_cursor, items_json, len(items or ()),
        j.stages, MAXLEN, j.budget, j.pct if pct is None else pct, "0", ACTOR])


def fail(j, seq, token, message="boom", retryable="1", max_attempts=3, initial_ms=1000, coef=2.0,
         max_ms=60_000, jitter=0.5, pct=None):
    return j.ledger.scripts.fail(keys=j.fail_keys(seq), args=[
        token, message, retryable, max_attempts, initial_ms, coef, max_ms, jitter, MAXLEN, j.budget,
        j.pct if pct is None else pct, ACTOR])


def expire(j, seq, max_attempts=3, initial_ms=1000, coef=2.0, max_ms=60_000, jitter=0.5):
    return j.ledger.scripts.expire(keys=j.fail_keys(seq), args=[
        seq, max_attempts, initial_ms, coef, max_ms, jitter, MAXLEN, j.budget, j.pct, ACTOR])


def reopen(j, mode, seqs):
    """mode 'all' resumes; 'failed' retries failed batches (the failed set as ``seqs``)."""
    return j.ledger.scripts.reopen(keys=j.reopen_keys(seqs), args=[
        j.stages, MAXLEN, ACTOR, "resume" if mode == "all" else "retry_failed", j.budget, j.pct,
        len(seqs), *seqs])


def replan(j, to_cursor, seqs, reason="skip a bad range", bound=None):
    bound = (max(seqs) + 1 if seqs else int(j.job()["next_seq"])) if bound is None else bound
    return j.ledger.scripts.replan(keys=j.replan_keys(seqs), args=[
        j.stages, to_cursor, MAXLEN, ACTOR, reason, bound, *seqs])


def set_status(j, status, allowed):
    return j.ledger.scripts.set_status(keys=[j.k.job, j.k.log, j.k.audit, j.k.events],
                                       args=[status, allowed, MAXLEN, ACTOR, "", j.budget, j.pct])


# == plan ============================================================================================

def test_plan_ok_creates_batch_ready_and_moves_frontier(job):
    j = job(items=10, max_items=3)
    before = math.floor(now_ms())
    res = plan(j, 0, cursor(0), cursor(3), "0", items=[0, 1, 2])
    assert res == ["ok", "0"]
    batch = j.batch(0)
    assert {f: batch[f] for f in ("seq", "status", "stage", "attempt", "start_cursor", "end_cursor",
                                  "n_items", "lease_token", "deadline_ms", "error")} == {
        "seq": "0", "status": "pending", "stage": "0", "attempt": "0", "start_cursor": cursor(0),
        "end_cursor": cursor(3), "n_items": "3", "lease_token": "", "deadline_ms": "", "error": ""}
    assert j.r.get(j.k.items(0)) == "[0,1,2]"
    assert j.zmembers(j.k.ready(0)) == ["0"]
    assert before <= j.r.zscore(j.k.ready(0), "0") <= math.ceil(now_ms())
    state = j.job()
    assert pick(state, "next_seq", "n_open", "frontier", "exhausted", "blocked") == (
        "1", "1", cursor(3), "0", "")
    assert j.events("planned")[-1] == {"event": "planned", "seq": "0", "items": "3", "cursor": cursor(0)}
    assert j.all_intact()


def test_plan_without_end_cursor_blocks_the_frontier(job):
    j = job(source={"type": "external"}, stage_defs=[{"name": "fetch", "fetches": True}])
    frontier = j.job()["frontier"]
    assert plan(j, 0, frontier, "", "0") == ["ok", "0"]
    state = j.job()
    assert pick(state, "blocked", "frontier", "next_seq") == ("0", frontier, "1")
    assert j.batch(0)["end_cursor"] == ""
    assert not j.r.exists(j.k.items(0))
    assert plan(j, 1, frontier, "", "0") == ["raced"]  # nobody plans past a blocked batch
    assert j.all_intact()


@pytest.mark.parametrize("seq, frontier", [(1, cursor(0)), (0, cursor(3))], ids=["next_seq", "frontier"])
def test_plan_raced_on_wrong_expectation(job, seq, frontier):
    j = job(items=10, max_items=3)
    before = j.job()
    assert plan(j, seq, frontier, cursor(6), "0", items=[3, 4, 5]) == ["raced"]
    assert j.job() == before
    assert not j.r.exists(j.k.batch(seq))
    assert j.zmembers(j.k.ready(0)) == []


def test_plan_exhausted_with_zero_items(job):
    j = job(items=10, max_items=3)
    assert plan(j, 0, cursor(0), "null", "1", items=[]) == ["exhausted"]
    state = j.job()
    assert state["exhausted"] == "1" and state["next_seq"] == "0"
    assert state["status"] == "succeeded"  # nothing planned, nothing open: the job is done
    assert not j.r.exists(j.k.batch(0))
    assert j.events("source_exhausted") == [{"event": "source_exhausted", "seq": "0"}]
    assert j.all_intact()


def test_plan_status_when_paused(job):
    j = job(items=10, max_items=3)
    assert set_status(j, "paused", "running") == ["ok", "running"]
    assert plan(j, 0, cursor(0), cursor(3), "0", items=[0, 1, 2]) == ["status", "paused"]
    assert not j.r.exists(j.k.batch(0))


# == lease ===========================================================================================

def test_lease_ok_returns_fields_and_moves_batch_to_leases(job):
    j = job(items=10, max_items=3)
    seq = plan_next(j)
    before = math.floor(now_ms())
    res = lease(j, seq, "tok-1", lease_ms=30_000)
    after = math.ceil(now_ms())
    assert res[0] == "ok" and res[1] == "1"
    deadline = int(res[2])
    assert before + 30_000 <= deadline <= after + 30_000
    assert res[3:] == [cursor(0), cursor(3), "[0,1,2]", "", "0"]  # ..., input, generation
    batch = j.batch(seq)
    assert pick(batch, "status", "attempt", "lease_token", "deadline_ms", "st:0") == (
        "leased", "1", "tok-1", str(deadline), "running")
    assert j.zmembers(j.k.ready(0)) == []
    assert j.r.zscore(j.k.leases, str(seq)) == deadline
    assert j.events("stage_started") == [{"event": "stage_started", "seq": "0", "stage": "0", "attempt": "1"}]
    assert j.all_intact()


def test_lease_of_second_stage_returns_previous_output_as_input(ledger, job):
    j = job(items=10, max_items=3)
    first = ledger.lease(j.id)
    assert complete(j, 0, first.lease_token, {"scores": [1]})[0] == "ok"
    res = lease(j, 0, "tok-2", stage=1)
    assert res[0] == "ok" and res[1] == "1"  # the attempt counts per stage
    assert res[5:] == ['[0,1,2]', '{"scores":[1]}', "0"]
    assert j.batch(0)["st:1"] == "running"


def test_lease_busy_at_concurrency(ledger, job):
    j = job(items=10, max_items=3)
    ledger.lease(j.id)
    seq = plan_next(j)
    assert lease(j, seq, "tok-2", concurrency=1) == ["busy"]
    assert j.batch(seq)["status"] == "pending"
    assert j.zmembers(j.k.ready(0)) == [str(seq)]


def test_lease_none_when_nothing_is_ready_at_the_stage(job):
    j = job(items=10, max_items=3)
    plan_next(j)
    assert lease(j, 0, "tok", stage=1) == ["none"]  # seq 0 waits for stage 0, not 1
    assert j.batch(0)["status"] == "pending"
    assert not j.r.exists(j.k.plan_lock)  # no holder given: never plans


def test_lease_none_while_backoff_is_in_the_future(ledger, job):
    j = job(items=10, max_items=3)
    first = ledger.lease(j.id)
    assert fail(j, 0, first.lease_token, initial_ms=60_000)[0] == "retry"
    assert lease(j, 0, "tok-2") == ["none"]
    assert j.zmembers(j.k.ready(0)) == ["0"]  # still waiting, not dropped
    assert j.batch(0)["status"] == "pending"


def test_lease_status_for_paused_job(job):
    j = job(items=10, max_items=3)
    seq = plan_next(j)
    set_status(j, "paused", "running")
    assert lease(j, seq, "tok") == ["status", "paused"]
    assert j.batch(seq)["status"] == "pending"


def test_lease_tampered_batch_is_corrupt_and_counted_failed(job):
    j = job(items=10, max_items=3, tolerated_failure_percentage=100)
    seq = plan_next(j)
    j.r.hset(j.k.batch(seq), "start_cursor", cursor(999))
    assert lease(j, seq, "tok") == ["none"]  # the only candidate was corrupt: nothing leased
    assert j.r.hget(j.k.batch(seq), "corrupt") == "1"
    assert j.zmembers(j.k.ready(0)) == []
    assert j.zmembers(j.k.failed) == [str(seq)]
    assert j.zmembers(j.k.leases) == []
    state = j.job()
    assert pick(state, "n_failed", "n_open", "status") == ("1", "0", "running")
    assert j.events("batch_corrupt") == [
        {"event": "batch_corrupt", "seq": str(seq), "error": "checksum mismatch"}]
    assert j.all_intact(skip={seq})


def test_lease_tampered_job_is_corrupt(job):
    j = job(items=10, max_items=3)
    seq = plan_next(j)
    j.r.hset(j.k.job, "wm", "5")
    assert lease(j, seq, "tok") == ["corrupt", "job"]
    assert j.r.hget(j.k.job, "corrupt") == "1"
    assert j.batch(seq)["status"] == "pending"


def test_lease_corrupt_batch_spends_the_failure_budget_now(job):
    j = job(items=10, max_items=3, tolerated_failure_percentage=0)
    seq = plan_next(j)
    j.r.hset(j.k.batch(seq), "n_items", "0")
    assert lease(j, seq, "tok") == ["status", "failed"]
    state = j.job()
    assert state["n_failed"] == "1"
    assert state["status"] == "failed"  # as fail.lua does: "failure budget exceeded at batch 0"


def test_lease_takes_the_latest_stage_first_and_drops_stale_ready_entries(ledger, job):
    j = job(items=10, max_items=3)
    first = ledger.lease(j.id)
    assert complete(j, 0, first.lease_token, {"a": 1})[0] == "ok"  # batch 0 waits for stage 1
    plan_next(j)  # batch 1 waits for stage 0
    j.r.zadd(j.k.ready(1), {"1": 0})  # an entry of a batch that is not pending at stage 1: ordered first
    res = lease_raw(j, "tok", stages=(1, 0))
    assert res[:3] == ["ok", "0", "1"]
    assert j.zmembers(j.k.ready(1)) == []  # the stale entry went, the leased one too
    assert lease_raw(j, "tok-2", stages=(1, 0))[:3] == ["ok", "1", "0"]
    assert j.all_intact()


def test_lease_with_nothing_ready_takes_the_plan_lock_once(job):
    j = job(items=list(range(10)), max_items=3)
    res = lease_raw(j, "tok", holder="me", prefetch=7)
    # the frontier, and the src list's length and items from the frontier's offset for reading ahead
    assert res == ["plan", "0", cursor(0), 10, *[dumps(i) for i in range(7)]]
    assert j.r.get(j.k.plan_lock) == "me" and 0 < j.r.pttl(j.k.plan_lock) <= 30_000
    assert lease_raw(j, "tok-2", holder="you") == ["planning"]  # one planner reads the source
    assert j.r.get(j.k.plan_lock) == "me"
    assert plan_many(j, 0, cursor(0), [(cursor(3), "0", [0, 1, 2])], holder="me")[0] == "ok"
    assert not j.r.exists(j.k.plan_lock)  # released by the plan


def test_lease_answers_none_when_there_is_nothing_to_plan(ledger, job):
    j = job(items=3, max_items=3)
    ledger.lease(j.id)  # plans the only batch: the source is exhausted
    assert lease_raw(j, "tok", holder="me") == ["none"]
    assert not j.r.exists(j.k.plan_lock)


def test_lease_waits_out_a_failing_source(job):
    j = job(items=10, max_items=3)
    retry_at = int(now_ms()) + 60_000
    j.ledger.scripts.source_fail(keys=[j.k.job, j.k.log, j.k.audit, j.k.events],
                                 args=["down", "1", 5, 60_000, 1.0, 60_000, 0.999, MAXLEN])
    res = lease_raw(j, "tok", holder="me")
    assert res[0] == "source_wait" and abs(int(res[1]) - retry_at) < 5_000 and res[2] == "down"
    assert not j.r.exists(j.k.plan_lock)


def test_plan_ahead_cuts_chained_batches_and_leases_the_first(job):
    j = job(items=10, max_items=3)
    j.r.set(j.k.plan_lock, "me", px=30_000)
    before = math.floor(now_ms())
    res = plan_many(j, 0, cursor(0), [(cursor(3), "0", [0, 1, 2]), (cursor(6), "0", [3, 4, 5]),
                                      ("null", "1", [6, 7, 8, 9])], token="tok", holder="me", lease_ms=5_000)
    assert res[:4] == ["ok", "0", "3", "1"]
    assert before + 5_000 <= int(res[4]) <= math.ceil(now_ms()) + 5_000
    assert res[5:] == [cursor(0), cursor(3), "[0,1,2]", "0"]  # ..., items, generation
    assert not j.r.exists(j.k.plan_lock)
    assert pick(j.batch(0), "status", "attempt", "lease_token", "st:0") == ("leased", "1", "tok", "running")
    assert [pick(j.batch(s), "status", "start_cursor", "end_cursor", "n_items") for s in (1, 2)] == [
        ("pending", cursor(3), cursor(6), "3"), ("pending", cursor(6), "null", "4")]
    assert j.zmembers(j.k.ready(0)) == ["1", "2"]
    assert j.zmembers(j.k.leases) == ["0"]
    assert j.r.get(j.k.items(2)) == "[6,7,8,9]"
    state = j.job()
    assert pick(state, "next_seq", "n_open", "frontier", "exhausted") == ("3", "3", "null", "1")
    assert [e["seq"] for e in j.events("planned")] == ["0", "1", "2"]
    assert j.events("stage_started") == [{"event": "stage_started", "seq": "0", "stage": "0", "attempt": "1"}]
    assert j.all_intact()


def test_plan_ahead_leases_nothing_at_concurrency_and_refuses_a_broken_chain(job):
    j = job(items=10, max_items=3)
    j.r.zadd(j.k.leases, {"99": 0})  # one lease held: concurrency 1 reached
    res = plan_many(j, 0, cursor(0), [(cursor(3), "0", [0, 1, 2]), (cursor(6), "0", [3, 4, 5])],
                    token="tok", concurrency=1)
    assert res == ["ok", "0", "2"]
    assert j.zmembers(j.k.ready(0)) == ["0", "1"]
    j.r.zrem(j.k.leases, "99")
    before = j.job()
    with pytest.raises(Exception, match="only the last batch"):
        plan_many(j, 2, cursor(6), [("null", "1", [6, 7, 8, 9]), (cursor(12), "0", [1])])
    assert j.job() == before and not j.r.exists(j.k.batch(2))


def test_plan_lock_of_another_holder_is_left_alone(job):
    j = job(items=10, max_items=3)
    j.r.set(j.k.plan_lock, "other", px=30_000)
    assert plan_many(j, 0, cursor(1), [(cursor(3), "0", [1, 2])], holder="me") == ["raced"]
    assert j.r.get(j.k.plan_lock) == "other"


# == heartbeat =======================================================================================

def test_heartbeat_ok_extends_deadline_and_leases_score(job):
    j = job(items=10, max_items=3)
    seq = plan_next(j)
    first = int(lease(j, seq, "tok", lease_ms=1_000)[2])
    res = heartbeat(j, seq, "tok", 60_000, dumps({"done": 2}))
    deadline = int(res[1])
    assert res == ["ok", str(deadline), "running"]
    assert deadline >= first + 59_000
    batch = j.batch(seq)
    assert batch["deadline_ms"] == str(deadline) and batch["progress"] == '{"done":2}'
    assert j.r.zscore(j.k.leases, str(seq)) == deadline
    heartbeat(j, seq, "tok", 60_000, "")  # '' keeps the progress
    assert j.batch(seq)["progress"] == '{"done":2}'
    assert j.all_intact()


def test_heartbeat_stale_with_wrong_token(job):
    j = job(items=10, max_items=3)
    seq = plan_next(j)
    lease(j, seq, "tok")
    before = j.batch(seq)
    assert heartbeat(j, seq, "not-the-token", 60_000) == ["stale", "leased", "1"]
    assert j.batch(seq) == before
    assert heartbeat(j, 7, "tok", 60_000) == ["missing"]


def test_heartbeat_never_moves_deadline_backwards(job):
    j = job(items=10, max_items=3)
    seq = plan_next(j)
    deadline = lease(j, seq, "tok", lease_ms=60_000)[2]
    assert heartbeat(j, seq, "tok", 10) == ["ok", deadline, "running"]
    assert j.batch(seq)["deadline_ms"] == deadline
    assert j.r.zscore(j.k.leases, str(seq)) == int(deadline)
    assert j.all_intact()


# == complete ========================================================================================

def test_complete_ok_advances_stage_then_commits(ledger, job):
    j = job(items=list("abcdef"), max_items=3)
    first = ledger.lease(j.id)
    assert complete(j, 0, first.lease_token, {"scores": [1, 2, 3]}) == ["ok", "1", "running", "1", "0"]
    batch = j.batch(0)
    assert pick(batch, "stage", "status", "attempt", "st:0", "out:0", "c:0") == (
        "1", "pending", "0", "completed", '{"scores":[1,2,3]}', f"1 {first.lease_token}")
    assert j.zmembers(j.k.leases) == [] and j.zmembers(j.k.ready(1)) == ["0"]
    assert j.job()["n_done"] == "0"  # between stages the job record is untouched

    assert lease(j, 0, "tok-store", stage=1)[0] == "ok"
    assert complete(j, 0, "tok-store", {"stored": True}) == ["ok", "-1", "running", "1", "1"]
    batch = j.batch(0)
    assert pick(batch, "status", "st:1", "c:1") == ("completed", "completed", "1 tok-store")
    assert batch["completed_ms"]
    assert not j.r.exists(j.k.items(0))
    state = j.job()
    assert pick(state, "n_done", "n_open", "items_done", "wm", "committed_cursor") == (
        "1", "0", "3", "1", batch["end_cursor"])
    assert [e["stage"] for e in j.events("stage_completed")] == ["0", "1"]
    assert j.all_intact()


def test_complete_between_stages_reports_a_pause_taken_meanwhile(ledger, job):
    """Issue 15: the worker logged job_status=running for an answer committed after a pause."""
    j = job(items=list("abcdef"), max_items=3)
    first = ledger.lease(j.id)
    ledger.pause(j.id, "op")
    assert complete(j, 0, first.lease_token, {"scores": [1]}) == ["ok", "1", "paused", "1", "0"]


def test_complete_last_batch_finishes_the_job(ledger, job):
    j = job(items=3, max_items=3, stages=("only",))
    first = ledger.lease(j.id)  # plans [0,3) and sees the source end
    assert j.job()["exhausted"] == "1"
    assert complete(j, 0, first.lease_token) == ["ok", "-1", "succeeded", "1", "0"]
    state = j.job()
    assert state["status"] == "succeeded" and state["finished_ms"]
    assert state["committed_cursor"] == "null"
    assert j.all_intact()


def test_complete_duplicate_returns_committing_attempt(ledger, job):
    j = job(items=10, max_items=3)
    first = ledger.lease(j.id)
    assert fail(j, 0, first.lease_token, initial_ms=0)[0] == "retry"  # ready again at once
    assert lease(j, 0, "tok-2")[:2] == ["ok", "2"]
    assert complete(j, 0, "tok-2", {"x": 1})[0] == "ok"
    before = j.batch(0)
    assert complete(j, 0, "tok-2", {"x": 2}) == ["duplicate", "0", "2"]
    assert j.batch(0) == before  # the first output stands
    lease(j, 0, "tok-3", stage=1)  # a later stage's holder does not hide the earlier commit
    assert complete(j, 0, "tok-2", {"x": 3}) == ["duplicate", "0", "2"]
    assert complete(j, 0, first.lease_token) == ["stale", "leased", "1"]  # attempt 1 never committed


def test_complete_stale_with_wrong_token(ledger, job):
    j = job(items=10, max_items=3)
    ledger.lease(j.id)
    before_batch, before_job = j.batch(0), j.job()
    assert complete(j, 0, "not-the-token") == ["stale", "leased", "1"]
    assert (j.batch(0), j.job()) == (before_batch, before_job)
    assert j.zmembers(j.k.leases) == ["0"]
    assert j.events("stage_completed") == []


def test_complete_invalid_when_items_sent_after_first_stage(ledger, job):
    j = job(items=10, max_items=3)
    first = ledger.lease(j.id)
    complete(j, 0, first.lease_token)
    lease(j, 0, "tok-store", stage=1)
    before = j.batch(0)
    res = complete(j, 0, "tok-store", items=[1, 2])
    assert res == ["invalid", "only the first (fetching) stage may send items"]
    assert j.batch(0) == before
    assert j.r.get(j.k.items(0)) == "[0,1,2]"


def test_complete_fetch_stage_stores_items_and_unblocks_frontier(job):
    j = job(source={"type": "external", "start": {"page": 1}},
            stage_defs=[{"name": "fetch", "fetches": True}])
    assert plan(j, 0, j.job()["frontier"], "", "0") == ["ok", "0"]
    lease(j, 0, "tok")
    res = complete(j, 0, "tok", {"got": 2}, next_cursor='{"page":2}', items=["x", "y"])
    assert res == ["ok", "-1", "running", "1", "0"]
    batch = j.batch(0)
    assert pick(batch, "end_cursor", "n_items") == ('{"page":2}', "2")
    state = j.job()
    assert pick(state, "blocked", "frontier", "items_done", "committed_cursor") == (
        "", '{"page":2}', "2", '{"page":2}')
    assert j.all_intact()


def test_complete_watermark_sweeps_out_of_order_completions(ledger, job):
    j = job(items=12, max_items=3, stages=("only",))
    leases = [ledger.lease(j.id) for _ in range(4)]
    ends = {lease.seq: dumps(lease.end_cursor) for lease in leases}
    for seq in (2, 1):
        assert complete(j, seq, leases[seq].lease_token)[0] == "ok"
    assert j.r.hgetall(j.k.done) == {"1": ends[1], "2": ends[2]}
    assert j.job()["wm"] == "0"
    assert complete(j, 0, leases[0].lease_token)[0] == "ok"
    state = j.job()
    assert pick(state, "wm", "committed_cursor") == ("3", ends[2])
    assert j.r.hgetall(j.k.done) == {}
    assert complete(j, 3, leases[3].lease_token) == ["ok", "-1", "succeeded", "1", "0"]
    assert j.job()["wm"] == "4"
    assert j.all_intact()


# == fail ============================================================================================

@pytest.mark.parametrize("jitter", [0.0, 0.5, 0.999])
def test_fail_retry_schedules_ready_within_backoff_window(ledger, job, jitter):
    j = job(items=10, max_items=3)
    first = ledger.lease(j.id)
    before = math.floor(now_ms())
    res = fail(j, 0, first.lease_token, "timeout", "1", max_attempts=3, initial_ms=1000, coef=2.0,
               max_ms=60_000, jitter=jitter)
    after = math.ceil(now_ms())
    assert res == ["retry", "1", "running"]
    d = 1000 * 2.0 ** (1 - 1)  # backoff_ms: min(initial * coef^(attempt-1), max)
    score = j.r.zscore(j.k.ready(0), "0")
    assert before + 0.5 * d <= score <= after + d
    batch = j.batch(0)
    assert pick(batch, "status", "ready_ms", "lease_token", "deadline_ms", "error", "st:0", "attempt") == (
        "pending", str(int(score)), "", "", "timeout", "failed", "1")
    assert j.zmembers(j.k.leases) == []
    assert j.events("retry_scheduled") == [{"event": "retry_scheduled", "seq": "0", "stage": "0",
                                            "attempt": "1", "error": "timeout", "retryable": "1",
                                            "actor": ACTOR}]
    assert j.all_intact()


def test_fail_retry_backoff_grows_and_is_capped(ledger, job):
    j = job(items=10, max_items=3)
    first = ledger.lease(j.id)
    fail(j, 0, first.lease_token, initial_ms=0)
    assert lease(j, 0, "tok-2")[:2] == ["ok", "2"]
    before = math.floor(now_ms())
    assert fail(j, 0, "tok-2", initial_ms=1000, coef=3.0, max_ms=2500, jitter=0.999)[0] == "retry"
    after = math.ceil(now_ms())
    d = min(1000 * 3.0 ** (2 - 1), 2500)
    assert before + 0.5 * d <= j.r.zscore(j.k.ready(0), "0") <= after + d


def test_fail_fatal_goes_to_failed_zset(ledger, job):
    j = job(items=10, max_items=3, tolerated_failure_percentage=50)
    first = ledger.lease(j.id)
    assert fail(j, 0, first.lease_token, "bad input", "0") == ["failed", "1", "running"]
    batch = j.batch(0)
    assert pick(batch, "status", "st:0", "error", "lease_token") == (
        "failed", "failed", "bad input", "")
    assert j.r.zrange(j.k.failed, 0, -1, withscores=True) == [("0", 0.0)]
    assert j.zmembers(j.k.ready(0)) == [] and j.zmembers(j.k.leases) == []
    state = j.job()
    assert pick(state, "n_failed", "n_open", "status") == ("1", "0", "running")
    assert j.events("batch_failed")[0]["retryable"] == "0"
    assert j.all_intact()


def test_fail_out_of_attempts_fails_for_good(ledger, job):
    j = job(items=10, max_items=3, tolerated_failure_percentage=50)
    first = ledger.lease(j.id)
    assert fail(j, 0, first.lease_token, "timeout", "1", max_attempts=1) == ["failed", "1", "running"]
    assert j.zmembers(j.k.failed) == ["0"]


def test_fail_over_budget_fails_the_job(ledger, job):
    j = job(items=10, max_items=3, tolerated_failure_percentage=0)
    first = ledger.lease(j.id)
    assert fail(j, 0, first.lease_token, "bad", "0") == ["failed", "1", "failed"]
    state = j.job()
    assert state["status"] == "failed" and state["error"] == "failure budget exceeded at batch 0"
    assert state["finished_ms"]
    assert j.all_intact()


def test_fail_stale_with_wrong_token(ledger, job):
    j = job(items=10, max_items=3)
    ledger.lease(j.id)
    before = j.batch(0)
    assert fail(j, 0, "not-the-token") == ["stale", "leased", "1"]
    assert j.batch(0) == before


def test_fail_of_blocking_fetch_batch_does_not_strand_the_job(job):
    j = job(source={"type": "external"}, stage_defs=[{"name": "fetch", "fetches": True}],
            tolerated_failure_percentage=100)
    frontier = j.job()["frontier"]
    assert plan(j, 0, frontier, "", "0") == ["ok", "0"]
    lease(j, 0, "tok")
    assert fail(j, 0, "tok", "platform said no", "0")[0] == "failed"
    state = j.job()
    # the next cursor is unknown, so the job cannot go on: it fails (retry-failed can re-open batch 0)
    assert state["status"] == "failed" and "batch 0" in state["error"]
    assert plan(j, 1, frontier, "", "0") == ["status", "failed"]
    assert reopen(j, "failed", [0])[:2] == ["ok", "1"]
    assert j.job()["status"] == "running" and j.job()["blocked"] == "0"


# == expire ==========================================================================================

def test_expire_alive_before_deadline(job):
    j = job(items=10, max_items=3)
    seq = plan_next(j)
    lease(j, seq, "tok", lease_ms=60_000)
    before = j.batch(seq)
    assert expire(j, seq) == ["alive"]
    assert j.batch(seq) == before and j.zmembers(j.k.leases) == [str(seq)]


def test_expire_retry_after_deadline_then_alive(job):
    j = job(items=10, max_items=3)
    seq = plan_next(j)
    lease(j, seq, "tok", lease_ms=1)
    time.sleep(0.01)
    assert expire(j, seq) == ["retry", "1"]
    batch = j.batch(seq)
    assert pick(batch, "status", "error", "lease_token") == ("pending", "lease expired", "")
    assert j.zmembers(j.k.leases) == [] and j.zmembers(j.k.ready(0)) == [str(seq)]
    assert expire(j, seq) == ["alive"]  # no double expiry
    assert len(j.events("retry_scheduled")) == 1
    assert complete(j, seq, "tok")[0] == "stale"  # the old holder's token is void
    assert j.all_intact()


def test_expire_out_of_attempts_fails_batch(job):
    j = job(items=10, max_items=3, tolerated_failure_percentage=100)
    seq = plan_next(j)
    lease(j, seq, "tok", lease_ms=1)
    time.sleep(0.01)
    assert expire(j, seq, max_attempts=1) == ["failed", "1"]
    assert j.zmembers(j.k.failed) == [str(seq)]
    assert j.events("batch_failed")[0]["error"] == "lease expired"
    assert j.all_intact()


# == reopen ==========================================================================================

def failed_and_leased(ledger, j):
    """Batch 0 failed for good, batch 1 leased at stage 1 (stage 0 committed)."""
    first = ledger.lease(j.id)
    second = ledger.lease(j.id)
    assert (first.seq, second.seq) == (0, 1)
    fail(j, 0, first.lease_token, "bad", "0")
    complete(j, 1, second.lease_token, {"s": 1})
    assert lease(j, 1, "tok-store", stage=1)[0] == "ok"


def test_reopen_failed_mode_only_touches_failed_batches(ledger, job):
    j = job(items=10, max_items=3, tolerated_failure_percentage=100)
    failed_and_leased(ledger, j)
    leased_before = j.batch(1)
    assert reopen(j, "failed", [0, 1]) == ["raced"]  # the failed set holds only 0: read it again
    assert reopen(j, "failed", [0]) == ["ok", "1", "running"]
    batch = j.batch(0)
    assert pick(batch, "status", "attempt", "lease_token") == ("pending", "0", "")
    assert j.zmembers(j.k.failed) == [] and j.zmembers(j.k.ready(0)) == ["0"]
    assert j.batch(1) == leased_before and j.zmembers(j.k.leases) == ["1"]
    state = j.job()
    assert pick(state, "n_failed", "n_open") == ("0", "2")
    assert j.events("batch_reopened") == [{"event": "batch_reopened", "seq": "0", "stage": "0",
                                           "was": "failed", "actor": ACTOR}]
    assert j.events("retry_failed")[-1]["reopened"] == "1"
    assert j.all_intact()


def test_reopen_all_also_takes_back_leases(ledger, job):
    j = job(items=10, max_items=3, tolerated_failure_percentage=100)
    failed_and_leased(ledger, j)
    assert reopen(j, "all", [0, 1]) == ["ok", "2", "running"]
    batch = j.batch(1)
    assert pick(batch, "status", "stage", "lease_token", "deadline_ms") == (
        "pending", "1", "", "")
    assert batch["out:0"] == '{"s":1}'  # the committed stage is kept
    assert j.zmembers(j.k.leases) == []
    assert j.zmembers(j.k.ready(0)) == ["0"] and j.zmembers(j.k.ready(1)) == ["1"]  # first uncommitted stage
    assert complete(j, 1, "tok-store")[0] == "stale"
    assert [e["was"] for e in j.events("batch_reopened")] == ["failed", "leased"]
    assert j.all_intact()


def test_reopen_failed_mode_revives_a_budget_failed_job(ledger, job):
    j = job(items=10, max_items=3)
    first = ledger.lease(j.id)
    fail(j, 0, first.lease_token, "bad", "0")
    assert j.job()["status"] == "failed"
    assert reopen(j, "failed", [0]) == ["ok", "1", "running"]
    state = j.job()
    assert pick(state, "finished_ms", "error") == ("", "")


def test_retry_failed_never_unpauses_and_resume_of_a_paused_job_only_runs_it(ledger, job):
    j = job(items=10, max_items=3, tolerated_failure_percentage=100)
    failed_and_leased(ledger, j)
    set_status(j, "paused", "running")
    assert reopen(j, "failed", [0]) == ["ok", "1", "paused"]
    leased_before = j.batch(1)
    assert reopen(j, "all", [0, 1]) == ["ok", "0", "running"]  # in-flight leases are kept
    assert j.batch(1) == leased_before
    assert j.all_intact()


def test_reopen_all_with_nothing_left_finishes_the_job(ledger, job):
    j = job(items=3, max_items=3, stages=("only",))
    first = ledger.lease(j.id)
    set_status(j, "failed", "running")
    # the batch in flight was paid for: its answer is still taken by a failed job
    assert complete(j, 0, first.lease_token) == ["ok", "-1", "failed", "1", "0"]
    state = j.job()
    assert pick(state, "exhausted", "n_open", "wm", "next_seq") == ("1", "0", "1", "1")
    assert reopen(j, "all", []) == ["ok", "0", "succeeded"]  # seqs wm..next_seq-1: none


def test_reopen_refuses_a_cancelled_job_and_resume_refuses_a_succeeded_one(ledger, job):
    j = job(items=3, max_items=3, stages=("only",))
    lease_ = ledger.lease(j.id)
    complete(j, 0, lease_.lease_token)
    assert j.job()["status"] == "succeeded"
    assert reopen(j, "all", []) == ["refused", "succeeded"]
    k = job(items=3, max_items=3, stages=("only",))
    set_status(k, "cancelled", "running")
    assert reopen(k, "all", []) == ["refused", "cancelled"]
    assert reopen(k, "failed", []) == ["refused", "cancelled"]


# == replan ==========================================================================================

def test_replan_supersedes_uncommitted_batches_from_new_base(ledger, job):
    j = job(items=15, max_items=3, tolerated_failure_percentage=100)
    # batch 0 committed, 1 leased, 2 failed, 3 completed out of order, 4 pending
    leases = [ledger.lease(j.id) for _ in range(4)]
    assert [l.seq for l in leases] == [0, 1, 2, 3]
    for seq in (0, 3):
        complete(j, seq, leases[seq].lease_token)
        lease(j, seq, f"store-{seq}", stage=1)
        complete(j, seq, f"store-{seq}")
    fail(j, 2, leases[2].lease_token, "bad", "0")
    seq4 = plan_next(j)
    state = j.job()
    assert pick(state, "wm", "next_seq") == ("1", "5")
    committed_from = state["committed_cursor"]

    res = replan(j, cursor(6), [1, 2, 3, 4], reason="skip a bad range")
    assert res == ["ok", "3", "5"]
    for seq in (1, 2, 4):
        b = j.batch(seq)
        assert pick(b, "status", "lease_token", "deadline_ms") == ("superseded", "", "")
    assert j.batch(3)["status"] == "completed"
    for key in (j.k.leases, j.k.failed, *j.ready):
        assert j.zmembers(key) == []
    assert not j.r.exists(j.k.done)
    state = j.job()
    assert {f: state[f] for f in ("status", "base_seq", "wm", "next_seq", "committed_cursor", "frontier",
                                  "exhausted", "blocked", "n_open", "n_failed", "error", "finished_ms")} == {
        "status": "running", "base_seq": "5", "wm": "5", "next_seq": "5", "committed_cursor": cursor(6),
        "frontier": cursor(6), "exhausted": "0", "blocked": "", "n_open": "0", "n_failed": "0",
        "error": "", "finished_ms": ""}
    assert j.events("cursor_moved") == [{"event": "cursor_moved", "from": committed_from, "to": cursor(6),
                                         "actor": ACTOR, "reason": "skip a bad range", "superseded": "3",
                                         "status_was": "running"}]
    assert complete(j, 1, leases[1].lease_token) == ["stale", "superseded", "1"]
    nxt = ledger.lease(j.id)
    assert (nxt.seq, nxt.cursor) == (5, {"type": "offset", "offset": 6})
    assert seq4 == 4 and j.all_intact()


# == set_status ======================================================================================

def test_set_status_refused_from_disallowed_status(job):
    j = job(items=10, max_items=3)
    before, n_events = j.job(), len(j.events())
    assert set_status(j, "running", "paused") == ["refused", "running"]
    assert set_status(j, "paused", "run,unning,running2") == ["refused", "running"]  # whole names only
    assert j.job() == before and len(j.events()) == n_events


def test_set_status_ok_returns_old_status(job):
    j = job(items=10, max_items=3)
    assert set_status(j, "paused", "running,waiting_human") == ["ok", "running"]
    state = j.job()
    assert state["status"] == "paused" and state["finished_ms"] == ""
    assert j.events("job_paused") == [{"event": "job_paused", "from": "running", "actor": ACTOR,
                                       "reason": ""}]
    assert set_status(j, "cancelled", "paused") == ["ok", "paused"]
    assert j.job()["finished_ms"]
    assert set_status(j, "running", "nope") == ["refused", "cancelled"]
    assert j.all_intact()


def test_set_status_missing_and_corrupt(job):
    j = job(items=10, max_items=3)
    res = j.ledger.scripts.set_status(keys=[j.k.job + ":gone", j.k.log],
                                      args=["paused", "running", MAXLEN, ACTOR])
    assert res == ["missing"]
    j.r.hset(j.k.job, "n_done", "9")
    assert set_status(j, "paused", "running") == ["corrupt"]


# == selfcheck =======================================================================================

RECORDS = [
    {"n_done": "1", "next_seq": "2", "st:0": "x", "start_cursor": "{}", "c:0": "1 t",
     "committed_cursor": "null", "B": "upper", "a-b": "dash", "a_b": "underscore"},
    {"a": "1", "a!": "2", "a ": "3", "a~": "4", "A": "5", "": "empty name", "z": ""},
    {"title": "naïve café — 日本語 ✓ 🚀", "ключ": "значение", "é": "e-acute", "e": "plain",
     "emoji🚀": "rocket", "\u00ff": "y-diaeresis", "\u0100": "A-macron"},
    {"punct": "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "tab\there": "new\nline", "quote'": '"double"',
     "spaces  ": "  lead and trail  ", "checksum": "ignored", "corrupt": "1"},
    {"only": "one"},
]


@pytest.mark.parametrize("record", RECORDS, ids=["ledger-sample", "ascii-order", "unicode", "punct", "one"])
def test_selfcheck_digest_matches_python(ledger, record):
    flat = [part for pair in record.items() for part in pair]
    assert ledger.scripts.selfcheck(keys=[], args=flat) == digest(record)


def test_selfcheck_digest_matches_records_the_scripts_sealed(ledger, job):
    j = job(items=list("ab"), max_items=3)
    lease_ = ledger.lease(j.id)
    complete(j, 0, lease_.lease_token, {"note": "résumé ✓"})
    for key in (j.k.job, j.k.batch(0)):
        fields = j.r.hgetall(key)
        flat = [part for name, value in fields.items() if name != "checksum" for part in (name, value)]
        assert ledger.scripts.selfcheck(keys=[], args=flat) == fields["checksum"]
