"""The push worker's feeder (gateway/push/worker.py) in this process: which jobs it feeds, and that a
feeding pass that fails is logged and feeding goes on (a feeder thread that ended would leave the
process up and every push job waiting)."""

from __future__ import annotations

import threading

import pytest

import gateway.push.dispatch
from gateway.push.dispatch import Dispatcher
from gateway.push.supervisor import Supervisor
from gateway.push.worker import PushWorker
from tests.platforms import SlowSyncPlatform


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})


def push_stage(url: str) -> list[dict]:
    return [{"name": "call", "target": {"type": "http", "url": url, "mode": "sync"}}]


def test_workers_are_fed_only_jobs_that_have_push_stages(ledger, make_job, redis_client):
    """The supervisor kicks every running job on every pass; a pull-only job must not join the set the
    push workers poll (with 10,000 pull jobs running, every worker would look at each once a second)."""
    d = Dispatcher.build(ledger.settings, ledger)
    pull = make_job(items=4)
    push = make_job(items=4, stage_defs=push_stage("http://127.0.0.1:9/x"))
    Supervisor(ledger, dispatcher=d).tick()
    assert d.fed_jobs() == [push]
    assert redis_client.lrange(ledger.keys.push_wake, 0, -1) == [push]

    # a pull job an older version registered: a worker's first look drops it, leasing nothing
    redis_client.sadd(ledger.keys.push_jobs, pull)
    worker = PushWorker(d.queue, concurrency=1, grace_s=1)
    assert worker._lease(d, pull) is None
    assert d.fed_jobs() == [push]
    assert ledger.job_fields(pull)["status"] == "running" and ledger.lease(pull) is not None


def test_a_feeding_pass_that_fails_is_logged_and_feeding_goes_on(ledger, make_job, monkeypatch, caplog):
    d = Dispatcher.build(ledger.settings, ledger)
    monkeypatch.setattr(gateway.push.dispatch, "_DISPATCHER", d)  # the worker's threads use this one
    platform = SlowSyncPlatform(delay=0.0)
    try:
        job_id = make_job(items=list(range(6)), max_items=3, stage_defs=push_stage(platform.url))
        d.kick(job_id)
        worker = PushWorker(d.queue, concurrency=2, grace_s=5)
        real, failures = worker.feed_pass, []

        def feed_pass(*args, **kwargs):
            if not failures:  # the first pass meets a bug or an answer nobody expected
                failures.append(1)
                raise KeyError("unexpected")
            return real(*args, **kwargs)

        monkeypatch.setattr(worker, "feed_pass", feed_pass)
        callers = [threading.Thread(target=worker._call_loop, daemon=True) for _ in range(2)]
        for t in callers:
            t.start()
        feeder = threading.Thread(target=worker.feed, args=(True,), daemon=True)  # burst: ends when idle
        feeder.start()
        feeder.join(30)
        worker.stop.set()
        seqs = platform.seqs()
    finally:
        platform.close()
    assert not feeder.is_alive()
    assert failures and "a feeding pass failed" in caplog.text
    assert ledger.job_fields(job_id)["status"] == "succeeded"
    assert sorted(seqs) == [0, 1]  # each batch called once


def test_a_worker_whose_feeder_ends_exits_1_for_its_process_manager(ledger, monkeypatch, caplog):
    d = Dispatcher.build(ledger.settings, ledger)
    monkeypatch.setattr(gateway.push.dispatch, "_DISPATCHER", d)
    worker = PushWorker(d.queue, concurrency=2, grace_s=1)
    monkeypatch.setattr(worker.polls, "start", lambda burst=False: None)  # no RQ threads here
    monkeypatch.setattr(worker, "feed", lambda burst=False: None)  # the feeder thread ends at once
    try:
        assert worker.run(burst=False, install_signals=False) == 1
    finally:
        gateway.push.dispatch.STOPPING.clear()  # process-wide: later tests' calls must not see a stop
    assert "feeder thread ended unexpectedly" in caplog.text
