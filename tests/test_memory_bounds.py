"""Per-process structures stay bounded: the spec cache is an LRU and forgets retired jobs; job
listing pages through a tenant's index and drops the ids of jobs whose retention ran out.

tests/test_soak.py checks the same end to end, by the processes' memory over 20,000 jobs.
"""

from __future__ import annotations

import sys
import threading

import gateway.ledger.jobs
from gateway.ledger.ledger import Ledger
from gateway.settings import Settings
from gateway.push.supervisor import Supervisor
from tests.conftest import drain


def test_spec_cache_keeps_the_most_recently_used_specs_only(redis_client, make_job, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGATE_SPEC_CACHE", "3")  # how an operator bounds it
    ledger = Ledger(redis_client, Settings(redis_url="redis://unused", data_dir=tmp_path / "d"))
    ids = [make_job(items=2) for _ in range(6)]
    for job_id in ids:
        ledger.spec(job_id)
    ledger.spec(ids[3])  # used again: now the most recent
    assert list(ledger._specs) == [ids[4], ids[5], ids[3]]
    assert ledger.spec(ids[0]).job_id == ids[0]  # read again from Redis, evicting ids[4]
    assert list(ledger._specs) == [ids[5], ids[3], ids[0]]


def test_spec_cache_survives_threads_racing_over_a_small_cache(ledger, make_job, monkeypatch):
    monkeypatch.setattr(ledger, "spec_cache", 2)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two steps of a cache lookup
    ids = [make_job(items=2) for _ in range(5)]
    errors = []

    def hammer(offset: int) -> None:
        try:
            for i in range(300):
                assert ledger.spec(ids[(i + offset) % len(ids)]).job_id == ids[(i + offset) % len(ids)]
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == [] and len(ledger._specs) <= 2


def test_supervisor_forgets_the_spec_of_a_job_it_retires(ledger, make_job):
    job_id = make_job(items=4, max_items=2, stages=("only",))
    drain(ledger, job_id)
    assert job_id in ledger._specs
    Supervisor(ledger, name="sup").tick()
    assert not ledger.r.sismember(ledger.keys.active, job_id)
    assert job_id not in ledger._specs


def test_listing_pages_through_the_index_and_forgets_expired_jobs(ledger, jobs, make_job, monkeypatch):
    monkeypatch.setattr(gateway.ledger.jobs, "LIST_PAGE", 3)
    ids = [make_job(items=2) for _ in range(10)]
    expired = ids[1:8:2]  # as if their retention ran out: every key gone, the index entry left
    for job_id in expired:
        k = ledger.keys.job(job_id)
        ledger.r.delete(k.job, k.spec, k.src, k.log, k.audit)
        ledger.forget(job_id)
    index = ledger.keys.jobs("acme")
    assert ledger.r.zcard(index) == 10
    kept = [j for j in ledger.r.zrevrange(index, 0, -1) if j not in expired]  # newest first
    assert [v["job_id"] for v in jobs.list("acme", None, 4)] == kept[:4]
    assert [v["job_id"] for v in jobs.list("acme", None, 100)] == kept
    assert set(ledger.r.zrange(index, 0, -1)) == set(kept)
    assert jobs.list("acme", "failed", 100) == []
