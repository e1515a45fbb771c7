"""Bisection of poison items (docs/design.md "Bisection"), through the ledger: pull mode.

A worker's ``fail`` with retryable=false on an ``on_fatal: bisect`` stage splits the batch; the next
leases hand out the halves, down to single items; good items commit, poison ones are quarantined with
the worker's message, and a retry of a quarantined item commits it once the cause is gone.
"""

from __future__ import annotations

import json
import math

import pytest

from gateway.errors import Conflict, InvalidRequest, StaleLease
from gateway.ledger import bisect
from gateway.ledger.flows import parse_flow

POISON = {7, 13}


def bisect_flow(tolerated: float = 10, **stage) -> dict:
    return {"stage_defs": [{"name": "score", "on_fatal": "bisect", **stage}, {"name": "store"}],
            "tolerated_failure_percentage": tolerated}


def run(ledger, job_id, poison, calls=None, stored=None):
    """Lease until nothing is ready: 'score' fails any lease holding a poison item (fatal), 'store'
    records each item it stores. Returns the leases seen."""
    seen = []
    while (lease := ledger.lease(job_id)) is not None:
        seen.append(lease)
        if calls is not None:
            calls.append((lease.seq, lease.stage, tuple(lease.items)))
        bad = [i for i in lease.items if i in poison]
        if lease.stage == "score" and bad:
            ledger.fail(job_id, lease.seq, lease.lease_token, f"item {bad[0]} is malformed", retryable=False)
            continue
        if lease.stage == "store" and stored is not None:
            stored.extend(lease.items)
        ledger.complete(job_id, lease.seq, lease.lease_token, [{"item": i} for i in lease.items])
    return seen


def test_pull_fatal_fail_bisects_to_the_poison_items_and_commits_the_rest(ledger, make_job):
    job_id = make_job(items=40, max_items=10, **bisect_flow())
    calls, stored = [], []
    run(ledger, job_id, POISON, calls, stored)
    job = ledger.job_fields(job_id)
    assert job["status"] == "succeeded", job
    assert sorted(stored) == sorted(set(range(40)) - POISON)  # every good item stored exactly once
    assert len(stored) == len(set(stored))
    assert int(job["items_done"]) == 38 and int(job["n_quar"]) == 2 and int(job["n_done"]) == 4
    assert int(job["wm"]) == 4  # the watermark passed the bisected batches
    q = ledger.quarantined(job_id)
    assert [(e["id"], e["item"], e["error"], e["stage"]) for e in q] == [
        ("0.7", 7, "item 7 is malformed", "score"), ("1.3", 13, "item 13 is malformed", "score")]
    extra = sum(1 for s, st, _ in calls if st == "score") - 4
    assert extra <= 2 * 2 * math.ceil(math.log2(10))  # about 2 log2(n) extra calls per poison item


def test_pieces_keep_keys_stable_per_item_range(ledger, make_job):
    job_id = make_job(items=8, max_items=8, **bisect_flow(tolerated=50))
    keys = {}
    for lease in run(ledger, job_id, {5}):
        if lease.stage == "score":
            keys.setdefault(tuple(lease.items), set()).add(lease.idempotency_key)
    assert all(len(v) == 1 for v in keys.values())
    assert len({next(iter(v)) for v in keys.values()}) == len(keys)  # one key per item range
    whole = keys[tuple(range(8))].pop()
    assert keys[(4, 5, 6, 7)] == {whole + ":b4-8"}


def test_output_of_a_bisected_stage_lists_its_parts(ledger, make_job):
    job_id = make_job(items=4, max_items=4, **bisect_flow(tolerated=50))
    run(ledger, job_id, {2})
    batch = ledger.batch_record(job_id, 0)
    parts = json.loads(batch["out:0"])["parts"]
    assert sorted(i for p in parts for i in p["items"]) == [0, 1, 3]
    assert all(p["output"] == [{"item": i} for i in p["items"]] for p in parts)
    store = json.loads(batch["out:1"])["parts"]  # the next stage ran the good items only
    assert store == [{"items": [0, 1, 3], "output": [{"item": 0}, {"item": 1}, {"item": 3}]}]


