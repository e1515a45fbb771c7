""""The flow may have run" through the gateway: a delivered call whose outcome is unknown is never re-run
silently for a stage that is not idempotent. With a run id, batchgate polls the run and commits its
outcome (billed once); without one, the batch fails as ``outcome_unknown`` (job view, log, retry-failed).
Idempotent stages retry. Stand-ins on 127.0.0.1 count billed runs per idempotency key."""

from __future__ import annotations

import time

import pytest
from rq import SimpleWorker
from rq.serializers import JSONSerializer

import gateway.push.dispatch
from gateway.push.dispatch import Dispatcher
from gateway.ledger.ledger import Ledger
from tests.standins import StandinCozeStudio, StandinDify

DIFY_KEY, COZE_TOKEN = "app-standin-key", "pat_standin-token"


@pytest.fixture
def push(settings, redis_client, monkeypatch):
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"],
                                      "secrets": {"acme": {"dify": DIFY_KEY, "coze": COZE_TOKEN}}})
    ledger = Ledger(redis_client, own)
    d = Dispatcher.build(own, ledger)
    monkeypatch.setattr(gateway.push.dispatch, "_DISPATCHER", d)
    return ledger, d


def stage(target: dict, idempotent: bool, **extra) -> list[dict]:
    return [{"name": "run", "idempotent": idempotent, "timeout": 2, "lease": 10, "poll_interval": 0.05,
             "retry": {"initial_interval": 0.01, "maximum_attempts": 3}, "target": target, **extra}]


def run_job(ledger: Ledger, d: Dispatcher, job_id: str, timeout_s: float = 20) -> dict:
    """Run the job's calls and its polls (RQ, scheduler included) in this process until it ends."""
    deadline = time.monotonic() + timeout_s
    while ledger.job_fields(job_id)["status"] == "running":
        assert time.monotonic() < deadline, ledger.job_fields(job_id)
        d.run_ready(job_id)
        SimpleWorker([d.queue], connection=d.queue.connection, serializer=JSONSerializer).work(
            burst=True, with_scheduler=True, logging_level="WARNING")
        time.sleep(0.05)
    return ledger.job_fields(job_id)


def dify(server: StandinDify, mode: str) -> dict:
    return {"type": "dify", "base_url": server.base_url, "api_key_secret": "dify", "mode": mode}


def test_a_cut_blocking_dify_call_is_not_rerun_for_a_stage_that_is_not_idempotent(push, make_job, api):
    ledger, d = push
    with StandinDify(api_key=DIFY_KEY, run_s=0.6, blocking_cut_s=0.2) as server:  # the gateway gives up
        job_id = make_job(items=[1, 2, 3], max_items=3, stage_defs=stage(dify(server, "blocking"), False))
        job = run_job(ledger, d, job_id)
        server.settle()
        billed = dict(server.billed)
    assert job["status"] == "failed"
    assert list(billed.values()) == [1]  # the run went on and was billed once; never again
    batch = api.get(f"/v1/jobs/{job_id}/batches/0").json()
    assert batch["status"] == "failed" and batch["error_type"] == "outcome_unknown", batch
    failed = api.get(f"/v1/jobs/{job_id}/batches", params={"status": "failed"}).json()
    assert [b["seq"] for b in failed["batches"]] == [0]


def test_a_cut_blocking_call_of_an_idempotent_stage_is_retried(push, make_job):
    ledger, d = push
    with StandinDify(api_key=DIFY_KEY, run_s=0.3, blocking_cut_s=0.1) as server:
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(dify(server, "blocking"), True))
        job = run_job(ledger, d, job_id)
        server.settle()
        billed = sum(server.billed.values())
    assert job["status"] == "failed"  # every attempt is cut: retried up to maximum_attempts
    assert billed == 3


def test_a_broken_dify_stream_is_polled_by_run_id_and_billed_once(push, make_job):
    ledger, d = push
    with StandinDify(api_key=DIFY_KEY, run_s=0.4, break_after_s=0.1, sticks_on_hangup=False) as server:
        job_id = make_job(items=[1, 2], max_items=1, stage_defs=stage(dify(server, "streaming"), False))
        job = run_job(ledger, d, job_id)
        server.settle()
        billed = dict(server.billed)
    assert job["status"] == "succeeded", job
    assert sorted(billed.values()) == [1, 1]


def test_a_dify_stream_read_to_the_end_leaves_no_stuck_run(push, make_job):
    ledger, d = push
    with StandinDify(api_key=DIFY_KEY, run_s=0.3) as server:
        job_id = make_job(items=[1, 2, 3], max_items=1, stage_defs=stage(dify(server, "streaming"), False))
        job = run_job(ledger, d, job_id)
        server.settle()
        stuck, billed = server.stuck_runs(), dict(server.billed)
    assert job["status"] == "succeeded", job
    assert stuck == [] and sorted(billed.values()) == [1, 1, 1]


