"""The supervisor's due index (gateway/ledger/due.py): a pass costs what is due, not what exists; a lost
entry is found by the sweep; several supervisors never expire a lease twice."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter

import pytest

from gateway.ledger.embedded import client_for
from gateway.ledger.jobs import JobRequest
from gateway.ledger.ledger import Ledger
from gateway.push.supervisor import Supervisor
from gateway.settings import Settings
from tests.conftest import TOKEN


@pytest.fixture(params=[1, 4], ids=["one-due-set", "four-due-shards"])
def settings(request, redis_server, tmp_path):
    """Every test here runs with the due index as one sorted set and cut into four (BATCHGATE_DUE_SHARDS)."""
    return Settings(redis_url=redis_server.url, data_dir=tmp_path / "data", tokens={TOKEN: "acme"},
                    source_roots={"*": [str(tmp_path)]}, due_shards=request.param)


#: commands that read one job's keys (the old pass sent several of these per active job)
PER_JOB_READS = ("hgetall", "hget", "hmget", "zrange", "zscore", "zcard", "xrange", "sismember")


def _expiring_job(ledger, make_job, leases=2, lease_s=0.1):
    ledger.plan_ahead = 1
    job_id = make_job(items=list(range(30)), max_items=3, concurrency=10,
                      stage_defs=[{"name": "score", "lease": lease_s, "retry": {"initial_interval": 0.05}}])
    held = [ledger.lease(job_id) for _ in range(leases)]
    return job_id, held


def _retries(ledger, job_id):
    return Counter(f["seq"] for _, f in ledger.r.xrange(ledger.keys.job(job_id).log)
                   if f["event"] == "retry_scheduled")


def _entry(ledger, job_id):
    return ledger.r.zscore(ledger.keys.due_for(job_id), job_id)


def _calls(r):
    return {name.removeprefix("cmdstat_"): v["calls"] for name, v in r.info("commandstats").items()}


def _during(r, fn):
    """Commands Redis ran while ``fn`` ran (INFO commandstats deltas; the INFO itself left out)."""
    before = _calls(r)
    fn()
    after = _calls(r)
    delta = {c: n - before.get(c, 0) for c, n in after.items() if n != before.get(c, 0)}
    delta["info"] = delta.get("info", 0) - 1
    return {c: n for c, n in delta.items() if n}


def test_the_entry_follows_leases_heartbeats_and_retirement(ledger, make_job):
    from tests.conftest import drain

    job_id = make_job(items=list(range(6)), max_items=3,
                      stage_defs=[{"name": "score", "lease": 60}])
    assert _entry(ledger, job_id) == math.inf  # created: nothing due
    lease = ledger.lease(job_id)
    entry = _entry(ledger, job_id)  # about the lease's deadline, written in the lease's own round trip
    assert lease.lease_deadline_ms - 1000 < entry <= lease.lease_deadline_ms
    ledger.heartbeat(job_id, lease.seq, lease.lease_token)
    assert _entry(ledger, job_id) == entry  # never later than the truth: early is allowed
    sup = Supervisor(ledger, name="sup", sweep_visits=0)
    ledger.r.zadd(ledger.keys.due_for(job_id), {job_id: 0})  # pretend it is due: the visit settles it exactly
    sup.tick()
    assert _entry(ledger, job_id) == ledger.r.zscore(ledger.keys.job(job_id).leases, lease.seq)
    ledger.complete(job_id, lease.seq, lease.lease_token, {})
    drain(ledger, job_id)
    assert _entry(ledger, job_id) <= time.time() * 1000  # finished: due now, to be retired
    sup.tick()
    assert _entry(ledger, job_id) is None
    assert not ledger.r.sismember(ledger.keys.active, job_id)


def test_a_tick_over_many_idle_jobs_reads_none_of_them_and_expires_the_due_lease(ledger, jobs, make_job):
    idle = make_job(items=1000, max_items=10)
    flow_id = ledger.spec(idle).flow.id
    for _ in range(1500):
        jobs.create("acme", JobRequest(flow_id=flow_id))
    due_job, held = _expiring_job(ledger, make_job, lease_s=1.5)  # not due before the idle pass
    sup = Supervisor(ledger, name="sup", sweep_visits=0)
    sup.tick()  # the first pass checks every entry once (SSCAN + ZMSCORE pages: no per-job read)
    calls = _during(ledger.r, sup.tick)  # nothing due: no job is read
    assert sum(calls.get(c, 0) for c in PER_JOB_READS) == 0, calls
    assert calls.get("zrangebyscore") == ledger.keys.due_shards, calls  # the due index, once (a shard each)
    assert sum(calls.values()) < 20, calls
    time.sleep(max(lease.lease_deadline_ms for lease in held) / 1000 + 0.05 - time.time())
    calls = _during(ledger.r, sup.tick)  # the two leases are past their deadline
    assert _retries(ledger, due_job) == {"0": 1, "1": 1}  # expired on time
    assert sum(calls.values()) < 100, calls  # a few dozen for the due job, none per idle job
    # the safety net's full visits are a constant per pass, not a share of the jobs
    calls = _during(ledger.r, Supervisor(ledger, name="sup2", sweep_visits=20, sweep_s=3600).tick)
    assert 0 < calls.get("hgetall", 0) < 200, calls  # 20 jobs looked at, not 1,502


def test_a_lost_due_entry_is_found_by_the_sweep(ledger, make_job):
    job_id, held = _expiring_job(ledger, make_job, lease_s=1.0)
    sup = Supervisor(ledger, name="sup", sweep_visits=0, sweep_s=3600)
    sup.tick()  # the first round of the sweep has run (the leases are not due yet)
    ledger.r.zrem(ledger.keys.due_for(job_id), job_id)  # a crash between a script and its due write
    time.sleep(max(lease.lease_deadline_ms for lease in held) / 1000 + 0.05 - time.time())
    sup.tick()
    assert _retries(ledger, job_id) == {}  # the index drives expiry: a lost entry is not seen...
    sup._check_next = 0.0  # ...until the sweep's next round (every sweep_s)
    sup.tick()
    assert _retries(ledger, job_id) == {"0": 1, "1": 1}
    assert _entry(ledger, job_id) is not None
    # a supervisor that starts checks every entry in its first pass: a lost one is filed at once
    lease = ledger.lease(job_id)
    ledger.r.zrem(ledger.keys.due_for(job_id), job_id)
    time.sleep(lease.lease_deadline_ms / 1000 + 0.05 - time.time())
    Supervisor(ledger, name="sup-new", sweep_visits=0).tick()
    assert _retries(ledger, job_id)[str(lease.seq)] >= 1


def test_data_older_than_the_index_is_filed_at_the_first_pass(ledger, make_job):
    jobs_ = [_expiring_job(ledger, make_job)[0] for _ in range(3)]
    ledger.r.delete(*ledger.keys.due_keys())  # a ledger written before the due index existed
    time.sleep(0.15)
    Supervisor(ledger, name="sup", sweep_visits=0).tick()
    for job_id in jobs_:
        assert _retries(ledger, job_id) == {"0": 1, "1": 1}
        assert _entry(ledger, job_id) is not None


def test_two_supervisors_ticking_together_never_expire_a_lease_twice(ledger, make_job, redis_server):
    job_ids = [_expiring_job(ledger, make_job, leases=5)[0] for _ in range(6)]
    time.sleep(0.15)
    barrier = threading.Barrier(2)
    visited = Counter()

    def run(i):
        sup = Supervisor(Ledger(client_for(redis_server.url), ledger.settings), name=f"sup-{i}",
                         sweep_visits=0)
        real = sup._visit

        def counted(job_id):
            visited[i] += 1
            return real(job_id)

        sup._visit = counted
        barrier.wait()
        for _ in range(3):
            sup.tick()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job_id in job_ids:
        assert _retries(ledger, job_id) == {str(s): 1 for s in range(5)}
    assert sum(visited.values()) >= len(job_ids)  # each due job was looked at (by one or the other)
    # and without any claim (the expire script's own fence): four threads expiring the same leases
    for job_id in job_ids:
        for _ in range(5):
            ledger.lease(job_id)  # the retried batches, leased again (0.1 s)
    time.sleep(0.15)
    barrier = threading.Barrier(4)

    def expire_all():
        own = Ledger(client_for(redis_server.url), ledger.settings)
        barrier.wait()
        for job_id in job_ids:
            own.expire_due(job_id, actor="racer")

    threads = [threading.Thread(target=expire_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job_id in job_ids:
        assert sum(_retries(ledger, job_id).values()) == 10  # 5 leases expired twice over: once each time


def test_settling_never_loses_a_deadline_a_script_set_meanwhile(ledger, make_job, monkeypatch):
    from gateway.ledger import due as due_module

    job_id = make_job(items=list(range(6)), max_items=3, stage_defs=[{"name": "score", "lease": 60}])
    real, leased, raced = due_module.due_from, [], []

    def racing(got, now):
        out = real(got, now)
        if not raced:  # between the supervisor's read (no lease: +inf) and its write
            raced.append(True)
            leased.append(ledger.lease(job_id))
        return out

    monkeypatch.setattr(due_module, "due_from", racing)
    ledger.index.due.settle([job_id])
    monkeypatch.undo()
    assert leased[0] is not None
    assert _entry(ledger, job_id) == leased[0].lease_deadline_ms  # lowered again after the write


def test_jobs_spread_over_the_due_shards_and_a_changed_shard_count_loses_no_deadline(ledger, make_job,
                                                                                   settings):
    """With BATCHGATE_DUE_SHARDS the entries spread over the shards (crc32 of the job id); a supervisor
    started with another count moves the old shards' entries to their new shards at its first pass and
    expires every lease that fell due meanwhile, once."""
    # jobs until every shard holds one: ids are random, so a fixed count (12) left a shard of 4 empty
    # about one run in eight (4 * (3/4)^12); 60 jobs without one would be a broken hash
    made: list = []
    while len(made) < 60 and (len(made) < 8
                              or any(not ledger.r.zcard(key) for key in ledger.keys.due_keys())):
        made.append(_expiring_job(ledger, make_job, lease_s=0.3))
    used = [key for key in ledger.keys.due_keys() if ledger.r.zcard(key)]
    assert len(used) == ledger.keys.due_shards, len(made)  # the jobs spread over every shard
    other = Ledger(ledger.r, settings.model_copy(update={"due_shards": 5 if settings.due_shards == 1 else 1}))
    time.sleep(0.4)  # every lease is past its deadline
    sup = Supervisor(other, name="resharded", sweep_visits=0)
    sup.tick()
    for job_id, _ in made:
        assert _retries(other, job_id) == {"0": 1, "1": 1}  # expired on time, once
        assert other.r.zscore(other.keys.due_for(job_id), job_id) is not None  # filed in its new shard
    assert sorted(k for k in ledger.r.scan_iter(match="bg:due*")) == sorted(
        k for k in other.keys.due_keys() if other.r.exists(k))  # the old shards are gone
    sup.tick()
    assert all(_retries(other, job_id) == {"0": 1, "1": 1} for job_id, _ in made)