def test_retrying_a_quarantined_item_after_the_fix_commits_it(ledger, make_job):
    job_id = make_job(items=20, max_items=10, **bisect_flow())
    run(ledger, job_id, POISON)
    assert ledger.job_fields(job_id)["status"] == "succeeded"
    out = ledger.retry_quarantined(job_id, ["0.7"], "tenant:acme")
    assert out["retried"] == 1 and out["job_status"] == "running"
    stored = []
    leases = run(ledger, job_id, set(), stored=stored)  # the platform is fixed
    assert [(l.seq, l.stage, l.items) for l in leases] == [(0, "score", [7]), (0, "store", [7])]
    assert stored == [7]
    job = ledger.job_fields(job_id)
    assert job["status"] == "succeeded" and int(job["items_done"]) == 19 and int(job["n_quar"]) == 1
    assert [e["id"] for e in ledger.quarantined(job_id)] == ["1.3"]
    # retry all; still poison: quarantined again, nothing else runs twice
    assert ledger.retry_quarantined(job_id, None, "tenant:acme")["retried"] == 1
    leases = run(ledger, job_id, POISON)
    assert [(l.seq, l.stage, l.items) for l in leases] == [(1, "score", [13])]
    job = ledger.job_fields(job_id)
    assert job["status"] == "succeeded" and int(job["items_done"]) == 19 and int(job["n_quar"]) == 1


def test_quarantined_items_count_against_the_budget_as_items(ledger, make_job):
    job_id = make_job(items=20, max_items=10, stage_defs=[{"name": "score", "on_fatal": "bisect"}],
                      tolerated_failure_percentage=5)
    run(ledger, job_id, {1, 2})  # 2 of 20 items = 10 % > 5 %
    job = ledger.job_fields(job_id)
    assert job["status"] == "failed" and "quarantined" in job["error"]


def test_retryable_failures_and_stages_without_bisect_do_not_split(ledger, make_job):
    job_id = make_job(items=4, max_items=4, stage_defs=[{"name": "score"}])
    lease = ledger.lease(job_id)
    assert ledger.fail(job_id, 0, lease.lease_token, "bad", retryable=False)["outcome"] == "failed"
    job_id = make_job(items=4, max_items=4, stage_defs=[
        {"name": "score", "on_fatal": "bisect", "retry": {"initial_interval": 0.001}}])
    lease = ledger.lease(job_id)
    assert ledger.fail(job_id, 0, lease.lease_token, "flaky", retryable=True)["outcome"] == "retry"
    lease = ledger.lease(job_id)
    assert lease is None or lease.items == [0, 1, 2, 3]
    if lease is not None:  # "the flow may have run": never bisected
        out = ledger.fail(job_id, 0, lease.lease_token, "?", retryable=False, error_type="outcome_unknown")
        assert out["outcome"] == "failed"


def test_the_cap_quarantines_the_failing_piece_whole(ledger, make_job):
    job_id = make_job(items=16, max_items=16, stage_defs=[
        {"name": "score", "on_fatal": "bisect", "bisect_max_calls": 2}], tolerated_failure_percentage=100)
    calls = []
    run(ledger, job_id, {3}, calls)
    assert len(calls) == 3  # the batch, then its two halves; the failing half is quarantined whole
    q = ledger.quarantined(job_id)
    assert [e["index"] for e in q] == list(range(8))
    assert all(e["error"].endswith("(bisection cap reached)") for e in q)


def test_bisect_is_refused_on_a_fetching_stage():
    with pytest.raises(InvalidRequest) as refused:
        parse_flow({"id": "f", "version": "1", "source": {"type": "external"},
                    "stages": [{"name": "fetch", "fetches": True, "on_fatal": "bisect"}]})
    assert "on_fatal: bisect needs a stage that runs the batch's items" in str(refused.value.__cause__)


