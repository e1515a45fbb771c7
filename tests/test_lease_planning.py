"""The lease path through the Ledger: round trips per lease, planning ahead per source type, one planner
per job, and what a failing source does to batches read ahead.

Raw script behaviour (lease.lua, plan.lua) is in tests/test_scripts.py; the model-based test drives
planning ahead through every control action (tests/test_ledger_model.py).
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager

import pytest
import redis.connection

from gateway.errors import SourceUnavailable
from gateway.ledger.ledger import PLAN_AHEAD
from tests.conftest import drain


@contextmanager
def round_trips():
    """Counts commands sent on the wire by redis-py (a pipeline counts once), as the benchmarks do."""
    counter = {"n": 0}
    orig = redis.connection.AbstractConnection.send_packed_command

    def counting(conn, command, check_health=True):
        counter["n"] += 1
        return orig(conn, command, check_health)

    redis.connection.AbstractConnection.send_packed_command = counting
    try:
        yield counter
    finally:
        redis.connection.AbstractConnection.send_packed_command = orig


def planned(ledger, job_id):
    return int(ledger.job_fields(job_id)["next_seq"])


@pytest.mark.parametrize("source", ["sequence", "inline"])
def test_a_lease_costs_two_round_trips_to_plan_and_one_when_ready(ledger, make_job, source):
    job_id = make_job(items=200 if source == "sequence" else list(range(200)), max_items=5,
                      stages=("only",), concurrency=100)
    ledger.spec(job_id)  # the spec is cached from here on
    ledger.lease(make_job(items=3, stages=("only",)))  # the scripts are loaded (SCRIPT LOAD) from here on
    with round_trips() as trips:
        first = ledger.lease(job_id)
    assert trips["n"] == 2  # lease.lua (nothing ready: plan lock), plan.lua (cut ahead, lease the first)
    assert first.seq == 0 and first.items == [0, 1, 2, 3, 4]
    assert planned(ledger, job_id) == PLAN_AHEAD
    with round_trips() as trips:
        rest = [ledger.lease(job_id) for _ in range(PLAN_AHEAD - 1)]
    assert trips["n"] == PLAN_AHEAD - 1  # one script each
    assert [lease.seq for lease in rest] == list(range(1, PLAN_AHEAD))
    assert rest[-1].items == list(range(5 * (PLAN_AHEAD - 1), 5 * PLAN_AHEAD))


def test_inline_items_read_ahead_by_size_come_out_in_order_exactly_once(ledger, make_job):
    items = [{"text": "x" * (i % 7) * 10, "i": i} for i in range(97)]
    job_id = make_job(items=items, max_items=4, stages=("only",), batching={"max_items": 4, "max_bytes": 90})
    seen = drain(ledger, job_id)
    assert [item for lease in seen for item in lease.items] == items
    assert all(lease.cursor["offset"] + len(lease.items) == (lease.end_cursor or {"offset": 97})["offset"]
               for lease in seen)
    assert ledger.job_fields(job_id)["status"] == "succeeded"


def test_plan_ahead_of_one_is_lazy_planning(ledger, make_job):
    ledger.plan_ahead = 1
    job_id = make_job(items=30, max_items=3, stages=("only",))
    ledger.lease(job_id)
    assert planned(ledger, job_id) == 1


def test_a_url_source_is_read_one_batch_per_plan(ledger, make_job, monkeypatch):
    job_id = make_job(items=30, max_items=3, stages=("only",))
    spec = ledger.spec(job_id)
    monkeypatch.setitem(spec.source, "type", "http_json")
    assert ledger._plan_ahead(spec) == 1
    monkeypatch.setitem(spec.source, "type", "jsonl")
    assert ledger._plan_ahead(spec) == PLAN_AHEAD
    monkeypatch.setitem(spec.source, "url", "https://example.com/items.jsonl")
    assert ledger._plan_ahead(spec) == 1


def test_a_file_read_ahead_stops_before_a_bad_line_met_by_the_next_plan(
        ledger, jobs, make_job, tmp_path):
    path = tmp_path / "rows.jsonl"
    good = [json.dumps({"n": i}) for i in range(10)]
    path.write_text("\n".join(good[:7]) + "\n{not json\n" + "\n".join(good[7:]) + "\n")
    job_id = make_job(source={"type": "jsonl", "path": str(path)}, max_items=2, stages=("only",),
                      tolerated_failure_percentage=100)
    first = ledger.lease(job_id)
    # batches [0,1] [2,3] [4,5] are read ahead; the one from item 6 would hold the bad line: not planned
    assert planned(ledger, job_id) == 3
    assert first.items == [{"n": 0}, {"n": 1}]
    leases = [ledger.lease(job_id) for _ in range(2)]
    assert [lease.items for lease in leases] == [[{"n": 2}, {"n": 3}], [{"n": 4}, {"n": 5}]]
    with pytest.raises(SourceUnavailable):  # the next plan reads the bad line: counted as a source failure
        ledger.lease(job_id)
    fields = ledger.job_fields(job_id)
    assert fields["src_failures"] == "1" and "invalid JSON" in fields["src_error"]
    assert jobs.view("acme", job_id)["batches"]["planned"] == 3


def test_a_source_that_fails_after_planning_ahead_counts_once_and_answers_503(ledger, make_job, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(8)))
    job_id = make_job(source={"type": "jsonl", "path": str(path)}, max_items=1, stages=("only",))
    ledger.plan_ahead = 2
    k = ledger.keys.job(job_id)
    got = [ledger.lease(job_id), ledger.lease(job_id)]
    assert [lease.seq for lease in got] == [0, 1]
    path.unlink()  # the file goes away: the next plan fails, retryably
    with pytest.raises(SourceUnavailable):
        ledger.lease(job_id)
    assert ledger.job_fields(job_id)["src_failures"] == "1"
    assert not ledger.r.exists(k.plan_lock)  # the failed planner let go of the lock
    with pytest.raises(SourceUnavailable):  # within the backoff: counted once, no read
        ledger.lease(job_id)
    assert ledger.job_fields(job_id)["src_failures"] == "1"


def test_a_planner_that_died_holding_the_lock_delays_leases_but_loses_nothing(ledger, make_job, monkeypatch):
    import gateway.ledger.ledger as ledger_module

    monkeypatch.setattr(ledger_module, "LEASE_PATIENCE_S", 0.05)
    job_id = make_job(items=10, max_items=3, stages=("only",))
    k = ledger.keys.job(job_id)
    ledger.r.set(k.plan_lock, "a planner that died", px=30_000)
    assert ledger.lease(job_id) is None  # waited for its batches, none came: nothing ready (yet)
    ledger.r.delete(k.plan_lock)  # its lock runs out
    assert ledger.lease(job_id).seq == 0


def test_concurrent_leasers_share_one_planner_and_never_lease_a_batch_twice(ledger, settings, make_job,
                                                                          redis_server):
    from gateway.ledger.embedded import client_for
    from gateway.ledger.ledger import Ledger

    job_id = make_job(items=list(range(400)), max_items=2, stages=("only",), concurrency=1000)
    ledgers = [Ledger(client_for(redis_server.url), settings) for _ in range(6)]
    for other in ledgers:
        other.plan_ahead = 3  # many plans, so leasers meet each other planning
    seen: list[list] = [[] for _ in ledgers]

    def worker(i):
        while (lease := ledgers[i].lease(job_id)) is not None:
            seen[i].append(lease)
            ledgers[i].complete(job_id, lease.seq, lease.lease_token, None)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(ledgers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    seqs = sorted(lease.seq for part in seen for lease in part)
    assert seqs == list(range(200))
    assert sorted(item for part in seen for lease in part for item in lease.items) == list(range(400))
    assert ledger.job_fields(job_id)["status"] == "succeeded"
    planned_events = [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).log) if f["event"] == "planned"]
    assert sorted(int(f["seq"]) for f in planned_events) == list(range(200))  # each seq planned once


def test_an_external_source_plans_one_blocked_batch(ledger, make_job):
    job_id = make_job(source={"type": "external"}, stage_defs=[{"name": "fetch", "fetches": True}])
    lease = ledger.lease(job_id)
    assert lease.seq == 0 and lease.items is None
    assert planned(ledger, job_id) == 1
    assert ledger.job_fields(job_id)["blocked"] == "0"
    assert ledger.lease(job_id) is None  # nothing is planned past a batch whose fetch gives the cursor
