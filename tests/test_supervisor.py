"""Supervisor: lease expiry, crash recovery in auto and record modes, no double recovery, retention."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import pytest

from gateway.ledger.embedded import client_for
from gateway.ledger.ledger import Ledger
from gateway.push.supervisor import Supervisor


@pytest.fixture
def settings(settings):
    """Sources and targets here are servers on 127.0.0.1: the outbound guard admits them only when allowed."""
    return settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})


def _leased_job(ledger, make_job, leases=3):
    # one batch per plan: the batches these tests see pending are exactly the dead leases returned
    # (planning ahead is covered by tests/test_lease_planning.py and the model test)
    ledger.plan_ahead = 1
    job_id = make_job(items=list(range(30)), max_items=3, concurrency=10,
                      stage_defs=[{"name": "score", "lease": 0.1,
                                   "retry": {"initial_interval": 0.05}}])
    held = [ledger.lease(job_id) for _ in range(leases)]
    time.sleep(0.15)
    return job_id, held


def _events(ledger, job_id, event):
    return [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).log) if f["event"] == event]


def test_recovery_auto_returns_dead_leases_to_the_pool(ledger, jobs, make_job):
    job_id, held = _leased_job(ledger, make_job)
    report = Supervisor(ledger, name="sup-a").recover()
    assert report[0]["job_id"] == job_id and sorted(report[0]["expired_now"]) == [0, 1, 2]
    assert [b["seq"] for b in jobs.batches("acme", job_id, "pending", -1, 10)] == [0, 1, 2]
    assert _events(ledger, job_id, "job_recovered")[0]["actor"] == "sup-a"
    time.sleep(0.06)  # the retry backoff
    again = ledger.lease(job_id)
    assert again.seq in (0, 1, 2) and again.attempt == 2


def test_recovery_record_mode_holds_the_job_until_released(ledger, jobs, make_job, settings):
    job_id, held = _leased_job(ledger, make_job)
    record = Ledger(ledger.r, settings.model_copy(update={"recovery": "record"}))
    before = [jobs.batch("acme", job_id, s) for s in range(3)]
    sup = Supervisor(record, name="sup-r")
    report = sup.recover()
    assert report == [{"job_id": job_id, "committed_cursor": '{"offset":0,"type":"offset"}',
                       "leased_batches": [0, 1, 2], "mode": "record", "held": True}]
    view = jobs.view("acme", job_id)
    assert view["status"] == "held" and "release" in view["held_reason"]
    # a second supervisor starting in record mode does not hold (or report) it again
    assert Supervisor(record, name="sup-r2").recover() == []
    for _ in range(3):
        sup.tick()
    assert [jobs.batch("acme", job_id, s) for s in range(3)] == before  # dead leases not expired
    assert ledger.lease(job_id) is None  # and nothing new is handed out
    # a worker that is still alive may commit its paid work; that does not end the hold
    ledger.complete(job_id, 0, held[0].lease_token, {})
    sup.tick()
    assert [b["seq"] for b in jobs.batches("acme", job_id, "leased", -1, 10)] == [1, 2]
    assert jobs.view("acme", job_id)["status"] == "held"
    # the operator lets it go: supervision resumes and the dead leases return to the pool
    ledger.release(job_id, "tenant:acme")
    sup.tick()
    assert [b["seq"] for b in jobs.batches("acme", job_id, "pending", -1, 10)] == [1, 2]
    events = [f["event"] for _, f in ledger.r.xrange(ledger.keys.job(job_id).audit)]
    assert events == ["job_created", "job_held", "job_released"]


def test_concurrent_supervisors_never_double_recover(ledger, make_job, redis_server):
    job_ids = [_leased_job(ledger, make_job, leases=5)[0] for _ in range(3)]
    barrier = threading.Barrier(4)

    def run(i):
        sup = Supervisor(Ledger(client_for(redis_server.url), ledger.settings), name=f"sup-{i}")
        barrier.wait()
        sup.recover()
        sup.tick()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job_id in job_ids:
        retries = Counter(e["seq"] for e in _events(ledger, job_id, "retry_scheduled"))
        assert retries == {str(s): 1 for s in range(5)}
        assert len(_events(ledger, job_id, "job_recovered")) == 1


def test_retention_expires_succeeded_jobs_but_never_failed_ones(ledger, make_job):
    from tests.conftest import drain

    ok = make_job(items=list(range(3)), max_items=3, retention=3600)
    drain(ledger, ok)
    bad = make_job(items=list(range(3)), max_items=3, retention=3600)
    lease = ledger.lease(bad)
    ledger.fail(bad, lease.seq, lease.lease_token, "broken", retryable=False)
    Supervisor(ledger).tick()
    assert 0 < ledger.r.pttl(ledger.keys.job(ok).job) <= 3_600_000
    assert 0 < ledger.r.pttl(ledger.keys.job(ok).batch(0)) <= 3_600_000
    assert ledger.r.pttl(ledger.keys.job(bad).job) == -1
    assert not ledger.r.sismember(ledger.keys.active, ok)


def test_a_job_with_an_unreachable_source_does_not_stop_supervision(ledger, jobs, make_job, registry):
    from gateway.push.dispatch import Dispatcher
    from gateway.ledger.flows import parse_flow
    from gateway.ledger.jobs import JobRequest
    from tests.chunker.helpers import Server, file_app

    source = Server(file_app(b'{"n": 1}\n', honour_range=True))  # up at creation, then gone
    dead = source.url
    registry.register("acme", parse_flow({
        "id": "dead-source", "version": "1", "source": {"type": "jsonl", "url": f"{dead}/items.jsonl"},
        "stages": [{"name": "push", "target": {"type": "http", "url": f"{dead}/hook"}}]}))
    broken = jobs.create("acme", JobRequest(flow_id="dead-source"))["job_id"]
    source.close()
    healthy, _ = _leased_job(ledger, make_job, leases=2)
    sup = Supervisor(ledger, name="sup", dispatcher=Dispatcher.build(ledger.settings, ledger))
    sup.tick()  # the broken job's pump raises 'source unavailable'; the healthy job is still served
    assert [b["seq"] for b in jobs.batches("acme", healthy, "pending", -1, 10)] == [0, 1]
    assert jobs.view("acme", broken)["status"] == "running"  # retryable: it waits for its source


def test_lease_on_an_unreachable_source_is_a_503_with_retry_after(api):
    from tests.chunker.helpers import Server, file_app

    source = Server(file_app(b'{"n": 1}\n', honour_range=True))  # up at creation, then gone
    dead = f"{source.url}/items.jsonl"
    api.post("/v1/flows", json={"id": "dead", "version": "1", "stages": [{"name": "s"}],
                                "source": {"type": "jsonl", "url": dead}})
    job_id = api.post("/v1/jobs", json={"flow_id": "dead"}).json()["job_id"]
    source.close()
    resp = api.post(f"/v1/jobs/{job_id}/lease")
    assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1
    assert resp.headers["Content-Type"] == "application/problem+json"
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "running" and "items.jsonl" in view["source_error"]


def test_a_source_that_breaks_later_is_retried_then_fails_the_job(api):
    """Retried under the first stage's retry policy (3 attempts here), then the job fails with the
    error; it never waits forever, and a pull loop is told to stop."""
    from tests.chunker.helpers import Server, file_app

    source = Server(file_app(b"".join(b'{"n": %d}\n' % i for i in range(6)), honour_range=True))
    api.post("/v1/flows", json={
        "id": "breaks", "version": "1", "batching": {"max_items": 2},
        "stages": [{"name": "s", "retry": {"initial_interval": 0.05, "maximum_attempts": 3}}],
        "source": {"type": "jsonl", "url": f"{source.url}/items.jsonl"}})
    job_id = api.post("/v1/jobs", json={"flow_id": "breaks"}).json()["job_id"]
    first = api.post(f"/v1/jobs/{job_id}/lease").json()
    api.post(f"/v1/jobs/{job_id}/batches/{first['seq']}/complete", json={"lease_token": first["lease_token"]})
    source.close()
    answers = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        resp = api.post(f"/v1/jobs/{job_id}/lease")
        answers.append(resp.status_code)
        if resp.status_code == 204:
            break
        time.sleep(0.12)
    assert answers[-1] == 204 and set(answers[:-1]) == {503}
    assert resp.headers["Batchgate-Job-Status"] == "failed"
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "failed" and "after 3 attempt(s)" in view["error"]
    assert view["committed_cursor"] == first["end_cursor"]  # the committed batch stays committed
    audit = api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]
    assert audit[-1]["event"] == "job_failed" and audit[-1]["actor"] == "source"


def test_an_unexpected_error_skips_one_job_and_one_pass_and_expiry_goes_on(ledger, jobs, make_job, caplog,
                                                                           monkeypatch):
    """Leases must keep expiring whatever one job or one pass throws: a supervisor that stopped would
    leave every dead lease holding its job's concurrency forever."""
    broken, _ = _leased_job(ledger, make_job)
    fine, _ = _leased_job(ledger, make_job)
    sup = Supervisor(Ledger(ledger.r, ledger.settings.model_copy(
        update={"supervisor_interval": timedelta(milliseconds=50)})), name="sup-e")
    real_expire = sup.ledger.expire_due

    def expire_due(job_id, **kw):
        if job_id == broken:
            raise KeyError("surprise")
        return real_expire(job_id, **kw)

    monkeypatch.setattr(sup.ledger, "expire_due", expire_due)
    real_tick, passes = sup.tick, []

    def tick():
        passes.append(1)
        if len(passes) == 1:
            raise ValueError("a pass that fails")
        real_tick()

    monkeypatch.setattr(sup, "tick", tick)
    monkeypatch.setattr(sup, "recover", lambda: [])  # start-up recovery would expire them itself
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while len(jobs.batches("acme", fine, "pending", -1, 10)) < 3:
            assert time.monotonic() < deadline and thread.is_alive(), caplog.text[-2000:]
            time.sleep(0.05)
    finally:
        sup.stop.set()
        thread.join(5)
    assert [b["seq"] for b in jobs.batches("acme", fine, "pending", -1, 10)] == [0, 1, 2]
    assert jobs.batches("acme", broken, "pending", -1, 10) == []  # its own error kept it as it was
    assert "a pass failed" in caplog.text and "skipped this pass after an unexpected error" in caplog.text