def test_retry_of_a_running_batch_waits(ledger, make_job):
    job_id = make_job(items=4, max_items=4, **bisect_flow(tolerated=50))
    for expected in ([0, 1, 2, 3], [0, 1], [0]):  # the batch, its first half, that half's first half
        lease = ledger.lease(job_id)
        assert lease.items == expected
        ledger.fail(job_id, lease.seq, lease.lease_token, "bad", retryable=False)
    assert [e["id"] for e in ledger.quarantined(job_id)] == ["0.0"]
    assert ledger.retry_quarantined(job_id, ["0.0"], "t")["busy_batches"] == [0]
    ledger.cancel(job_id, "t")
    with pytest.raises(Conflict):
        ledger.retry_quarantined(job_id, ["0.0"], "t")


def test_the_lease_and_the_dispatcher_read_the_same_piece(ledger, make_job):
    job_id = make_job(items=8, max_items=8, **bisect_flow(tolerated=50))
    lease = ledger.lease(job_id)
    ledger.fail(job_id, 0, lease.lease_token, "bad", retryable=False)
    lease = ledger.lease(job_id)
    assert lease.piece == bisect.selection(ledger.batch_record(job_id, 0)) == [0, 1, 2, 3]
    ledger.complete(job_id, 0, lease.lease_token, {})
    lease = ledger.lease(job_id)
    assert lease.piece == bisect.selection(ledger.batch_record(job_id, 0)) == [4, 5, 6, 7]


def test_a_piece_whose_lease_runs_out_runs_again_under_the_same_key(ledger, make_job):
    job_id = make_job(items=8, max_items=8, **bisect_flow(tolerated=50))
    lease = ledger.lease(job_id)
    ledger.fail(job_id, 0, lease.lease_token, "bad", retryable=False)
    first = ledger.lease(job_id)  # items 0-3: the worker dies with it
    k = ledger.keys.job(job_id)
    ledger.r.zadd(k.leases, {"0": 0}, xx=True)
    assert ledger.expire_due(job_id) == [(0, "retry")]
    ledger.r.zadd(k.ready(0), {"0": 0}, xx=True)
    again = ledger.lease(job_id)
    assert (again.items, again.idempotency_key, again.attempt) == (first.items, first.idempotency_key, 2)


def test_retry_failed_continues_a_bisection_that_ran_out_of_attempts(ledger, make_job):
    job_id = make_job(items=4, max_items=4, stage_defs=[
        {"name": "score", "on_fatal": "bisect", "retry": {"maximum_attempts": 1}}], tolerated_failure_percentage=100)
    lease = ledger.lease(job_id)
    ledger.fail(job_id, 0, lease.lease_token, "bad", retryable=False)  # split
    lease = ledger.lease(job_id)
    assert ledger.fail(job_id, 0, lease.lease_token, "flaky", retryable=True)["outcome"] == "failed"
    assert ledger.job_fields(job_id)["status"] == "succeeded"  # within its budget, batch 0 failed
    assert ledger.reopen(job_id, "t", only_failed=True) == 1
    leases = run(ledger, job_id, {1})
    assert [lease.items for lease in leases] == [[0, 1], [0], [1], [2, 3]]
    job = ledger.job_fields(job_id)
    assert job["status"] == "succeeded" and int(job["items_done"]) == 3 and int(job["n_quar"]) == 1


def test_a_bisected_stage_before_an_approval_opens_it_when_its_last_piece_is_quarantined(ledger, make_job):
    job_id = make_job(items=2, max_items=2, tolerated_failure_percentage=100, stage_defs=[
        {"name": "score", "on_fatal": "bisect"}, {"name": "review", "approval": {"timeout": 60}},
        {"name": "store"}])
    leases = run(ledger, job_id, {1})  # [0, 1] fails, [0] passes, [1] is quarantined: the pass is done
    assert [lease.items for lease in leases] == [[0, 1], [0], [1]]
    batch = ledger.batch_record(job_id, 0)
    assert batch["status"] == "waiting_human" and batch["approval"]
    assert ledger.r.exists(ledger.keys.job(job_id).approval(0, 1, 1))