def test_coze_studio_timeout_with_a_run_is_learned_by_polling_not_rerun(push, make_job, api):
    ledger, d = push
    with StandinCozeStudio(token=COZE_TOKEN) as server:
        server.plan("timeout")  # 6023: the run was created and billed; its history says Fail
        target = {"type": "coze", "base_url": server.base_url, "token_secret": "coze", "workflow_id": "7391",
                  "studio": True}
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(target, False))
        job = run_job(ledger, d, job_id)
        server.settle()
        billed = sum(server.billed.values())
    assert billed == 1  # learned from the run history, not run again
    assert job["status"] == "failed"
    batch = api.get(f"/v1/jobs/{job_id}/batches/0").json()
    assert batch["status"] == "failed" and batch["attempt"] == 1, batch
    events = [e["event"] for e in api.get(f"/v1/jobs/{job_id}/log").json()["entries"]]
    assert "outcome_unknown_polling" in events  # it asked the run history before deciding


@pytest.mark.parametrize("idempotent, status, attempts", [(False, "failed", 1), (True, "failed", 2)])
def test_a_poll_that_reports_running_forever_ends_at_max_run(push, make_job, api, idempotent, status,
                                                              attempts):
    """Dify's stuck run: the stream broke after workflow_started and the run stays `running` for ever.
    The polls stop at max_run; its retry class decides (idempotent: retried, here up to 2 attempts)."""
    ledger, d = push
    with StandinDify(api_key=DIFY_KEY, run_s=0.5, break_after_s=0.05) as server:
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(
            dify(server, "streaming"), idempotent, lease=1, max_run=1.5,
            retry={"initial_interval": 0.01, "maximum_attempts": 2}))
        started = time.monotonic()
        job = run_job(ledger, d, job_id, timeout_s=30)
        took = time.monotonic() - started
        stuck = server.stuck_runs()
    assert job["status"] == status
    batch = api.get(f"/v1/jobs/{job_id}/batches/0").json()
    assert batch["error_type"] == "max_run" and batch["attempts_spent"] == attempts, batch
    assert len(stuck) == attempts  # each attempt's run stuck in Dify; none held the batch for ever
    assert took < 10 * attempts


def test_a_lost_poll_asks_the_platform_about_the_run_before_triggering_again(push, make_job, api):
    """A worker dies while a run is being polled (the scheduled poll is lost): when the lease runs out,
    the next attempt polls the run the platform gave instead of starting (and paying for) another."""
    ledger, d = push
    with StandinDify(api_key=DIFY_KEY, run_s=0.3, break_after_s=0.05, sticks_on_hangup=False) as server:
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(dify(server, "streaming"), False, lease=1))
        assert d.run_ready(job_id) == 1  # the stream broke after workflow_started: a poll is scheduled
        registry = d.queue.scheduled_job_registry
        for lost in registry.get_job_ids():  # ... and lost with its worker
            registry.remove(lost)
        time.sleep(1.1)
        assert [seq for seq, _ in ledger.expire_due(job_id)] == [0]
        job = run_job(ledger, d, job_id)
        server.settle()
        billed = sum(server.billed.values())
    assert job["status"] == "succeeded", job
    assert billed == 1
    events = [e["event"] for e in api.get(f"/v1/jobs/{job_id}/log").json()["entries"]]
    assert "asking_about_earlier_run" in events


def test_a_lost_n8n_callback_is_asked_about_by_execution_id_before_triggering_again(push, make_job, api):
    """n8n answered the callback-mode trigger with an execution id and the callback never came: when the
    lease runs out, the next attempt asks n8n's API about that execution and commits it; no new run."""
    from tests.connectors.helpers import HOOK_SECRET, N8N_API_KEY
    from tests.connectors.test_n8n_connector import StandInN8n

    class SavingN8n(StandInN8n):
        """Saves successful executions with their data, as polled flows must."""

        def handle_api(self, handler):
            execution_id = handler.path.split("?")[0].rsplit("/", 1)[1]
            if self.executions.get(execution_id) == ["success"]:
                del self.executions[execution_id]
                answer = {"status": "succeeded", "output": {"scored": 1}}
                run_data = {"Respond": [{"data": {"main": [[{"json": answer}]]}}]}
                return self.send(handler, 200, {
                    "id": execution_id, "finished": True, "status": "success",
                    "data": {"resultData": {"lastNodeExecuted": "Respond", "runData": run_data}}})
            return super().handle_api(handler)

    ledger, d = push
    secrets = {"acme": {"hook": HOOK_SECRET, "n8n": N8N_API_KEY}}
    d.settings = d.settings.model_copy(update={"secrets": secrets})
    server = SavingN8n()
    try:
        server.mode = "execution"  # answers {"executionId"}; the execution reports running, then success
        target = {"type": "n8n", "url": server.url, "mode": "callback", "auth_secret": "hook",
                  "api_url": server.base_url, "api_key_secret": "n8n"}
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(target, False, lease=1))
        assert d.run_ready(job_id) == 1  # triggered; the callback is lost
        time.sleep(1.1)
        assert [seq for seq, _ in ledger.expire_due(job_id)] == [0]
        job = run_job(ledger, d, job_id)
    finally:
        server.close()
    batch = api.get(f"/v1/jobs/{job_id}/batches/0").json()
    assert job["status"] == "succeeded", batch
    assert batch["stages"]["run"]["output"] == {"scored": 1}
    assert server.webhook_calls == 1  # asked about, never triggered again
    events = [e["event"] for e in api.get(f"/v1/jobs/{job_id}/log").json()["entries"]]
    assert "asking_about_earlier_run" in events
