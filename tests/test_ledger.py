"""The ledger's scripts and the invariants of docs/design.md, against a real redis-server."""

from __future__ import annotations

import threading
import time

import pytest

from gateway.errors import CorruptRecord, StaleLease
from tests.conftest import drain


def test_drain_runs_every_item_once_and_succeeds(ledger, jobs, make_job):
    job_id = make_job(items=list(range(10)), max_items=3)
    seen = drain(ledger, job_id)
    scored = [i for lease in seen if lease.stage == "score" for i in lease.items]
    assert scored == list(range(10))
    view = jobs.view("acme", job_id)
    assert view["status"] == "succeeded"
    assert view["items_done"] == 10
    assert view["batches"] == {"planned": 4, "completed": 4, "failed": 0, "open": 0, "leased": 0}


def test_store_stage_gets_previous_output_and_stable_idempotency_key(ledger, make_job):
    job_id = make_job(items=list(range(4)), max_items=2)
    first = ledger.lease(job_id)
    ledger.complete(job_id, first.seq, first.lease_token, {"scores": [1, 2]})
    second = ledger.lease(job_id)
    assert (second.seq, second.stage) == (first.seq, "store")
    assert second.input == {"scores": [1, 2]}
    assert second.items == first.items
    assert second.idempotency_key.startswith(f"{job_id}:store:")
    assert first.idempotency_key.startswith(f"{job_id}:score:")
    again = ledger.lease(job_id)
    assert again.idempotency_key != second.idempotency_key  # another batch, another range


def test_stale_token_gets_409_and_changes_nothing(ledger, jobs, make_job):
    job_id = make_job(items=list(range(3)), max_items=3)
    lease = ledger.lease(job_id)
    before = jobs.batch("acme", job_id, lease.seq)
    with pytest.raises(StaleLease):
        ledger.complete(job_id, lease.seq, "not-the-token", {"x": 1})
    assert jobs.batch("acme", job_id, lease.seq) == before


def test_duplicate_completion_returns_first_answer(ledger, make_job):
    job_id = make_job(items=list(range(3)), max_items=3)
    lease = ledger.lease(job_id)
    first = ledger.complete(job_id, lease.seq, lease.lease_token, {"x": 1})
    again = ledger.complete(job_id, lease.seq, lease.lease_token, {"x": 2})
    assert again == {**first, "duplicate": True}
    assert ledger.r.hget(ledger.keys.job(job_id).batch(0), "out:0") == '{"x":1}'


def test_watermark_with_out_of_order_completion(ledger, jobs, make_job):
    job_id = make_job(items=list(range(12)), max_items=3, stages=("only",))
    leases = [ledger.lease(job_id) for _ in range(4)]
    assert [lease.seq for lease in leases] == [0, 1, 2, 3]
    for lease in (leases[2], leases[1]):
        ledger.complete(job_id, lease.seq, lease.lease_token, {})
    view = jobs.view("acme", job_id)
    assert view["committed_seq"] == -1
    assert view["committed_cursor"] == {"type": "offset", "offset": 0}
    ledger.complete(job_id, 0, leases[0].lease_token, {})
    view = jobs.view("acme", job_id)
    assert view["committed_seq"] == 2
    assert view["committed_cursor"]["offset"] == 9
    ledger.complete(job_id, 3, leases[3].lease_token, {})
    assert jobs.view("acme", job_id)["status"] == "succeeded"


def test_concurrency_limits_leases(ledger, make_job):
    job_id = make_job(items=list(range(30)), max_items=3, concurrency=2)
    assert ledger.lease(job_id) is not None
    assert ledger.lease(job_id) is not None
    assert ledger.lease(job_id) is None