def test_a_rewind_during_a_quarantine_retry_supersedes_it_and_starts_a_clean_quarantine(ledger, make_job):
    job_id = make_job(items=20, max_items=10, **bisect_flow())
    run(ledger, job_id, POISON)
    assert ledger.retry_quarantined(job_id, ["0.7"], "t")["retried"] == 1  # batch 0 open again, below wm
    ledger.replan(job_id, {"type": "offset", "offset": 0}, "t", "again")
    assert ledger.batch_record(job_id, 0)["status"] == "superseded"
    assert ledger.quarantined(job_id) == []  # the old plan's quarantine left with it
    run(ledger, job_id, POISON)
    job = ledger.job_fields(job_id)
    assert job["status"] == "succeeded" and int(job["items_done"]) == 18 and int(job["n_quar"]) == 2
    assert [e["id"] for e in ledger.quarantined(job_id)] == ["2.7", "3.3"]  # the new plan's seqs
    assert ledger.retry_quarantined(job_id, ["1.3"], "t")["retried"] == 0  # an old plan's batch


def test_a_split_answers_and_logs_the_attempt_that_failed(ledger, make_job):
    job_id = make_job(items=4, max_items=4, **bisect_flow(tolerated=50))
    lease = ledger.lease(job_id)
    assert ledger.fail(job_id, 0, lease.lease_token, "bad", retryable=False) == {
        "job_id": job_id, "seq": 0, "attempt": 1, "outcome": "split"}
    entry = [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).log) if f["event"] == "bisected"]
    assert entry[0]["attempt"] == "1" and entry[0]["items"] == "0,1,2,3"


def test_a_piece_answered_twice_commits_once(ledger, make_job):
    job_id = make_job(items=4, max_items=4, **bisect_flow(tolerated=50))
    lease = ledger.lease(job_id)
    ledger.fail(job_id, 0, lease.lease_token, "bad", retryable=False)
    piece = ledger.lease(job_id)
    first = ledger.complete(job_id, 0, piece.lease_token, {"n": 2})
    again = ledger.complete(job_id, 0, piece.lease_token, {"n": 2})  # the platform's answer, twice
    assert not first["duplicate"] and again["duplicate"]
    batch = ledger.batch_record(job_id, 0)
    assert json.loads(batch["bp:0"]) == ["0,1"] and json.loads(batch["bis"])["p"] == [[2, 3]]
    with pytest.raises(StaleLease):  # a late fail of the same piece changes nothing either
        ledger.fail(job_id, 0, piece.lease_token, "late", retryable=False)
    assert json.loads(ledger.batch_record(job_id, 0)["bis"])["p"] == [[2, 3]]


def _quarantine_events(ledger, job_id):
    return [(f["type"], json.loads(f["data"]) if "data" in f else f)
            for _, f in ledger.r.xrange(ledger.keys.job(job_id).events)]


def test_each_quarantine_is_an_event_and_counted_by_stage(ledger, make_job):
    """A subscriber hears of every item set aside (items.quarantined: the batch, its stage and the items'
    indices in it, with the platform's message), and /metrics counts them by stage, once each (also
    when every script call is made twice: tests/test_repeat_calls.py runs this module so)."""
    from gateway import metrics

    counter = metrics.ITEMS_QUARANTINED.labels("score")
    before = counter._value.get()
    job_id = make_job(items=40, max_items=10, **bisect_flow())
    run(ledger, job_id, POISON)
    events = _quarantine_events(ledger, job_id)
    quarantined = [data for kind, data in events if kind == "items.quarantined"]
    assert [(d["seq"], d["stage"], d["items"], d["error"], d["job_status"]) for d in quarantined] == [
        (0, 0, [7], "item 7 is malformed", "running"), (1, 0, [3], "item 13 is malformed", "running")]
    assert [kind for kind, _ in events][-1] == "job.succeeded"
    assert counter._value.get() - before == 2


def test_a_quarantine_that_breaks_the_budget_is_heard_before_the_job_fails(ledger, make_job):
    job_id = make_job(items=20, max_items=10, stage_defs=[{"name": "score", "on_fatal": "bisect"}],
                      tolerated_failure_percentage=5)
    run(ledger, job_id, {1, 2})
    kinds = [(kind, data.get("items"), data.get("job_status"))
             for kind, data in _quarantine_events(ledger, job_id)]
    assert kinds == [("items.quarantined", [1], "running"), ("items.quarantined", [2], "failed"),
                     ("job.failed", None, None)], kinds