def test_many_concurrent_leasers_never_share_a_batch(ledger, make_job, redis_server):
    job_id = make_job(items=200, max_items=2, stages=("only",), concurrency=1000)
    held: list[tuple[int, int]] = []
    lock = threading.Lock()

    def leaser():
        from gateway.ledger.embedded import client_for
        from gateway.ledger.ledger import Ledger

        own = Ledger(client_for(redis_server.url), ledger.settings)
        while (lease := own.lease(job_id)) is not None:
            with lock:
                held.append((lease.seq, lease.attempt))

    threads = [threading.Thread(target=leaser) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [seq for seq, _ in held]
    assert sorted(seqs) == list(range(100))
    assert all(attempt == 1 for _, attempt in held)


def test_heartbeat_extends_lease_and_stores_progress(ledger, jobs, make_job):
    job_id = make_job(items=list(range(3)), max_items=3,
                      stage_defs=[{"name": "score", "lease": 0.5}])
    lease = ledger.lease(job_id)
    time.sleep(0.3)
    ledger.heartbeat(job_id, lease.seq, lease.lease_token, {"done": 2}, extend_ms=2000)
    time.sleep(0.4)
    assert ledger.expire_due(job_id) == []
    batch = jobs.batch("acme", job_id, lease.seq)
    assert batch["progress"] == {"done": 2}
    with pytest.raises(StaleLease):
        ledger.heartbeat(job_id, lease.seq, "stale", None)


def test_expired_lease_returns_with_attempt_raised_and_backoff(ledger, jobs, make_job):
    job_id = make_job(items=list(range(3)), max_items=3, stage_defs=[
        {"name": "score", "lease": 0.1, "retry": {"initial_interval": 0.3, "maximum_attempts": 2}}])
    first = ledger.lease(job_id)
    time.sleep(0.15)
    assert ledger.expire_due(job_id) == [(0, "retry")]
    assert ledger.expire_due(job_id) == []
    assert ledger.lease(job_id) is None  # backoff: 0.15 s .. 0.3 s
    with pytest.raises(StaleLease):
        ledger.complete(job_id, 0, first.lease_token, {})
    time.sleep(0.35)
    second = ledger.lease(job_id)
    assert (second.seq, second.attempt) == (0, 2)
    time.sleep(0.15)
    assert ledger.expire_due(job_id) == [(0, "failed")]
    view = jobs.view("acme", job_id)
    assert view["status"] == "failed"
    assert view["batches"]["failed"] == 1


def test_fail_retryable_then_fatal(ledger, jobs, make_job):
    job_id = make_job(items=list(range(6)), max_items=3, tolerated_failure_percentage=50,
                      stage_defs=[{"name": "score", "retry": {"initial_interval": 0.05,
                                                              "non_retryable_error_types": ["Bad"]}}])
    lease = ledger.lease(job_id)
    assert ledger.fail(job_id, lease.seq, lease.lease_token, "timeout")["outcome"] == "retry"
    time.sleep(0.1)
    # batch 1 was planned ahead with batch 0: ready since before batch 0's retry, it is leased first
    other = ledger.lease(job_id)
    assert other.seq == 1
    ledger.complete(job_id, 1, other.lease_token, {})
    lease = ledger.lease(job_id)
    assert lease.seq == 0 and lease.attempt == 2
    out = ledger.fail(job_id, 0, lease.lease_token, "bad input", retryable=True, error_type="Bad")
    assert out["outcome"] == "failed"
    assert drain(ledger, job_id) == []  # batch 1 committed before: nothing left
    view = jobs.view("acme", job_id)  # 1 of 2 batches failed: within 50 %
    assert view["status"] == "succeeded" and view["batches"]["failed"] == 1
    assert [b["seq"] for b in jobs.batches("acme", job_id, "failed", -1, 10)] == [0]


def test_failure_budget_zero_fails_job(ledger, jobs, make_job):
    job_id = make_job(items=list(range(9)), max_items=3)
    lease = ledger.lease(job_id)
    ledger.fail(job_id, lease.seq, lease.lease_token, "no", retryable=False)
    view = jobs.view("acme", job_id)
    assert view["status"] == "failed" and "budget" in view["error"]
    assert ledger.lease(job_id) is None


def test_corrupt_batch_is_marked_and_not_run(ledger, jobs, make_job):
    job_id = make_job(items=list(range(6)), max_items=3, tolerated_failure_percentage=100)
    lease = ledger.lease(job_id)
    ledger.complete(job_id, 0, lease.lease_token, {})  # batch 0 now waits for 'store'
    ledger.r.hset(ledger.keys.job(job_id).batch(0), "start_cursor", '{"offset":999}')
    nxt = ledger.lease(job_id)
    assert nxt.seq == 1  # batch 0 skipped
    assert jobs.batch("acme", job_id, 0)["status"] == "corrupt"
    assert jobs.view("acme", job_id)["batches"]["failed"] == 1


def test_corrupt_job_record_refuses_to_run(ledger, jobs, make_job):
    job_id = make_job(items=list(range(6)), max_items=3)
    ledger.r.hset(ledger.keys.job(job_id).job, "wm", "5")
    with pytest.raises(CorruptRecord):
        ledger.lease(job_id)
    assert jobs.view("acme", job_id)["corrupt"] is True


def test_pause_stops_leasing_resume_continues(ledger, jobs, make_job):
    job_id = make_job(items=list(range(6)), max_items=3)
    ledger.set_status(job_id, "paused", ("running",), "test")
    assert ledger.lease(job_id) is None
    ledger.set_status(job_id, "running", ("paused",), "test")
    assert ledger.lease(job_id) is not None
